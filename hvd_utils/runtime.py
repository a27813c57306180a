"""Horovod start-up: init, device pinning, CPU threads, and the rank facts the rest of the app asks for."""
import math
import os
import pickle
import socket
import sys
from dataclasses import dataclass

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

from hvd_utils.elastic import under_elastic_launcher
from hvd_utils.tuning import (RANK_VARS, SIZE_VARS, autotune_on, keep_freed_memory, launch_kind, tuning_env,
                              tuning_in_effect)

# Raised inside a collective on the surviving ranks when another rank has failed and Horovod has shut down.
PeerFailure = HorovodInternalError


@dataclass(frozen=True)
class Runtime:
    rank: int          # global rank of this process
    size: int          # number of processes in the job
    local_rank: int    # rank among the processes on this host
    local_size: int    # processes on this host
    device: torch.device
    threads: int       # intra-op CPU threads of this process
    controller: str    # "MPI" or "Gloo": which one Horovod coordinates with
    tensor_ops: str    # what performs the collectives: "NCCL", "MPI", "Gloo"
    fusion_threshold_mb: float  # Horovod's tensor fusion buffer in effect (under autotune: where it starts)
    cycle_time_ms: float        # Horovod's cycle time in effect (under autotune: where it starts)
    autotune: bool = False      # Horovod's autotuner adjusts both while training (horovodrun --autotune)

    @property
    def is_main(self):
        return self.rank == 0


def init(cpu=False, fusion_threshold_mb=-1.0, cycle_time_ms=0.0, gloo_timeout_s=0.0):
    """start(), then pin_to_local_rank(): Horovod running and this rank on its device, in one call."""
    start(cpu, fusion_threshold_mb, cycle_time_ms, gloo_timeout_s)
    return pin_to_local_rank(cpu)


class SettingsRefused(Exception):
    """Raised by start() on every rank of a job in which a rank refused its settings: `rank` (the lowest that did)
    and its `message`."""

    def __init__(self, rank, message):
        super().__init__(message)
        self.rank, self.message = rank, message


def start(cpu=False, fusion_threshold_mb=-1.0, cycle_time_ms=0.0, gloo_timeout_s=0.0, refusal=None):
    """Horovod: hvd.init(), with its tuning set first (it reads the environment once, here).

    fusion_threshold_mb and cycle_time_ms tune Horovod (see tuning_env); elastic runs too, since hvd-train's
    Horovod build no longer crashes when an elastic reset re-initialises with both set
    (scripts/horovod/patches/0007-elastic-reset-fixed-parameter.patch).
    gloo_timeout_s > 0 sets how long a Gloo collective waits for a peer (Horovod's default: 30 s), unless
    HOROVOD_GLOO_TIMEOUT_SECONDS is set. cpu: the ranks train on CPUs even where GPUs are visible.

    refusal: why this rank refused its settings (None where it did not); see agree_on_settings."""
    use_gpu = _uses_gpu(cpu)
    kind = launch_kind()
    cycle_chosen = bool(cycle_time_ms) or "HOROVOD_CYCLE_TIME" in os.environ
    tuning = tuning_env("cuda" if use_gpu else "cpu", fusion_threshold_mb, cycle_time_ms, kind)
    if not use_gpu and kind == "mpi":
        keep_freed_memory()
    if gloo_timeout_s > 0:
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(math.ceil(gloo_timeout_s)))
    hvd.init()  # Horovod: start the controller (MPI under mpirun or horovodrun --mpi, Gloo under --gloo).
    if kind == "alone" and not cycle_chosen and hvd.size() > 1 and hvd.rank() == 0:
        # A launcher this module does not know: the alone-cycle would slow every allreduce.
        print(f"hvd-train: warning: started by an unrecognised launcher ({hvd.size()} ranks, none of "
              f"{', '.join(RANK_VARS)} set), so Horovod's cycle time is {tuning['cycle_time_ms']:g} ms; pass "
              "--horovod.cycle_time_ms 1", file=sys.stderr)
    agree_on_settings(refusal)


def agree_on_settings(refusal):
    """Right after hvd.init(), every rank of a fixed job says whether it refused its settings, and where one did
    every rank raises SettingsRefused naming it: the job stops at once with one message (rank 0's), whether every
    rank refused the same command line or one rank alone could not read a recipe on its host. (Without it a
    refusing rank either spoke with the others or left rank 0 waiting for it.) An elastic worker runs no collective
    outside Horovod's loop, so there each rank answers for itself."""
    said = [refusal] if hvd.size() == 1 or under_elastic_launcher() else \
        hvd.allgather_object(refusal, name="settings_refused")
    for rank, message in enumerate(said):
        if message:
            raise SettingsRefused(hvd.rank() if len(said) == 1 else rank, message)


