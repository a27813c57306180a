"""Benchmark mode, --stop-at, Horovod's tuning defaults and the bench/ suite: real runs on the CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import BIN, QUIET, ROOT, TRAIN, assert_refused, job_env, launch, read_json

sys.path.insert(0, str(ROOT / "bench"))
import mpis  # noqa: E402  (install.sh's PyPI MPIs and its default)

TINY = ["--model", "small_cnn", "--image-size", "12", "--batch-size", "8", "--num-warmup-batches", "2",
        "--num-iters", "3", "--num-batches-per-iter", "2"]


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", [pytest.param("horovodrun-gloo", marks=pytest.mark.extended), "mpirun"])
def test_benchmark_mode_reports_images_per_second_per_rank_and_in_total(tmp_path, launcher):
    proc = launch(launcher, 2, TRAIN, "--benchmark", *TINY, "--output-dir", tmp_path, *QUIET)
    s = read_json(tmp_path / "summary.json")
    assert s["mode"] == "benchmark" and s["world_size"] == 2 and s["image_size"] == 12
    by_rank = s["img_per_sec_by_rank"]
    assert len(by_rank) == 2 and all(len(r) == 3 and min(r) > 0 for r in by_rank)  # every rank's iterations
    flat = torch.tensor(by_rank, dtype=torch.float64).flatten()  # the app sums in double precision too
    assert s["img_per_sec_per_rank"] == pytest.approx(flat.mean().item())
    assert s["img_per_sec_per_rank_ci95"] == pytest.approx(1.96 * flat.std(unbiased=False).item())
    assert s["img_per_sec_total"] == pytest.approx(sum(sum(r) / len(r) for r in by_rank))
    assert "img/sec per rank:" in proc.stdout and "total img/sec on 2 rank(s):" in proc.stdout
    assert not (tmp_path / "checkpoints").exists()  # times steps, trains nothing worth keeping


def test_benchmark_defaults_to_imagenet_sized_images_for_torchvision_models(tmp_path, app):
    result = app("--benchmark", "--model", "mobilenet_v3_small", "--batch-size", "2", "--num-warmup-batches", "0",
                 "--num-iters", "1", "--num-batches-per-iter", "1", "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    s = read_json(tmp_path / "summary.json")
    assert (s["model"], s["image_size"], s["batch_size_per_rank"], s["world_size"]) == ("mobilenet_v3_small", 224, 2, 1)
    # One iteration on one rank: the per-rank mean and the total are that iteration's figure, and the log says it.
    [[rate]] = s["img_per_sec_by_rank"]
    assert rate > 0 and s["img_per_sec_per_rank"] == pytest.approx(rate) == s["img_per_sec_total"]
    assert s["img_per_sec_per_rank_ci95"] == 0
    assert f"total img/sec on 1 rank(s): {rate:.1f}" in result.stdout


def test_benchmark_never_replaces_a_training_run(tmp_path, app):
    assert app("--epochs", "1", "--output-dir", tmp_path).returncode == 0
    before = (tmp_path / "summary.json").read_bytes()
    line = assert_refused(app("--benchmark", *TINY, "--output-dir", tmp_path), "holds a training run")
    assert "--overwrite" in line and (tmp_path / "summary.json").read_bytes() == before
    # An earlier benchmark's figures may be replaced by a new benchmark.
    first = []
    for _ in range(2):
        assert app("--benchmark", *TINY, "--output-dir", tmp_path / "b").returncode == 0
        first.append(read_json(tmp_path / "b" / "summary.json")["img_per_sec_by_rank"])
    assert first[0] != first[1]  # the second benchmark's own timings replaced the first one's


@pytest.mark.distributed
def test_stop_at_ends_training_at_the_first_epoch_that_reaches_the_target(tmp_path):
    launch("horovodrun-gloo", 2, TRAIN, "--epochs", "10", "--stop-at", "90", "--output-dir", tmp_path, *QUIET)
    s = read_json(tmp_path / "summary.json")
    accs = [r["val_acc1"] for r in s["history"]]
    assert s["stopped_at_epoch"] == len(accs) < 10
    assert accs[-1] >= 90 and all(a < 90 for a in accs[:-1])
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["epoch"] == len(accs)
    assert all(r["wall_seconds"] > 0 for r in s["history"])


@pytest.fixture
def environment():
    """os.environ, put back as it was after the test: hvd_utils.runtime sets Horovod's variables in it."""
    saved = dict(os.environ)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def test_tuning_defaults_follow_the_device_and_the_launcher_wins(environment):
    from hvd_utils import runtime

    for key in ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "OMPI_MCA_mpi_yield_when_idle"):
        environment.pop(key, None)
    first, second = runtime.tuning_env("cpu", kind="mpi"), runtime.tuning_env("cpu", 4, 2.5, kind="gloo")
    assert environment["OMPI_MCA_mpi_yield_when_idle"] == "1"  # OpenMPI yields the core while it waits
    assert first == {"fusion_threshold_mb": 8.0, "cycle_time_ms": 1.0}
    assert second == first  # set once (as horovodrun would): later defaults do not override it
    for kind, cycle in (("gloo", 10.0), ("alone", 100.0)):
        for key in ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME"):
            environment.pop(key)
        assert runtime.tuning_env("cpu", kind=kind) == {"fusion_threshold_mb": 8.0, "cycle_time_ms": cycle}, kind
    environment.update(HOROVOD_FUSION_THRESHOLD=str(64 << 20), HOROVOD_CYCLE_TIME="3")
    assert runtime.tuning_env("cuda", -1, 0, "mpi") == {"fusion_threshold_mb": 64.0, "cycle_time_ms": 3.0}


