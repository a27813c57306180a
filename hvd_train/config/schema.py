"""The configuration of a run: one typed section per concern, the checks across them, and every field with its
flags (what --help, docs/settings.md and the messages are made from).

Every setting is opt(default, help, flags, choices): its help (meaning, unit) is its --help text and its line in
docs/settings.md, its flags the short spellings beside its --section.field (ALIASES), its choices the values it takes
(CHOICES). Each section checks its own values in __post_init__ (first of all, _Section: every float is finite), and
Config checks the combinations across sections, so a bad value stops the run before any rank starts training.

The sections of what is learned and how: data, model, optim (optimizer and schedule), aug (augmentation and
regularisation). The sections of how the job runs: horovod, checkpoint, logging (and trackers), run, benchmark,
profile. The bounds here (MAX_WORKERS, MAX_IMAGE_SIDE, MAX_SAMPLE_VALUES and MAX_BATCH_VALUES, POLICY_BOUNDS for
--aa, RECIPE_MAX_BYTES) keep a recipe, which is data, from asking a node for more than it has. Reading the command
line, recipes and a run's recorded settings is hvd_train/config/loading.py's.
"""
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union, cast

from hvd_train.errors import ConfigError, redact_values

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

LR_SCHEDULES = ("constant", "cosine", "step", "multistep", "exponential")  # multistep: timm's name for step
OPTIMIZERS = ("sgd", "adam", "adamw")  # torch's own; any other name is one of timm's (hvd_train/training.py checks it)
# --shard-optimizer steps a flat slice of the weights: optimizers whose update is element-wise (torch's and timm's
# names). LAMB, LARS and Adafactor look at whole tensors (trust ratios, factored moments).
SHARDABLE = ("sgd", "momentum", "nesterov", "adam", "adamw", "nadam", "nadamw", "radam", "adamax", "lion",
             "rmsprop", "rmsproptf", "adagrad")
ERASE_MODES = ("const", "rand", "pixel")
AMP_MODES = ("off", "bf16", "fp16")
DECODES = ("auto", "cpu", "gpu")  # where photos are decoded (data/images.py)
DEVICES = ("auto", "cuda", "cpu")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
PROFILE_RANKS = ("0", "all")
MAX_WORKERS = 64  # DataLoader processes per rank
MAX_IMAGE_SIDE = 8192  # pixels; a side of 8192 is already 200 MB per float image
MAX_SAMPLE_VALUES = 2**28  # channels x side x side of one sample: 3 x 8192 x 8192 fits, 64 x 8192 x 8192 does not
MAX_BATCH_VALUES = 2**32  # a rank's batch of samples: 16 GiB of float32
RECIPE_MAX_BYTES = 2**20  # a recipe is a page of settings; a larger file is not one


# What an --aa policy's figures may be (timm's own policies use n 2-4, width 3-4, depth up to 3, magnitudes up to
# 10-30): a recipe is data, and `rand-m9-n400000000` would have timm draw 400 million ops for every image.
POLICY_BOUNDS = {"n": 16, "w": 16, "d": 16, "m": 100, "mstd": 100, "mmax": 100, "a": 100, "p": 1}
POLICY_MAX_CHARS = 200


def check_policy_figures(spec: str) -> None:
    """Refuse an --aa policy whose figures pass POLICY_BOUNDS (ConfigError); what timm cannot build is refused when
    the policy is built (data/augment.py check_policy)."""
    if len(spec) > POLICY_MAX_CHARS:
        raise ConfigError(f"aug.aa (--aa)={spec[:60]!r}...: {len(spec)} characters; a policy such as "
                          f"rand-m9-mstd0.5-inc1 takes a few")
    for part in spec.split("-")[1:]:
        key, figure = cast("re.Match[str]", re.match(r"([a-z]*)(.*)", part)).groups()
        try:
            value = float(figure) if figure else None
        except ValueError:
            continue  # timm's own parser judges what is not a figure
        if key in POLICY_BOUNDS and value is not None and not abs(value) <= POLICY_BOUNDS[key]:
            raise ConfigError(f"aug.aa (--aa)={spec!r}: {key}{figure} is past {POLICY_BOUNDS[key]}, the most this "
                              f"policy's {key} may be (timm's own policies: rand-m9-n2-mstd0.5, augmix-m5-w3)")


def _require(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r}: {why}")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, name, value, f"must be one of: {', '.join(choices)}")


def opt(default: Any, help: str, flags: tuple[str, ...] = (), choices: Optional[tuple[str, ...]] = None) -> Any:
    """A field with its default and its meaning (the --help text and the documentation of the field); flags: its
    short command-line spellings (`lr` for --lr; every field also has --section.field); choices: the values it takes.
    """
    metadata = {"help": help, "flags": tuple(flags), "choices": choices}
    if isinstance(default, dict):  # keyword arguments for a plug-in: a fresh (empty) mapping per config
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


def _label(section: str, name: str) -> str:
    """How messages name a field: `optim.lr (--lr)`, with the short flag where there is one."""

    alias = next((flag for flag, dest in ALIASES.items() if dest == f"{section}.{name}"), None)
    return f"{section}.{name}" + (f" (--{alias})" if alias else "")