def host_name():
    """This rank's host as the launcher names it (horovodrun sets HOROVOD_HOSTNAME: the name -H used), else the
    machine's own."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def launched_size():
    """How many ranks the launcher started, as the environment says before hvd.init() (1 when it says nothing)."""
    return _announced(SIZE_VARS, 1)


def _announced(names, default):
    """The first of the launcher's variables `names` that holds a number, else `default`."""
    for var in names:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return default


def pin_to_local_rank(cpu=False):
    """Horovod: this rank on the GPU of its local rank (one GPU per process); without GPUs (or with cpu), on the
    CPU with an equal share of the host's cores. Returns the rank's facts (Runtime). After start()."""
    if _uses_gpu(cpu):
        torch.cuda.set_device(hvd.local_rank())  # Horovod: one GPU per process, chosen by the rank on this host.
        device, threads = torch.device("cuda", hvd.local_rank()), torch.get_num_threads()
    else:
        device = torch.device("cpu")
        # Every rank on a host would otherwise start one thread per core: N ranks on N cores run N*N threads.
        # An explicit OMP_NUM_THREADS wins (torch reads it itself).
        threads = max(1, usable_cpus() // hvd.local_size())
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            threads = torch.get_num_threads()
        torch.set_num_threads(threads)
    tuning = tuning_in_effect()
    return Runtime(
        rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), local_size=hvd.local_size(),
        device=device, threads=threads, controller=controller(), tensor_ops=tensor_ops(device),
        fusion_threshold_mb=tuning["fusion_threshold_mb"], cycle_time_ms=tuning["cycle_time_ms"],
        autotune=autotune_on() and hvd.size() > 1)


def gpu_tensors_supported():
    """Whether this Horovod build can reduce tensors on a GPU (built with CUDA or ROCm: NCCL, or MPI/Gloo through
    host copies). A CPU-only build aborts the process on the first CUDA tensor it is given."""
    return hvd.cuda_built() or hvd.rocm_built()


def _uses_gpu(cpu):
    return torch.cuda.is_available() and not cpu


def cgroup_cpu_limit(root="/sys/fs/cgroup"):
    """The CPUs a cgroup quota allows this process (`docker run --cpus 1.5` gives 2), or None without a quota.

    cgroup v2 writes "QUOTA PERIOD" or "max PERIOD" in cpu.max; v1 has cpu.cfs_quota_us (-1: none) and
    cpu.cfs_period_us. The process's own cgroup is the mount's root inside a container, which is where quotas bite.
    """
    def read(name):
        try:
            with open(os.path.join(root, name)) as f:
                return f.read().split()
        except (OSError, ValueError):
            return None

    v2 = read("cpu.max")
    if v2 and len(v2) == 2 and v2[0] != "max":
        quota, period = int(v2[0]), int(v2[1])
    else:
        quota, period = (read("cpu/cpu.cfs_quota_us") or read("cpu.cfs_quota_us") or ["-1"]), \
            (read("cpu/cpu.cfs_period_us") or read("cpu.cfs_period_us") or ["0"])
        quota, period = int(quota[0]), int(period[0])
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def usable_cpus():
    """The CPUs this process may really run on: its affinity (taskset, a batch system's binding, `docker run
    --cpuset-cpus`) and its container's CPU quota, not os.cpu_count(), which reports every core of the host."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    return min(cpus, limit) if limit else cpus


def launcher_rank():
    """This process's rank as the launcher announced it, readable before hvd.init() (0 when run alone).

    Lets a process that fails before Horovod starts (a bad flag, say) leave the error message to rank 0 alone.
    """
    return _announced(RANK_VARS, 0)


def controller():
    return "MPI" if hvd.mpi_enabled() else "Gloo"


def tensor_ops(device):
    if device.type == "cuda" and hvd.nccl_built():
        return "NCCL"
    return controller()


def run_on_local_root(fn, what):
    """Run fn() on local rank 0 of each host while the other ranks wait (downloads into a shared directory).

    Every rank then raises the first failing host's error, so none waits forever for a download that has died, and
    the job's one report (rank 0's, for the app's errors) names the real cause wherever it happened.
    """
    if hvd.size() == 1:
        return fn()
    error = None
    if hvd.local_rank() == 0:
        try:
            fn()
        except Exception as e:  # re-raised below on every rank, after all have heard of it
            error = _portable(e)
    errors = [e for e in hvd.allgather_object(error, name=f"local_root:{what}") if e is not None]
    if errors:
        raise errors[0]


def _portable(error):
    """The exception itself where it pickles (to travel to the other ranks), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def shutdown():
    hvd.shutdown()


def started():
    """Whether Horovod is running in this process (hvd.init() done, not shut down)."""
    return hvd.is_initialized()


def world_size():
    """The number of ranks now (in an elastic run, of the current set of workers)."""
    return hvd.size()


def rank():
    """This process's rank now (in an elastic run, among the current workers)."""
    return hvd.rank()