@pytest.mark.parametrize("launch, kind", [
    ({}, "alone"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}, "alone"),  # mpirun -np 1
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "alone"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}, "mpi"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, "mpi"),  # python alone inside an 8-task allocation: the safe side
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_CONTROLLER": "gloo"}, "gloo"),  # horovodrun --gloo
])
def test_launch_kind_is_read_from_the_launchers_variables(environment, launch, kind):
    from hvd_utils import runtime

    for key in [k for k in environment if k.startswith(("OMPI_COMM", "PMI", "SLURM", "HOROVOD_"))]:
        del environment[key]
    environment.update(launch)
    assert runtime.launch_kind() == kind


@pytest.mark.distributed
def test_app_logs_the_tuning_in_effect_and_horovodrun_flags_override_it(tmp_path, app):
    # Gloo's and MPI's defaults are checked on the default runs (tests/launch/test_every_launcher_trains.py).
    alone = app("--epochs", "1", "--output-dir", tmp_path / "one")
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert "cycle 100 ms" in alone.stdout  # alone: nothing to coordinate
    cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", "--cycle-time-ms", "2",
           "--fusion-threshold-mb", "16", sys.executable, str(TRAIN), "--epochs", "1", "--output-dir",
           str(tmp_path / "b"), *QUIET]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = read_json(tmp_path / "b" / "summary.json")
    assert (s["fusion_threshold_mb"], s["cycle_time_ms"]) == (16.0, 2.0)


@pytest.mark.distributed
def test_fused_and_fp16_allreduce_average_across_ranks(tmp_path, worker):
    launch("horovodrun-mpi", 2, worker("allreduce_average.py"), tmp_path / "out.json")
    got = read_json(tmp_path / "out.json")
    shapes = [(3,), (4, 5), (1000,), (2, 3, 3)]
    for i, s in enumerate(shapes):
        base = torch.arange(torch.Size(s).numel()) * 0.5
        expected = base + 1.5  # the mean of rank 0's (+1) and rank 1's (+2)
        assert torch.allclose(torch.tensor(got["fused"][i]), expected)
        assert torch.allclose(torch.tensor(got["fp16"][i]), expected, rtol=1e-3, atol=0.5)  # fp16 steps at 500
    assert got["dtypes"] == ["torch.float32"] * 4  # decompressed back


@pytest.mark.distributed
def test_allreduce_benchmark_reports_busbw_for_horovod_and_torch(tmp_path):
    env = job_env()
    args = ["--what", "both", "--max-bytes", str(16 << 10), "--min-seconds", "0.02", "--min-iters", "2",
            "--model", "small_cnn"]
    hvd_cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
               "bench/allreduce.py", "--backend", "horovod", "--out", str(tmp_path / "h.json"), *args]
    torch_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "bench/allreduce.py", "--backend", "torch", "--out", str(tmp_path / "t.json"), *args]
    for cmd in (hvd_cmd, torch_cmd):
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    for name, backend in (("h.json", "horovod_gloo"), ("t.json", "torch_gloo")):
        r = read_json(tmp_path / name)
        assert r["backend"] == backend and r["world_size"] == 2
        assert [p["bytes"] for p in r["sweep"]] == [4096, 16384]
        for p in r["sweep"]:
            assert p["busbw"] == pytest.approx(p["bytes"] / p["seconds"])  # 2(n-1)/n = 1 for n = 2
        assert r["grads"]["tensors"] == 8 and r["grads"]["seconds"] > 0


