"""Starting Horovod in this process, and the facts about this rank that the rest of the app asks for (Runtime).

Before hvd.init(): how the process was launched, as the launcher's environment says (launch_kind, launcher_rank,
launched_size), and the settings Horovod and glibc read once at start: the fusion threshold and cycle time for the
device and the launch (TUNING_DEFAULTS, measured in bench/NOTES.md), and glibc's malloc keeping freed memory
(keep_freed_memory).

After it: the rank on the GPU of its local rank, or on the CPU with an equal share of the cores the process may
really use (affinity and cgroup quota: usable_cpus), and the ranks of a fixed job agreeing to stop together where
one refused its settings (SettingsRefused).
"""
import ctypes
import math
import os
import pickle
import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

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
    def is_main(self) -> bool:
        return self.rank == 0


def under_elastic_launcher() -> bool:
    """Whether horovodrun started this process in elastic mode (with --host-discovery-script)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def init(cpu: bool = False, fusion_threshold_mb: float = -1.0, cycle_time_ms: float = 0.0,
         gloo_timeout_s: float = 0.0) -> Runtime:
    """start(), then pin_to_local_rank(): Horovod running and this rank on its device, in one call."""
    start(cpu, fusion_threshold_mb, cycle_time_ms, gloo_timeout_s)
    return pin_to_local_rank(cpu)


class SettingsRefused(Exception):
    """Raised by start() on every rank of a job in which a rank refused its settings: `rank` (the lowest that did)
    and its `message`."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank, self.message = rank, message


def start(cpu: bool = False, fusion_threshold_mb: float = -1.0, cycle_time_ms: float = 0.0, gloo_timeout_s: float = 0.0,
          refusal: Optional[str] = None) -> None:
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


def agree_on_settings(refusal: Optional[str]) -> None:
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


def host_name() -> str:
    """This rank's host as the launcher names it (horovodrun sets HOROVOD_HOSTNAME: the name -H used), else the
    machine's own."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def launched_size() -> int:
    """How many ranks the launcher started, as the environment says before hvd.init() (1 when it says nothing)."""
    return _announced(SIZE_VARS, 1)


def _announced(names: tuple[str, ...], default: int) -> int:
    """The first of the launcher's variables `names` that holds a number, else `default`."""
    for var in names:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return default


def pin_to_local_rank(cpu: bool = False) -> Runtime:
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


def gpu_tensors_supported() -> bool:
    """Whether this Horovod build can reduce tensors on a GPU (built with CUDA or ROCm: NCCL, or MPI/Gloo through
    host copies). A CPU-only build aborts the process on the first CUDA tensor it is given."""
    return hvd.cuda_built() or hvd.rocm_built()


def _uses_gpu(cpu: bool) -> bool:
    return torch.cuda.is_available() and not cpu


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> Optional[int]:
    """The CPUs a cgroup quota allows this process (`docker run --cpus 1.5` gives 2), or None without a quota.

    cgroup v2 writes "QUOTA PERIOD" or "max PERIOD" in cpu.max; v1 has cpu.cfs_quota_us (-1: none) and
    cpu.cfs_period_us. The process's own cgroup is the mount's root inside a container, which is where quotas bite.
    """
    def read(name: str) -> Optional[list[str]]:
        try:
            with open(os.path.join(root, name)) as f:
                return f.read().split()
        except (OSError, ValueError):
            return None

    quota: Union[int, list[str]]
    period: Union[int, list[str]]
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


def usable_cpus() -> int:
    """The CPUs this process may really run on: its affinity (taskset, a batch system's binding, `docker run
    --cpuset-cpus`) and its container's CPU quota, not os.cpu_count(), which reports every core of the host."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    return min(cpus, limit) if limit else cpus


def launcher_rank() -> int:
    """This process's rank as the launcher announced it, readable before hvd.init() (0 when run alone).

    Lets a process that fails before Horovod starts (a bad flag, say) leave the error message to rank 0 alone.
    """
    return _announced(RANK_VARS, 0)


def controller() -> str:
    return "MPI" if hvd.mpi_enabled() else "Gloo"


def tensor_ops(device: torch.device) -> str:
    if device.type == "cuda" and hvd.nccl_built():
        return "NCCL"
    return controller()


def run_on_local_root(fn: Callable[[], Any], what: str) -> Any:
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


def _portable(error: Exception) -> Exception:
    """The exception itself where it pickles (to travel to the other ranks), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def shutdown() -> None:
    hvd.shutdown()


def started() -> bool:
    """Whether Horovod is running in this process (hvd.init() done, not shut down)."""
    return hvd.is_initialized()


def world_size() -> int:
    """The number of ranks now (in an elastic run, of the current set of workers)."""
    return hvd.size()


def rank() -> int:
    """This process's rank now (in an elastic run, among the current workers)."""
    return hvd.rank()