class _Section:
    """The check every section runs first: each float setting is a finite number.

    No setting uses inf for "unlimited" (those that can be switched off say so with 0 or -1), and nan passes no range
    check while inf passes many (lr > 0, clip_grad >= 0, ...). Checked here, for every float field at once, both get
    one message, whatever field they are given to and whether they come from the command line or a recipe.
    """

    def __post_init__(self) -> None:
        section = next(s.name for s in dataclasses.fields(Config) if s.type is type(self))
        for f in (f for f in dataclasses.fields(cast("DataclassInstance", self)) if f.type is float):
            value = getattr(self, f.name)
            _require(math.isfinite(value), _label(section, f.name), value,
                     f"must be a finite number, e.g. the default {f.default!r} ({f.metadata['help']})")


@dataclass
class HorovodConfig(_Section):
    batches_per_allreduce: int = opt(1, "backward passes summed locally before one allreduce (gradient accumulation)",
                                     flags=("batches-per-allreduce",))
    fp16_allreduce: bool = opt(False, "compress gradients to fp16 for the allreduce (half the bytes on the wire)",
                               flags=("fp16-allreduce",))
    bf16_allreduce: bool = opt(False, "send gradients as bfloat16 (half the bytes, float32's range: no overflow "
                               "where fp16's 65504 ends); summed in float32 and rounded once",
                               flags=("bf16-allreduce",))
    use_adasum: bool = opt(False, "combine gradients with Adasum instead of averaging them", flags=("use-adasum",))
    shard_optimizer: bool = opt(False, "ZeRO-1: each rank keeps the optimizer state of 1/N of the weights "
                                "(reducescatter, step a slice, allgather); element-wise optimizers",
                                flags=("shard-optimizer",))
    powersgd_rank: int = opt(0, "average the gradients as PowerSGD low-rank factors of this rank, with error "
                             "feedback (1-4; far fewer bytes on slow links, docs/speed.md); 0: off",
                             flags=("powersgd-rank",))
    powersgd_start_step: int = opt(-1, "PowerSGD: optimizer steps of plain averaging before the compression starts "
                                   "(-1: 10% of the run's steps)", flags=("powersgd-start-step",))
    powersgd_min_compression: float = opt(2.0, "PowerSGD: a tensor whose factors would not be this many times "
                                          "smaller goes through the plain average (1-d tensors always do)",
                                          flags=("powersgd-min-compression",))
    gradient_predivide_factor: float = opt(1.0, "divide gradients by this before the allreduce, the rest after")
    sync_bn: bool = opt(False, "batch-norm statistics computed over all ranks (hvd.SyncBatchNorm)", flags=("sync-bn",))
    elastic: bool = opt(False, "elastic training under horovodrun --min-np/--max-np --host-discovery-script",
                        flags=("elastic",))
    commit_every: int = opt(20, "elastic: steps between state commits (at most this many are redone on a reset)")
    fusion_threshold_mb: float = opt(-1.0, "tensor fusion buffer, MB (0: none; -1: 8 on CPUs, 128 on GPUs); "
                                     "docs/speed.md")
    cycle_time_ms: float = opt(0.0, "Horovod's cycle, ms (0: by launch, docs/speed.md); launcher flags win")

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.batches_per_allreduce >= 1, "horovod.batches_per_allreduce (--batches-per-allreduce)",
                 self.batches_per_allreduce, "must be 1 or more")
        _require(self.gradient_predivide_factor > 0, "horovod.gradient_predivide_factor",
                 self.gradient_predivide_factor, "must be positive")
        _require(self.commit_every >= 1, "horovod.commit_every", self.commit_every, "must be 1 or more steps")
        _require(self.fusion_threshold_mb >= 0 or self.fusion_threshold_mb == -1, "horovod.fusion_threshold_mb",
                 self.fusion_threshold_mb, "must be a buffer size in MB, 0 for no fusion, or -1 for the default")
        _require(self.cycle_time_ms >= 0, "horovod.cycle_time_ms", self.cycle_time_ms,
                 "must be a time in milliseconds, e.g. 10, or 0 for the default")
        _require(not (self.use_adasum and self.gradient_predivide_factor != 1.0), "horovod.use_adasum",
                 self.use_adasum, "cannot be combined with gradient_predivide_factor != 1")
        _require(not (self.fp16_allreduce and self.bf16_allreduce), "horovod.bf16_allreduce (--bf16-allreduce)",
                 True, "cannot be combined with --fp16-allreduce: gradients travel in one format; choose one")
        _require(not (self.use_adasum and self.bf16_allreduce), "horovod.bf16_allreduce (--bf16-allreduce)", True,
                 "cannot be combined with --use-adasum: Horovod's Adasum reduces float16, float32 and float64 only; "
                 "leave out one of them")
        _require(self.powersgd_rank >= 0, "horovod.powersgd_rank (--powersgd-rank)", self.powersgd_rank,
                 "must be a rank of 1 or more (1-4 is usual), or 0 for no PowerSGD")
        _require(self.powersgd_start_step >= -1, "horovod.powersgd_start_step (--powersgd-start-step)",
                 self.powersgd_start_step, "must be a number of optimizer steps, or -1 for 10% of the run's steps")
        _require(self.powersgd_min_compression >= 1, "horovod.powersgd_min_compression (--powersgd-min-compression)",
                 self.powersgd_min_compression, "must be a factor of 1 or more, e.g. 2 (DDP's default)")
        if self.powersgd_rank:
            for on, flag, why in ((self.use_adasum, "--use-adasum", "Adasum combines whole updates, not averages"),
                                  (self.shard_optimizer, "--shard-optimizer", "a sharded optimizer reduce-scatters "
                                   "whole gradients"),
                                  (self.elastic, "--elastic", "the residuals are each rank's own and would be lost "
                                   "at a reset"),
                                  (self.gradient_predivide_factor != 1.0, "--horovod.gradient_predivide_factor",
                                   "PowerSGD averages its factors as they are")):
                _require(not on, "horovod.powersgd_rank (--powersgd-rank)", self.powersgd_rank,
                         f"cannot be combined with {flag}: {why}; leave out one of them")
        _require(not (self.use_adasum and self.shard_optimizer), "horovod.shard_optimizer (--shard-optimizer)", True,
                 "cannot be combined with --use-adasum: Adasum combines whole updates, a sharded optimizer steps "
                 "slices of averaged gradients; leave out one of them")