def bench_files():
    """bench/'s files (not Python's caches) and when each was last written."""
    return {p: p.stat().st_mtime_ns for p in (ROOT / "bench").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.distributed
@pytest.mark.extended
def test_make_bench_pipeline_writes_a_table_and_never_replaces_a_result(tmp_path):
    # Without --results-dir the results go under runs/bench/ (ignored by git), not into bench/: read from the
    # argument parser, so no benchmark runs for it.
    code = "import sys; sys.path.insert(0, 'bench'); import run; print(run.parser().parse_args([]).results_dir)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=job_env(), capture_output=True, text=True,
                         check=True, timeout=120)
    assert Path(out.stdout.strip()).resolve() == ROOT / "runs" / "bench"
    before = bench_files()
    cmd = [sys.executable, "bench/run.py", "--quick", "--repeats", "1", "--results-dir", str(tmp_path), "--sections"]
    # The second run, of another section, has to find the first one's files there and write beside them.
    for sections in ("overhead,peer,accuracy", "data,pipeline,shard,mpi"):
        proc = subprocess.run(cmd + [sections], cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        if sections == "overhead,peer,accuracy":
            first_output = proc.stdout
        else:
            second_output = proc.stdout
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 4 and sum(f.endswith("-2.json") for f in files) == 1
    assert bench_files() == before  # nothing under bench/ written or added
    result = read_json(tmp_path / next(f for f in files if f.endswith(".json") and not f.endswith("-2.json")))
    figures = {r["figure"].split(",")[0]: r for r in result["rows"]}
    assert set(figures) == {"overhead", "peer", "time to 90% val top-1"}
    for name in ("overhead", "peer"):
        ratio = figures[name]["ratio"]
        assert ratio["n"] == 1 and ratio["min"] == ratio["median"] == ratio["max"] > 0
        assert ratio["median"] == pytest.approx(figures[name]["a"]["median"] / figures[name]["b"]["median"])
    assert figures["time to 90% val top-1"]["seconds"]["median"] > 0
    assert "| overhead, small_cnn" in first_output and "| peer, small_cnn" in first_output
    second = read_json(tmp_path / next(f for f in files if f.endswith("-2.json")))
    # The data section: each loader (image folder and tar shards, 0 and 1 workers) against a training step.
    data, pipeline, shard = second["rows"][:4], second["rows"][4:7], second["rows"][7:]
    assert [r["figure"] for r in data] == [f"data, {source}, --workers {w}" for source in
                                           ("image folder (JPEG)", "tar shards (local)") for w in (0, 1)]
    # The pipeline section, on a CPU: one loader worker's images/s, the app's against torchvision's for photos; for
    # arrays the app's against its float path before and torchvision's.
    assert [r["figure"].split(",")[1].strip() for r in pipeline] == ["JPEG folder (500x375) to 224 px"] + \
        ["CIFAR-shaped arrays"] * 2
    # The shard section: the state each of 2 ranks holds sharded is half the whole state.
    assert [r["figure"].split(",")[0] for r in shard] == ["optimizer state per rank", "peak memory per rank",
                                                          "training rate"]
    assert 0.45 < shard[0]["ratio"]["median"] < 0.55, shard[0]
    for row in second["rows"]:
        assert row["a"]["median"] > 0 and row["b"]["median"] > 0
        assert row["ratio"]["median"] == pytest.approx(row["a"]["median"] / row["b"]["median"])
    # The mpi section: each MPI install.sh --mpi offers, its own in-place allreduce and the shared-memory one
    # Horovod calls on one node (set up through that MPI), against the memory copy; install.sh picks the system's
    # where there is one, else its PyPI default (MPICH), and the section says which.
    system = mpis.system_mpi(job_env())
    default = "system" if system else mpis.pypi_default()
    rows = {(m["kind"], m.get("way")): m for m in second["mpi"]["mpis"]}
    if system is None:
        assert rows.pop(("system", None))["library"] == "none on this machine"
        assert "| system | - | none on this machine |" in second_output
    kinds = (["system"] if system else []) + ["openmpi", "mpich", "impi"]
    assert list(rows) == [(kind, way) for kind in kinds for way in ("MPI_Allreduce", "shared memory")]
    assert [key for key, m in rows.items() if m["default"]] == [(default, "MPI_Allreduce"),
                                                                (default, "shared memory")]
    assert [key for key, m in rows.items() if m["horovod"]] == [(kind, "shared memory") for kind in kinds]
    memory = second["mpi"]["memory"]
    libraries = {"openmpi": "Open MPI v5", "mpich": "MPICH", "impi": "Intel"}
    for kind in kinds:
        for way in ("MPI_Allreduce", "shared memory"):
            m = rows[kind, way]
            assert libraries.get(kind, "") in m["library"], m
            assert [p["bytes"] for p in m["sweep"]] == [4096, 16384, 65536], m
            for p in m["sweep"]:
                assert p["busbw"] == pytest.approx(p["bytes"] / p["seconds"]) and p["of_copy"] > 0
                assert p["of_memory"] == pytest.approx(p["busbw"] / memory)
    assert f"| {default} * | MPI_Allreduce | " in second_output
    assert f"| {default} * | shared memory (H) | " in second_output


@pytest.mark.distributed
@pytest.mark.extended
def test_bench_comm_and_compile_sections_write_their_rows(tmp_path):
    cmd = [sys.executable, "bench/run.py", "--quick", "--repeats", "1", "--sections", "comm,compile",
           "--results-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = read_json(next(tmp_path.glob("*.json")))
    rows = {(r["figure"], r["compared"]): r for r in result["rows"]}
    kinds = sorted({figure.split(",")[0] for figure, _ in rows})
    assert kinds == ["comm-bound", "compile", "compile time"], kinds
    for (figure, compared), row in rows.items():
        assert row["ratio"]["n"] == 1 and row["a"]["median"] > 0 and row["b"]["median"] > 0, (figure, compared)
    assert sum("empty cache" in c for _, c in rows) == 1 and sum("cached (rerun)" in c for _, c in rows) == 1
    # The bfloat16 wire against DDP's bf16_compress_hook, float32 and fp16.
    assert sum("--bf16-allreduce /" in c for _, c in rows) == 3
    # The build's shared-memory allreduce against the MPI's own.
    assert sum("/ MPI_Allreduce (HVD_TRAIN_SHM_ALLREDUCE=0)" in c for _, c in rows) == 1


@pytest.mark.extended
def test_bench_recipe_section_compares_the_recipes_with_timms_loop(tmp_path):
    cmd = [sys.executable, "bench/run.py", "--quick", "--repeats", "1", "--sections", "recipe", "--results-dir",
           str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(next(tmp_path.glob("*.json")).read_text())["rows"]
    names = [r["figure"] for r in rows]
    assert names == ["val top-1, plain (--no-aug)", "val top-1, default augmentation", "val top-1, full recipe",
                     "val top-1, full recipe through timm's components"]
    for row in rows:
        assert len(row["values"]) == 1 and all(0 <= v <= 100 for v in row["values"]) and row["sd"] >= 0
    assert "timm's components" in next(tmp_path.glob("*.md")).read_text()


def test_bench_refuses_unknown_sections():
    proc = subprocess.run([sys.executable, "bench/run.py", "--sections", "overhead,speed"], cwd=ROOT,
                          env=job_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown speed" in proc.stderr


@pytest.mark.extended
def test_gpu_acceptance_pipeline_on_the_cpu_writes_its_doc_section_once(tmp_path):
    doc = tmp_path / "benchmarks.md"
    original = (ROOT / "docs" / "benchmarks.md").read_text()
    doc.write_text(original)
    begin, end = "<!-- bench/gpu_acceptance.py: begin", "<!-- bench/gpu_acceptance.py: end -->"
    cmd = [sys.executable, "bench/gpu_acceptance.py", "--device", "cpu", "--model", "small_cnn", "--image-size", "32",
           "--batch-size", "16", "--rounds", "1", "--quick", "--write-doc", str(doc), "--out", str(tmp_path / "r.json")]
    # The shipped page holds the section already: the run replaces it.
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = doc.read_text()
    assert text != original and original.count(begin) == 1
    assert text.count(begin) == text.count(end) == text.count("## GPU: one-GPU overhead") == 1
    # Everything outside the section stays as it was.
    assert text[:text.index(begin)] == original[:original.index(begin)]
    assert text[text.index(end):] == original[original.index(end):]
    result = read_json(tmp_path / "r.json")
    assert [row["figure"] for row in result["rows"]] == ["small_cnn 32px, batch 16, --amp bf16 --channels-last"]
    row = result["rows"][0]
    assert row["a"]["median"] > 0 and row["b"]["median"] > 0 and row["ratio"]["n"] == 1
    assert row["ratio"]["median"] == pytest.approx(row["a"]["median"] / row["b"]["median"])
    section = text[text.index(begin):text.index(end)]
    assert "| small_cnn 32px, batch 16, --amp bf16 --channels-last |" in section and "driver " in section
    assert f"torch {torch.__version__}" in section and "`python bench/gpu_acceptance.py --device cpu" in section
    assert "fp16 needs a GPU" in proc.stdout  # left out on the CPU, and said so

    # A file without the section gets it appended, once however often it is written.
    code = ("import sys; sys.path.insert(0, 'bench'); import gpu_acceptance as g; "
            "[g.write_doc(sys.argv[1], g.BEGIN + '\\n## x ' + str(i) + '\\n' + g.END) for i in range(2)]")
    plain = tmp_path / "plain.md"
    plain.write_text("# Benchmarks\n\nsome text\n")
    subprocess.run([sys.executable, "-c", code, str(plain)], cwd=ROOT, env=job_env(), check=True, timeout=120)
    assert plain.read_text().startswith("# Benchmarks\n\nsome text\n\n<!-- bench/gpu_acceptance.py: begin")
    assert plain.read_text().count(begin) == 1 and "## x 1" in plain.read_text() and "## x 0" not in plain.read_text()
