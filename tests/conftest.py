"""Helpers for launching real Horovod jobs from tests: horovodrun (Gloo or MPI), mpirun, or one plain process."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"
BIN = Path(sys.executable).parent
LAUNCHERS = ("horovodrun-gloo", "horovodrun-mpi", "mpirun", "single")


def job_env():
    env = dict(os.environ)
    # The venv's python and horovodrun first, and the project importable from every rank.
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    # OpenMPI refuses to start as root (CI and containers) unless told this is intended.
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    return env


def launch_command(launcher, np, args):
    python = [sys.executable]
    if launcher == "horovodrun-gloo":
        return [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo"] + python + args
    if launcher == "horovodrun-mpi":
        return [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--mpi"] + python + args
    if launcher == "mpirun":
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            pytest.fail("mpirun not found: scripts/install.sh installs OpenMPI")
        # -bind-to none: OpenMPI would pin each rank to one core, starving the threads torch starts.
        return [mpirun, "-np", str(np), "--oversubscribe", "-bind-to", "none", "-map-by", "slot"] + python + args
    if launcher == "single":
        assert np == 1, "a single process is one rank"
        return python + args
    raise ValueError(f"unknown launcher {launcher!r}; one of {LAUNCHERS}")


def launch(launcher, np, script, *args, timeout=300, check=True, env=None):
    """Run `script` (a path) with `args` under `launcher` with `np` ranks (`env`: extra variables for every rank);
    returns the CompletedProcess. `timeout` only ends a hung job: no test may depend on how fast this machine is."""
    cmd = launch_command(launcher, np, [str(script)] + [str(a) for a in args])
    proc = subprocess.run(cmd, cwd=ROOT, env={**job_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
                    f"\n--- stderr ---\n{proc.stderr[-4000:]}")
    return proc


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


@pytest.fixture
def worker():
    """Path of a worker script in tests/workers."""
    return lambda name: WORKERS / name