@dataclass
class CheckpointConfig(_Section):
    resume: str = opt("", "checkpoint to resume from: a path, or auto for the newest in <output dir>/checkpoints",
                      flags=("resume",))
    keep_last: int = opt(3, "how many of the newest per-epoch checkpoints to keep (last.pt and best.pt are extra)")
    every_epochs: int = opt(1, "write a checkpoint every this many epochs (and after the last)")
    hist: int = opt(1, "how many of the best checkpoints to keep: best.pt and, from 2, best_epoch_NNNN.pt for each "
                    "of the N best epochs by the task's best metric", flags=("checkpoint-hist",))
    every_steps: int = opt(0, "also write a checkpoint within epochs every this many optimizer steps of the run "
                           "(step_NNNNNNNN.pt, the newest kept; --resume auto continues at the next step); 0: off")
    every_minutes: float = opt(0.0, "also write a checkpoint within epochs at the first step this many minutes after "
                               "the last one (rank 0's clock); 0: off")
    background: bool = opt(True, "write checkpoints from a copy in host memory on a thread of their own while "
                           "training goes on (the step waits only for the copy); false: write them in the step")
    before_time_limit_s: float = opt(300.0, "under SLURM: save and stop (exit 75, which slurm_train.sbatch "
                                     "requeues) this many seconds before the job's time limit; 0: off")

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.keep_last >= 0, "checkpoint.keep_last", self.keep_last, "must be 0 or more")
        _require(self.every_epochs >= 1, "checkpoint.every_epochs", self.every_epochs, "must be 1 or more")
        _require(self.hist >= 1, "checkpoint.hist (--checkpoint-hist)", self.hist, "must be 1 or more")
        _require(self.every_steps >= 0, "checkpoint.every_steps", self.every_steps,
                 "must be a number of optimizer steps, or 0 for no checkpoints within epochs")
        _require(self.every_minutes >= 0, "checkpoint.every_minutes", self.every_minutes,
                 "must be a number of minutes, or 0 for none")
        _require(self.before_time_limit_s >= 0, "checkpoint.before_time_limit_s", self.before_time_limit_s,
                 "must be a number of seconds, or 0 to ignore the job's time limit")


@dataclass
class LoggingConfig(_Section):
    progress: bool = opt(True, "rank 0 shows its progress through each epoch: a bar (tqdm) on a terminal, under "
                         "any launcher; a whole line every progress_every seconds in a log")
    progress_every: float = opt(60.0, "seconds between progress lines where the output is not a terminal (a log "
                                "file, a pipe); 0: none")
    log_every: int = opt(20, "steps between progress updates and the all-rank non-finite loss check")
    tensorboard: bool = opt(True, "write TensorBoard events to <output dir>/tensorboard")
    plot: bool = opt(True, "draw the loss and accuracy curves to <output dir>/curves.png at the end")
    mlflow: bool = opt(False, "log the run to MLflow from rank 0: a SQLite store in the output directory "
                       "(<output dir>/mlflow.db) unless --mlflow-uri names a tracking server", flags=("mlflow",))
    mlflow_uri: str = opt("", "MLflow tracking URI (http://host:5000, sqlite:///path.db, databricks); implies --mlflow",
                          flags=("mlflow-uri",))
    mlflow_experiment: str = opt("hvd-train", "MLflow experiment the run is logged in (created if missing)")
    wandb: bool = opt(False, "log the run to Weights & Biases offline from rank 0: <output dir>/wandb/offline-run-*, "
                      "uploaded later with `wandb sync` (no network while training)", flags=("wandb",))
    wandb_project: str = opt("hvd-train", "W&B project of the run")
    straggler_pct: float = opt(20.0, "name a rank whose step time without its allreduce wait is more than this many "
                               "percent above the median rank's, with the phase that makes it slow "
                               "(docs/monitoring.md)")
    step_timing: bool = opt(True, "split every step's time into data, compute, allreduce wait, optimizer and other "
                            "on every rank; off only to measure what that costs (make bench)")

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.log_every >= 1, "logging.log_every", self.log_every, "must be 1 or more steps")
        _require(0 < self.straggler_pct <= 1000, "logging.straggler_pct", self.straggler_pct,
                 "must be a percentage above 0 and at most 1000, e.g. 20 (a rank 20% slower than the median)")
        _require(self.progress_every >= 0, "logging.progress_every", self.progress_every, "must be 0 or more seconds")