# Measured by `make bench` (bench/NOTES.md). Fusion: on CPUs an 8 MB buffer allreduces a ResNet-18's gradients
# faster than Horovod's 128 MB, over MPI and Gloo alike; on GPUs NCCL wants large buffers, so 128 MB stays.
# Cycle: Horovod's background thread wakes every cycle to coordinate, and on a CPU whose cores all train, each
# wake-up preempts a compute thread. Over MPI on CPUs 1 ms still trains fastest (its allreduce waits less); Gloo's
# coordination is a TCP round trip, and 10 ms trained compute-bound steps 12% faster than 1 ms (even on 40 ms steps,
# slower on 16 ms ones: the README says so). A process started alone has nothing to coordinate (the app skips
# Horovod at size 1), so it wakes every 100 ms: a few percent faster steps than at 1 ms. GPUs keep Horovod's 1 ms:
# their host cores are not the bottleneck.
TUNING_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"fusion_threshold_mb": 8.0, "cycle_time_ms": {"mpi": 1.0, "gloo": 10.0, "alone": 100.0}},
    "cuda": {"fusion_threshold_mb": 128.0, "cycle_time_ms": {"mpi": 1.0, "gloo": 1.0, "alone": 100.0}}}
RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
# glibc's malloc settings from the environment: a user who set any of them has chosen, and keep_freed_memory leaves
# malloc alone.
MALLOC_VARS = ("GLIBC_TUNABLES", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
               "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # mallopt() options, from glibc's malloc.h


def launch_kind() -> str:
    """How this process was started, as far as the environment says before hvd.init(): "alone" (no launcher, or
    one that started a single process), "gloo" (horovodrun --gloo sets HOROVOD_CONTROLLER) or "mpi"."""
    sizes = [os.environ[v] for v in SIZE_VARS if os.environ.get(v, "").isdigit()]
    if not any(v in os.environ for v in RANK_VARS) or (sizes and all(n == "1" for n in sizes)):
        return "alone"
    if os.environ.get("HOROVOD_CONTROLLER", "").lower() == "gloo" or not hvd.mpi_built():
        return "gloo"
    return "mpi"


def tuning_env(device_type: str, fusion_threshold_mb: float = -1.0, cycle_time_ms: float = 0.0,
               kind: Optional[str] = None) -> dict[str, float]:
    """Set Horovod's fusion threshold and cycle time for hvd.init() to read: the given values, or the defaults
    for the device and the launch (`kind`, see launch_kind; -1 and 0 mean default); a value the launcher
    (horovodrun --fusion-threshold-mb, --cycle-time-ms) or the user put in the environment wins. Returns what is in
    effect."""
    defaults = TUNING_DEFAULTS[device_type]
    # Horovod's autotuner (horovodrun --autotune, HOROVOD_AUTOTUNE=1) tunes only what the environment leaves
    # open: a value set there is fixed. So under autotune only the values the user gave are set.
    if not autotune_on() or fusion_threshold_mb >= 0:
        fusion = defaults["fusion_threshold_mb"] if fusion_threshold_mb < 0 else fusion_threshold_mb
        os.environ.setdefault("HOROVOD_FUSION_THRESHOLD", str(int(fusion * 1024 * 1024)))
    if not autotune_on() or cycle_time_ms:
        cycle = cycle_time_ms or defaults["cycle_time_ms"][kind or launch_kind()]
        os.environ.setdefault("HOROVOD_CYCLE_TIME", f"{cycle:g}")
    if device_type == "cpu":
        # OpenMPI busy-polls while it waits, taking a core from training when the ranks fill the host; yielding
        # the core instead gave 2 ranks 8% more images/s than torchrun DDP on a ResNet-18 (bench/NOTES.md).
        # Read by MPI_Init inside hvd.init(); harmless under Gloo.
        os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    return tuning_in_effect()


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep large freed blocks for reuse instead of returning them to the kernel, before
    hvd.init() starts Horovod's background thread. Returns whether it did.

    OpenMPI's allreduce mallocs a scratch buffer as large as the message on every call and frees it at the end.
    glibc serves a block that large with a fresh mmap and unmaps it on free, so every allreduce of 64 MB first
    faults in 16,384 new zeroed pages, at about 1.3 GB/s here against 7 GB/s for copying the data
    (bench/NOTES.md). With no mmap (M_MMAP_MAX 0), one arena (M_ARENA_MAX 1: a thread's own arena cannot
    grow past 64 MB and would mmap anyway) and no trimming, the buffer is the same heap memory each time. The
    price: memory freed by this process stays mapped to it (its RSS stays at its peak). Skipped where the user
    set any of glibc's malloc variables, and where the C library is not glibc."""
    if any(var in os.environ for var in MALLOC_VARS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    settings = ((_M_MMAP_MAX, 0), (_M_ARENA_MAX, 1), (_M_TRIM_THRESHOLD, 2**31 - 1))
    return all(mallopt(option, value) == 1 for option, value in settings)


def autotune_on() -> bool:
    """Whether Horovod's autotuner was asked for (horovodrun --autotune sets HOROVOD_AUTOTUNE=1)."""
    return os.environ.get("HOROVOD_AUTOTUNE", "").strip().lower() in ("1", "true", "yes", "on")


def tuning_in_effect() -> dict[str, float]:
    """The fusion threshold (MB) and cycle time (ms) hvd.init() will read: the environment, else Horovod's own."""
    return {"fusion_threshold_mb": int(os.environ.get("HOROVOD_FUSION_THRESHOLD", 128 << 20)) / 2**20,
            "cycle_time_ms": float(os.environ.get("HOROVOD_CYCLE_TIME", 1.0))}
