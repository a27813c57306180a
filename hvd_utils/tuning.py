"""Before hvd.init(): how this process was launched, and the Horovod and malloc settings it starts with (the
fusion threshold and cycle time for the device and the launch, glibc's malloc keeping freed memory)."""
import ctypes
import os

import horovod.torch as hvd

# Measured by `make bench` (bench/NOTES.md). Fusion: on CPUs an 8 MB buffer allreduces a ResNet-18's gradients
# faster than Horovod's 128 MB, over MPI and Gloo alike; on GPUs NCCL wants large buffers, so 128 MB stays.
# Cycle: Horovod's background thread wakes every cycle to coordinate, and on a CPU whose cores all train, each
# wake-up preempts a compute thread. Over MPI on CPUs 1 ms still trains fastest (its allreduce waits less); Gloo's
# coordination is a TCP round trip, and 10 ms trained compute-bound steps 12% faster than 1 ms (even on 40 ms steps,
# slower on 16 ms ones: the README says so). A process started alone has nothing to coordinate (the app skips
# Horovod at size 1), so it wakes every 100 ms: a few percent faster steps than at 1 ms. GPUs keep Horovod's 1 ms:
# their host cores are not the bottleneck.
TUNING_DEFAULTS = {"cpu": {"fusion_threshold_mb": 8.0, "cycle_time_ms": {"mpi": 1.0, "gloo": 10.0, "alone": 100.0}},
                   "cuda": {"fusion_threshold_mb": 128.0, "cycle_time_ms": {"mpi": 1.0, "gloo": 1.0, "alone": 100.0}}}
RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
# glibc's malloc settings from the environment: a user who set any of them has chosen, and keep_freed_memory leaves
# malloc alone.
MALLOC_VARS = ("GLIBC_TUNABLES", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
               "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # mallopt() options, from glibc's malloc.h


def launch_kind():
    """How this process was started, as far as the environment says before hvd.init(): "alone" (no launcher, or
    one that started a single process), "gloo" (horovodrun --gloo sets HOROVOD_CONTROLLER) or "mpi"."""
    sizes = [os.environ[v] for v in SIZE_VARS if os.environ.get(v, "").isdigit()]
    if not any(v in os.environ for v in RANK_VARS) or (sizes and all(n == "1" for n in sizes)):
        return "alone"
    if os.environ.get("HOROVOD_CONTROLLER", "").lower() == "gloo" or not hvd.mpi_built():
        return "gloo"
    return "mpi"


def tuning_env(device_type, fusion_threshold_mb=-1.0, cycle_time_ms=0.0, kind=None):
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


def keep_freed_memory():
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


def autotune_on():
    """Whether Horovod's autotuner was asked for (horovodrun --autotune sets HOROVOD_AUTOTUNE=1)."""
    return os.environ.get("HOROVOD_AUTOTUNE", "").strip().lower() in ("1", "true", "yes", "on")


def tuning_in_effect():
    """The fusion threshold (MB) and cycle time (ms) hvd.init() will read: the environment, else Horovod's own."""
    return {"fusion_threshold_mb": int(os.environ.get("HOROVOD_FUSION_THRESHOLD", 128 << 20)) / 2**20,
            "cycle_time_ms": float(os.environ.get("HOROVOD_CYCLE_TIME", 1.0))}