@dataclass
class RunConfig(_Section):
    output_dir: str = opt("runs/latest", "where rank 0 writes summary, metrics, checkpoints and the resolved config "
                          "(the command line only: a recipe does not choose it)", flags=("output-dir",))
    seed: int = opt(42, "base random seed: rank r seeds Python's random, NumPy's global generator and torch's (and "
                    "CUDA's) with seed + r in its training process (checkpoints save their states, a resume puts "
                    "them back), and its loader workers' from a base that torch draws from seed + r, plus each "
                    "worker's id (each training sample is drawn seeded by seed, epoch and index); the shuffle and a "
                    "data set factory's draws use the seed itself, shared by the ranks (every rank makes the same "
                    "data); the weights come from rank 0", flags=("seed",))
    evaluate: bool = opt(False, "only evaluate the checkpoint given by --resume, then stop", flags=("evaluate",))
    overwrite: bool = opt(False, "start afresh in an output directory that holds a run, replacing its files (the "
                          "command line only)", flags=("overwrite",))
    device: str = opt("auto", "auto (the GPU local_rank when CUDA sees one, else the CPU), cuda or cpu",
                      flags=("device",), choices=DEVICES)
    name: str = opt("", "name of this configuration in the summary (default: the recipe's file name)")
    stop_at: float = opt(0.0, "stop once an epoch reaches this (98: val top-1 98%; VAE: val loss <= it); 0: off",
                         flags=("stop-at",))
    freeze_timeout_s: float = opt(300.0, "end the job, naming the rank that holds it up, when this rank has waited "
                                  "this many seconds without progress (0: never; fixed-size jobs)",
                                  flags=("freeze-timeout",))
    patience: int = opt(0, "early stopping: end training when the best metric has not improved for this many "
                        "epochs (decided on the global metric, every rank together); 0: off", flags=("patience",))
    divergence_factor: float = opt(100.0, "stop every rank (exit 3) when an epoch's training loss exceeds this many "
                                   "times the run's first-step loss: training that diverged but stayed finite; 0: off")

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(bool(self.output_dir), "run.output_dir (--output-dir)", self.output_dir, "must name a directory")
        _require(self.stop_at >= 0, "run.stop_at (--stop-at)", self.stop_at,
                 "must be a target value of the best metric (e.g. 98 for 98% val top-1), or 0 for none")
        _choice("run.device (--device)", self.device, DEVICES)
        _require(self.patience >= 0, "run.patience (--patience)", self.patience, "must be 0 (off) or more epochs")
        _require(self.freeze_timeout_s == 0 or self.freeze_timeout_s >= 10,
                 "run.freeze_timeout_s (--freeze-timeout)", self.freeze_timeout_s,
                 "must be a number of seconds of at least 10 (a step may take seconds), or 0 to never end a job")
        _require(self.divergence_factor == 0 or self.divergence_factor > 1, "run.divergence_factor",
                 self.divergence_factor, "must be above 1 (how many times the first loss means diverged), or 0 for off")


@dataclass
class BenchmarkConfig(_Section):
    enabled: bool = opt(False, "time training steps on one synthetic in-memory batch instead of training",
                        flags=("benchmark",))
    num_warmup_batches: int = opt(10, "untimed steps first: allocator, caches and Horovod's first negotiation settle",
                                  flags=("num-warmup-batches",))
    num_iters: int = opt(10, "timed iterations; images/s is reported as mean +- 1.96 std over them",
                         flags=("num-iters",))
    num_batches_per_iter: int = opt(10, "training steps per timed iteration", flags=("num-batches-per-iter",))

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.num_warmup_batches >= 0, "benchmark.num_warmup_batches (--num-warmup-batches)",
                 self.num_warmup_batches, "must be 0 or more steps")
        _require(self.num_iters >= 1, "benchmark.num_iters (--num-iters)", self.num_iters,
                 "must be 1 or more timed iterations")
        _require(self.num_batches_per_iter >= 1, "benchmark.num_batches_per_iter (--num-batches-per-iter)",
                 self.num_batches_per_iter, "must be 1 or more steps")


@dataclass
class ProfileConfig(_Section):
    enabled: bool = opt(False, "record a torch.profiler trace and Horovod's timeline of a few training steps into "
                        "<output dir>/profile", flags=("profile",))
    start: int = opt(5, "training steps left out before the profiled ones (warm-up, Horovod's first negotiation, "
                     "torch.compile)", flags=("profile-start",))
    steps: int = opt(3, "training steps profiled", flags=("profile-steps",))
    ranks: str = opt("0", "whose steps torch.profiler records: 0 (rank 0) or all (a trace per rank); Horovod's "
                     "timeline is rank 0's view of every rank", flags=("profile-ranks",), choices=PROFILE_RANKS)

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.start >= 0, "profile.start (--profile-start)", self.start, "must be 0 or more steps")
        _require(1 <= self.steps <= 1000, "profile.steps (--profile-steps)", self.steps,
                 "must be 1 to 1000 steps (a trace of more is too large to open)")
        _choice("profile.ranks (--profile-ranks)", self.ranks, PROFILE_RANKS)


