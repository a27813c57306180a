"""GPU acceptance: the app's training step on one GPU against a bare PyTorch loop, with AMP and channels-last.

`train_hvd.py --benchmark` (one rank, plain python, no launcher) and `bench/bare_loop.py --device cuda` train the same
model on the same in-memory synthetic batch with the same precision, memory format and optimizer. For each --amp
mode the two alternate as bench/run.py does (app then bare, bare then app, ...) over --rounds rounds; the table gives
each one's images/s and the per-round ratio app / bare as min / median / max (goal: >= 0.97).

    python bench/gpu_acceptance.py                                      # resnet50, 224 px, batch 128, bf16 and fp16
    python bench/gpu_acceptance.py --rounds 5 --write-doc docs/benchmarks.md
    python bench/gpu_acceptance.py --device cpu --model small_cnn --image-size 32 --batch-size 16 --rounds 1 --quick

--write-doc replaces the section between this script's markers in the given Markdown file (or appends one): the
table, the device, driver, torch and CUDA versions, the date and the command. --quick checks the pipeline, not the
speed. On the CPU, fp16 (GPU only, as in the app) is left out.
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile

from run import PY, Bench, fmt, job_env, ratio_row

GOAL = 0.97
TITLE = "GPU: one-GPU overhead"
BEGIN = "<!-- bench/gpu_acceptance.py: begin (--write-doc replaces everything up to the end marker) -->"
END = "<!-- bench/gpu_acceptance.py: end -->"


def measure(bench, args, amp):
    """One row: the app and the bare loop alternated over the rounds, with `--amp amp --channels-last`."""
    steps = (2, 3, 2) if args.quick else (10, 10, 10)  # warm-up steps, timed iterations, steps per iteration
    same = ["--amp", amp, "--channels-last", "--device", args.device]
    app_flags = same + ["--data.synthetic_classes", str(args.classes)]
    bare_flags = same + ["--classes", str(args.classes)]
    if args.device == "cpu":
        bare_flags += ["--threads", str(os.cpu_count() or 1)]  # the app alone takes every core, as in bench/run.py
    env = job_env()

    def app():
        s = bench.app([PY], args.model, args.image_size, args.batch_size, steps, env, app_flags)
        check(s, "app", amp)
        return s["img_per_sec_total"]

    def bare():
        r = bench.peer([PY], "bench/bare_loop.py", args.model, args.image_size, args.batch_size, steps, env,
                       bare_flags)
        check(r, "bare loop", amp)
        return r["img_per_sec_total"]

    apps, bares = bench.alternate(app, bare)
    return ratio_row(f"{args.model} {args.image_size}px, batch {args.batch_size}, --amp {amp} --channels-last",
                     "app (--benchmark, 1 rank) / bare PyTorch loop", f">= {GOAL}", apps, bares)


def check(result, who, amp):
    """Both sides must have run what the row says (the app reports its weights' layout as trained)."""
    if result.get("amp") != amp or result.get("channels_last") is not True:
        sys.exit(f"gpu_acceptance: the {who} ran amp={result.get('amp')!r}, channels_last="
                 f"{result.get('channels_last')!r}; expected {amp!r} and True")


def machine(device):
    import torch

    if device == "cuda":
        name = torch.cuda.get_device_name(0)
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {"device": name, "driver": driver_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda or "none", "python": platform.python_version()}


def driver_version():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else "unknown"


def table(rows):
    lines = ["| model, setting | compared | app img/s (median) | bare img/s (median) | ratio min | ratio median | "
             "ratio max | goal |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        r = row["ratio"]
        lines.append(f"| {row['figure']} | {row['compared']} | {fmt(row['a']['median'], 4)} | "
                     f"{fmt(row['b']['median'], 4)} | {fmt(r['min'])} | {fmt(r['median'])} | {fmt(r['max'])} | "
                     f"{row['goal']} |")
    return "\n".join(lines)


def section(results):
    m = results["machine"]
    return "\n".join([
        BEGIN, f"## {TITLE}", "",
        f"{m['device']}, driver {m['driver']}, torch {m['torch']}, CUDA {m['cuda']}, Python {m['python']}; "
        f"{results['date']}; {results['rounds']} alternated round(s); `{results['command']}`.", "",
        "`train_hvd.py --benchmark` with one rank (plain `python`, no launcher) against `bench/bare_loop.py "
        f"--device {results['device_kind']}`: the same model, in-memory synthetic batch, SGD with momentum, "
        "precision and channels-last memory format; the ratio is app / bare in each round.", "",
        table(results["rows"]), END])


def write_doc(path, text):
    """Replace this script's section in the Markdown file at `path`, or append it: the file holds it once."""
    old = open(path).read() if os.path.exists(path) else ""
    start, end = old.find(BEGIN), old.find(END)
    if start >= 0 and end > start:
        new = old[:start] + text + old[end + len(END):]
    elif start < 0 and end < 0:
        new = (old.rstrip("\n") + "\n\n" if old.strip() else "") + text + "\n"
    else:
        sys.exit(f"gpu_acceptance: {path} holds only one of this script's markers; mend it by hand:\n{BEGIN}\n{END}")
    with open(path, "w") as f:
        f.write(new)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda: GPU 0; cpu: test the pipeline")
    p.add_argument("--model", default="resnet50", help="a name from the app's model registry")
    p.add_argument("--image-size", type=int, default=224, help="side of the square synthetic images, in pixels")
    p.add_argument("--batch-size", type=int, default=128, help="samples per step on the GPU")
    p.add_argument("--classes", type=int, default=1000, help="number of classes (1000: ImageNet's, as Horovod's "
                   "synthetic benchmark)")
    p.add_argument("--amp", default="bf16,fp16", help="comma-separated AMP modes, one row each (bf16, fp16)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds of each comparison")
    p.add_argument("--quick", action="store_true", help="a few steps only: checks the pipeline, not the speed")
    p.add_argument("--write-doc", metavar="MARKDOWN", help=f"replace or append the section \"{TITLE}\" there")
    p.add_argument("--out", metavar="JSON", help="also write every figure as JSON here")
    p.add_argument("--require-goal", action="store_true",
                   help=f"exit 1 when a row's median ratio is under the goal ({GOAL})")
    args = p.parse_args()
    amps = [a.strip() for a in args.amp.split(",") if a.strip()]
    if not amps or any(a not in ("bf16", "fp16") for a in amps):
        p.error(f"--amp {args.amp}: choose from bf16, fp16 (comma-separated)")
    if args.rounds < 1 or args.batch_size < 1:
        p.error("--rounds and --batch-size must be 1 or more")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible (torch.cuda.is_available() is False); --device cpu tests the "
                "pipeline")
    if args.device == "cpu" and "fp16" in amps:
        print("gpu_acceptance: --amp fp16 needs a GPU (as in the app): left out on the CPU", flush=True)
        amps.remove("fp16")
        if not amps:
            p.error("nothing left to measure on the CPU: add --amp bf16")

    results = {"date": datetime.date.today().isoformat(), "rounds": args.rounds, "quick": args.quick,
               "device_kind": args.device, "goal": GOAL,
               "command": " ".join(["python bench/gpu_acceptance.py"] + [shlex.quote(a) for a in sys.argv[1:]]),
               "rows": []}
    workdir = tempfile.mkdtemp(prefix="hvd-gpu-acceptance-")
    try:
        bench = Bench(argparse.Namespace(repeats=args.rounds, quick=args.quick), workdir)
        for amp in amps:
            print(f"gpu_acceptance: --amp {amp} --channels-last, {args.rounds} round(s) ...", flush=True)
            results["rows"].append(measure(bench, args, amp))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["machine"] = machine(args.device)  # after the runs: no CUDA context of ours beside theirs
    text = section(results)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, sort_keys=True)
    if args.write_doc:
        write_doc(args.write_doc, text)
        print(f"gpu_acceptance: wrote the section \"{TITLE}\" in {args.write_doc}")
    short = [row["figure"] for row in results["rows"] if (row["ratio"]["median"] or 0) < GOAL]
    if short:
        print(f"gpu_acceptance: under the goal ({GOAL}): {'; '.join(short)}")
    return 1 if short and args.require_goal else 0


if __name__ == "__main__":
    sys.exit(main())