@dataclass
class DataConfig(_Section):
    dataset: str = opt("digits", "digits, synthetic, mnist, fashion_mnist, cifar10, cifar100, stl10, imagefolder, "
                       "shards (WebDataset tars: --data.train_shards/val_shards), or your own factory as "
                       "package.module:name (docs/your-own-model.md)", flags=("dataset",))
    args: dict = opt({}, "keyword arguments for your own data set factory: key=value,... (a mapping in a recipe)",
                     flags=("data-args",))
    data_dir: str = opt("datasets", "where data sets are read from (and downloaded to with --download)",
                        flags=("data-dir",))
    download: bool = opt(False, "fetch a missing data set (local rank 0 of each host; the others wait)",
                         flags=("download",))
    image_size: int = opt(0, "side of the square images fed to the model, in pixels; 0: the data set's own",
                          flags=("image-size",))
    val_fraction: float = opt(0.2, "share held out for validation where the data set has no split, 0 < x < 1")
    split_seed: int = opt(0, "seed of that split; fixed so every rank and every run agree")
    workers: int = opt(0, "DataLoader worker processes per rank (0: load in the training process)", flags=("workers",))
    drop_last: bool = opt(True, "drop each rank's last incomplete training batch, as timm's loader does (a full-rate "
                          "step on a handful of samples jolts the weights; the shuffle drops others each epoch); "
                          "false: every sample every epoch. Tar shards always train on full batches")
    decode: str = opt("auto", "photos (image folders, their tar shards): where JPEGs are decoded, cropped and "
                      "flipped: cpu (in the loader workers), gpu (in the training process, with nvjpeg, a batch at a "
                      "time), auto (gpu when training on a GPU with fewer than 4 --workers, which cannot keep up; "
                      "never where --aa or --color-jitter need the CPU's PIL images)", choices=DECODES)
    skip_bad_files: bool = opt(False, "imagefolder: decode every image once at start and leave out those that fail")
    train_shards: str = opt("", "shards: the training shards, a path, http(s):// URL or pipe: command with braces "
                            "for a range, e.g. 'shards/train-{000000..000099}.tar'")
    val_shards: str = opt("", "shards: the validation shards, as --data.train_shards")
    shard_index: str = opt("", "shards: the index hvd-train shard wrote (default: index.json beside the training "
                           "shards; needed for pipe: commands)")
    shuffle_buffer: int = opt(1000, "shards: samples each loader holds to shuffle the stream (per rank and worker)")
    synthetic_samples: int = opt(1024, "synthetic: number of training samples (validation gets a quarter as many)")
    synthetic_channels: int = opt(3, "synthetic: image channels")
    synthetic_classes: int = opt(10, "synthetic: number of classes")

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(bool(self.data_dir), "data.data_dir (--data-dir)", self.data_dir, "must name a directory")
        _require(self.image_size >= 0, "data.image_size (--image-size)", self.image_size,
                 "must be a size in pixels, or 0 for the data set's own")
        _require(0.0 < self.val_fraction < 1.0, "data.val_fraction", self.val_fraction,
                 "must be between 0 and 1 (exclusive), e.g. 0.2 for a 20% validation split")
        _choice("data.decode", self.decode, DECODES)
        _require(0 <= self.workers <= MAX_WORKERS, "data.workers (--workers)", self.workers,
                 f"must be 0 to {MAX_WORKERS} loader processes per rank (2 to 8 keep a GPU fed)")
        _require(self.image_size <= MAX_IMAGE_SIDE, "data.image_size (--image-size)", self.image_size,
                 f"must be at most {MAX_IMAGE_SIDE} pixels")
        # Each of these allocates in every rank's loader workers (or its memory): bounded so that a typo or a recipe
        # from elsewhere cannot ask a node for more than it has.
        for name, most in (("synthetic_samples", 10**7), ("synthetic_channels", 64), ("synthetic_classes", 10**6),
                           ("shuffle_buffer", 10**6)):
            _require(0 < getattr(self, name) <= most, f"data.{name}", getattr(self, name),
                     f"must be positive and at most {most}")


@dataclass
class ModelConfig(_Section):
    name: str = opt("small_cnn", "small_cnn, vae, a torchvision classification model (resnet18, ...), timm/NAME "
                    "(any timm model), or your own factory as package.module:name, called with the data set's "
                    "facts it names (num_classes, in_channels, image_size, ...) and --model-args", flags=("model",))
    args: dict = opt({}, "keyword arguments for the model factory: key=value,... (values read as YAML: 4, 0.1, true, "
                     "text; a mapping in a recipe)", flags=("model-args",))
    task: str = opt("", "what the model is trained to do: classification, vae, or your own task class as "
                    "package.module:Name; empty: the model's own (vae for vae, else classification)", flags=("task",))
    task_args: dict = opt({}, "keyword arguments for the task class: key=value,...", flags=("task-args",))
    init_from: str = opt("", "start from the weights in this local file (.pt/.pth state dict, .safetensors, or an "
                         "hvd-train checkpoint): tensors whose name and shape match are loaded, the rest (a head for "
                         "another number of classes) stay freshly initialised; rank 0 reads, the others receive",
                         flags=("init-from",))
    init_partial: bool = opt(False, "--init-from: load the matching tensors even when fewer than half of the "
                             "model's do (by default such a file is refused as another network's weights)")
    freeze: str = opt("", "parameters to keep fixed, by name: globs separated by commas (conv1.*,bn1.*); they are "
                      "left out of the optimizer and of Horovod's allreduce", flags=("freeze",))
    freeze_bn_stats: bool = opt(True, "--freeze: BatchNorm layers whose parameters are all frozen also keep their "
                                "running statistics (false: the statistics go on updating)")
    channels_last: bool = opt(False, "weights and batches in channels-last (NHWC) memory: faster --amp convs on GPUs",
                              flags=("channels-last",))
    compile: bool = opt(False, "torch.compile the model (the first steps compile; docs/speed.md says when it pays)",
                        flags=("compile",))
    compile_mode: str = opt("default", "torch.compile mode: default, reduce-overhead (CUDA graphs), max-autotune, "
                            "max-autotune-no-cudagraphs", flags=("compile-mode",), choices=COMPILE_MODES)

    drop_path: float = opt(0.0, "stochastic depth: the probability of dropping a residual branch, deepest blocks "
                           "most (timm's drop_path_rate; torchvision's stochastic_depth_prob); models without "
                           "residual branches are refused", flags=("drop-path",))
    grad_checkpointing: bool = opt(False, "recompute activations in backward instead of keeping them: less "
                                   "memory, about a third more compute (timm models)", flags=("grad-checkpointing",))
    ema: bool = opt(False, "keep an exponential moving average of the weights (timm's ModelEmaV3), validated every "
                    "epoch beside them; best.pt, predict and export use the better of the two", flags=("model-ema",))
    ema_decay: float = opt(0.9998, "EMA: weight of the average at each optimizer step", flags=("model-ema-decay",))
    ema_warmup: bool = opt(False, "EMA: let the decay grow from 0 with the steps (timm's warmup), for short runs",
                           flags=("model-ema-warmup",))

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("model.compile_mode (--compile-mode)", self.compile_mode, COMPILE_MODES)
        _require(0.0 <= self.drop_path < 1.0, "model.drop_path (--drop-path)", self.drop_path,
                 "must be a probability in [0, 1), e.g. 0.1")
        _require(0.0 < self.ema_decay < 1.0, "model.ema_decay (--model-ema-decay)", self.ema_decay,
                 "must be in (0, 1), e.g. 0.9998")

    @property
    def freeze_patterns(self) -> tuple[str, ...]:
        """--freeze as a tuple of globs."""
        return tuple(p.strip() for p in self.freeze.split(",") if p.strip())

    @property
    def compiled_as(self) -> Union[str, bool]:
        """What summaries record: the torch.compile mode, or False for an eager model."""
        return self.compile_mode if self.compile else False


@dataclass
class OptimConfig(_Section):
    optimizer: str = opt("sgd", "sgd, adam or adamw (torch's), or any optimizer timm's create_optimizer_v2 knows "
                         "(lamb, lars, lion, adamp, ...), wrapped by Horovod alike", flags=("optimizer", "opt"))
    epochs: int = opt(15, "passes over the training set", flags=("epochs",))
    batch_size: int = opt(32, "samples per rank per backward pass; global batch: x ranks x batches_per_allreduce",
                          flags=("batch-size",))
    lr: float = opt(0.025, "base learning rate for one rank and one batch; scaled by ranks x batches_per_allreduce",
                    flags=("lr",))
    lr_schedule: str = opt("cosine", "per-step decay after warmup: cosine (to 0), step or multistep (x lr_gamma at "
                           "each of lr_milestones), exponential or constant",
                           flags=("sched", "lr-schedule"), choices=LR_SCHEDULES)
    warmup_epochs: float = opt(0.0, "epochs of linear warmup from lr/scale to the scaled lr (Goyal et al. 2017)",
                               flags=("warmup-epochs",))
    lr_milestones: tuple = opt((30, 60, 80), "step schedule: epochs at which the rate is multiplied by lr_gamma")
    lr_gamma: float = opt(0.1, "step: factor at each milestone; exponential: factor per epoch")
    momentum: float = opt(0.9, "SGD momentum", flags=("momentum",))
    nesterov: bool = opt(False, "SGD Nesterov momentum")
    weight_decay: float = opt(0.0, "L2 penalty (decoupled for adamw)", flags=("weight-decay",))
    layer_decay: float = opt(0.0, "layer-wise rate decay: each block from the head down learns at this factor of "
                             "the one above (timm models, e.g. 0.65 for a ViT fine-tune); 0: off",
                             flags=("layer-decay",))
    decay_norm_and_bias: bool = opt(False, "also apply weight decay to biases and normalization layers")
    clip_grad: float = opt(0.0, "clip the global gradient norm to this after averaging; 0: off", flags=("clip-grad",))
    amp: str = opt("off", "mixed precision: off, bf16 (CPU and GPU) or fp16 (GPU, with a gradient scaler)",
                   flags=("amp",), choices=AMP_MODES)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.lr_milestones = tuple(self.lr_milestones)
        self.optimizer = self.optimizer.lower()
        _require(self.optimizer.replace("_", "").isalnum(), "optim.optimizer (--opt)", self.optimizer,
                 f"must be an optimizer's name: {', '.join(OPTIMIZERS)} or one of timm's (lamb, lars, lion, ...)")
        _require(self.epochs > 0, "optim.epochs (--epochs)", self.epochs, "must be a positive number of epochs")
        _require(self.batch_size > 0, "optim.batch_size (--batch-size)", self.batch_size,
                 "must be a positive number of samples per rank")
        _require(self.lr > 0, "optim.lr (--lr)", self.lr, "must be a positive learning rate, e.g. 0.025")
        _choice("optim.lr_schedule (--lr-schedule)", self.lr_schedule, LR_SCHEDULES)
        _require(self.warmup_epochs >= 0, "optim.warmup_epochs (--warmup-epochs)", self.warmup_epochs,
                 "must be 0 or more epochs")
        _require(self.warmup_epochs == 0 or self.warmup_epochs < self.epochs, "optim.warmup_epochs (--warmup-epochs)",
                 self.warmup_epochs, f"must be shorter than the {self.epochs} epoch(s) of training, or the rate never "
                 f"reaches its scaled value; lower it, or raise --epochs")
        _require(all(isinstance(m, int) and m > 0 for m in self.lr_milestones) and
                 list(self.lr_milestones) == sorted(self.lr_milestones), "optim.lr_milestones", self.lr_milestones,
                 "must be increasing positive epochs, e.g. 30,60,80")
        _require(0.0 < self.lr_gamma <= 1.0, "optim.lr_gamma", self.lr_gamma, "must be in (0, 1]")
        _require(0.0 <= self.momentum < 1.0, "optim.momentum", self.momentum, "must be in [0, 1)")
        _require(not self.nesterov or self.momentum > 0, "optim.nesterov", self.nesterov,
                 "needs optim.momentum > 0")
        _require(self.weight_decay >= 0, "optim.weight_decay (--weight-decay)", self.weight_decay, "must be 0 or more")
        _require(0.0 <= self.layer_decay <= 1.0, "optim.layer_decay (--layer-decay)", self.layer_decay,
                 "must be in (0, 1], e.g. 0.65, or 0 for off")
        _require(self.clip_grad >= 0, "optim.clip_grad (--clip-grad)", self.clip_grad,
                 "must be a gradient norm > 0, or 0 for no clipping")
        _choice("optim.amp (--amp)", self.amp, AMP_MODES)


@dataclass
class AugConfig(_Section):
    """Data augmentation and the regularisation of targets, under timm's names (data/augment.py)."""
    no_aug: bool = opt(False, "train on the samples as they are: no crop, flip or affine (by default natural images "
                       "get a padded random crop and flip, digits a small affine, image folders RandomResizedCrop)",
                       flags=("no-aug",))
    aa: str = opt("", "timm's auto-augment policy on training images: rand-m9-mstd0.5-inc1 (RandAugment), "
                  "augmix-m5-w4-d2 (AugMix), original or v0 (AutoAugment); empty: none", flags=("aa",))
    color_jitter: float = opt(0.0, "colour jitter strength (brightness, contrast, saturation); 0: none; ignored "
                              "with --aa, as in timm", flags=("color-jitter",))
    reprob: float = opt(0.0, "random erasing: probability that a training image gets a box erased", flags=("reprob",))
    remode: str = opt("pixel", "random erasing fill: const (zeros), rand (one colour per box) or pixel (noise)",
                      flags=("remode",), choices=ERASE_MODES)
    recount: int = opt(1, "random erasing: boxes at most per image", flags=("recount",))
    mixup: float = opt(0.0, "mixup alpha (Beta distribution of the mixing weight); 0: off", flags=("mixup",))
    cutmix: float = opt(0.0, "CutMix alpha; 0: off", flags=("cutmix",))
    mixup_prob: float = opt(1.0, "probability that a batch is mixed (when mixup or CutMix is on)",
                            flags=("mixup-prob",))
    mixup_switch_prob: float = opt(0.5, "probability of CutMix instead of mixup when both are on",
                                   flags=("mixup-switch-prob",))
    mixup_mode: str = opt("batch", "mix per batch, pair or elem (timm's modes)", flags=("mixup-mode",))
    mixup_off_epoch: int = opt(0, "epoch from which mixup and CutMix stop (the last epochs train on clean "
                               "images); 0: never", flags=("mixup-off-epoch",))
    smoothing: float = opt(0.0, "label smoothing: the share of the target spread over all classes, e.g. 0.1",
                           flags=("smoothing",))
    bce_loss: bool = opt(False, "binary cross-entropy on one-hot (or mixed) targets instead of softmax "
                         "cross-entropy (timm's BinaryCrossEntropy)", flags=("bce-loss",))

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("aug.remode (--remode)", self.remode, ERASE_MODES)
        _choice("aug.mixup_mode", self.mixup_mode, ("batch", "pair", "elem"))
        for name in ("reprob", "mixup_prob", "mixup_switch_prob"):
            _require(0.0 <= getattr(self, name) <= 1.0, f"aug.{name}", getattr(self, name), "must be in [0, 1]")
        for name in ("mixup", "cutmix", "color_jitter"):
            _require(getattr(self, name) >= 0, f"aug.{name}", getattr(self, name), "must be 0 (off) or more")
        _require(0.0 <= self.smoothing < 1.0, "aug.smoothing (--smoothing)", self.smoothing,
                 "must be in [0, 1), e.g. 0.1")
        _require(1 <= self.recount <= 100, "aug.recount", self.recount, "must be 1 to 100 boxes")
        _require(self.mixup_off_epoch >= 0, "aug.mixup_off_epoch (--mixup-off-epoch)", self.mixup_off_epoch,
                 "must be an epoch, or 0 for never")
        check_policy_figures(self.aa)
        _require(not (self.no_aug and (self.aa or self.reprob or self.color_jitter)), "aug.no_aug (--no-aug)", True,
                 "contradicts --aa, --reprob and --color-jitter, which augment: leave out one or the other")

    @property
    def mixing(self) -> bool:
        """Whether mixup or CutMix is on."""
        return self.mixup > 0 or self.cutmix > 0


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    aug: AugConfig = field(default_factory=AugConfig)
    horovod: HorovodConfig = field(default_factory=HorovodConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def __post_init__(self) -> None:
        _require(not self.run.evaluate or bool(self.checkpoint.resume), "run.evaluate (--evaluate)",
                 self.run.evaluate, "needs a checkpoint: add --resume PATH or --resume auto")
        _require(not (self.horovod.elastic and self.data.download), "horovod.elastic (--elastic)", True,
                 "cannot download (--download) while workers come and go: fetch the data set once beforehand")
        _require(not (self.run.overwrite and self.checkpoint.resume), "run.overwrite (--overwrite)",
                 self.run.overwrite, "contradicts --resume: continue the run, or replace it, not both")
        _require(not (self.horovod.use_adasum and self.optim.amp == "fp16"), "horovod.use_adasum (--use-adasum)",
                 self.horovod.use_adasum, "cannot be combined with --amp fp16: the gradient scaler needs averaged "
                 "gradients, which Adasum does not produce; use --amp bf16")

        _require(not self.horovod.shard_optimizer or self.optim.optimizer in SHARDABLE,
                 "horovod.shard_optimizer (--shard-optimizer)", True,
                 f"cannot shard --opt {self.optim.optimizer}: its update looks at whole tensors, and a rank holds a "
                 f"flat slice; use one of {', '.join(SHARDABLE)}, or leave out --shard-optimizer")
        _require(not (self.horovod.shard_optimizer and self.model.channels_last),
                 "horovod.shard_optimizer (--shard-optimizer)", True, "cannot be combined with --channels-last: "
                 "the sharded optimizer keeps the weights in one flat buffer, in the default layout; leave out one "
                 "of them")
        _require(not (self.model.channels_last and self.horovod.elastic), "model.channels_last (--channels-last)",
                 True, "cannot be combined with --elastic: Horovod's elastic state broadcasts the weights as they "
                 "are, and its collectives take only tensors in the default layout")
        _require(not (self.benchmark.enabled and (self.run.evaluate or self.horovod.elastic)),
                 "benchmark.enabled (--benchmark)", True, "times training steps on its own: leave out --evaluate "
                 "and --elastic")

        self._check_sizes()
        _require(self.model.compile or self.model.compile_mode == ModelConfig.compile_mode,
                 "model.compile_mode (--compile-mode)", self.model.compile_mode,
                 "has no effect without --compile: add --compile")
        _require(not (self.profile.enabled and self.run.evaluate), "profile.enabled (--profile)", True,
                 "records training steps, and --evaluate trains none: leave out one of them")

    def _check_sizes(self) -> None:
        """The sizes a run allocates, bounded together as well as one by one (a recipe is data): a sample of
        channels x side x side values, and a rank's batch of them (side: --image-size, or 224 where the data set's
        own; channels: the synthetic data's, else 3)."""
        synthetic = self.data.dataset == "synthetic" or self.benchmark.enabled
        channels, side = self.data.synthetic_channels if synthetic else 3, self.data.image_size or 224
        sample = channels * side * side
        _require(sample <= MAX_SAMPLE_VALUES, "data.image_size (--image-size)", self.data.image_size,
                 f"with {channels} channels makes samples of {sample:,} values, more than {MAX_SAMPLE_VALUES:,}; "
                 f"choose a smaller size or fewer channels")
        batch = sample * self.optim.batch_size
        _require(batch <= MAX_BATCH_VALUES, "optim.batch_size (--batch-size)", self.optim.batch_size,
                 f"makes a batch of {batch:,} values per rank ({channels} x {side} x {side} a sample), more than "
                 f"{MAX_BATCH_VALUES:,} (16 GiB of float32); lower the batch size or the image size")

    def to_dict(self) -> dict[str, Any]:
        """The settings as they are stored and shown (config.json, checkpoints, summaries, trackers): URIs without
        their credentials (hvd_train/errors.py), which stay in this process alone."""
        return redact_values(dataclasses.asdict(self))  # every string: shard commands and plug-in arguments too

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _fields() -> Iterator[tuple[str, type, "dataclasses.Field[Any]"]]:
    """(section name, section class, field) for every configurable field, in declaration order."""
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(cast("type[DataclassInstance]", section.type)):
            yield section.name, cast(type, section.type), f


# Short flags for the settings people reach for first (each field's own `flags`), and the fields that take only
# some values; every field also has its `--section.field` form.
ALIASES = {flag: f"{section}.{f.name}" for section, _, f in _fields() for flag in f.metadata["flags"]}
CHOICES = {f"{section}.{f.name}": f.metadata["choices"] for section, _, f in _fields() if f.metadata["choices"]}


def settings_rows() -> Iterator[dict[str, Any]]:
    """Every setting as documentation: section, `section.field`, short flags, default, meaning (docs/settings.md)."""
    for section, _, f in _fields():
        default = ",".join(map(str, cast(tuple, f.default))) if f.type is tuple else {} if f.type is dict else f.default
        yield {"section": section, "setting": f"{section}.{f.name}", "flags": f.metadata["flags"],
               "default": default, "help": f.metadata["help"]}
