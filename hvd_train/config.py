"""The one typed configuration of a training run.

Each section is a dataclass; every field is opt(default, help), its help (meaning, unit) being its --help text,
and each section checks its own values in __post_init__, so a bad value stops the run before any rank starts training.
Values come from the defaults, then an optional YAML recipe (`--config configs/x.yaml`, sections as keys), then the
command line: `--section.field VALUE` sets any field, and the flags people look for first (`--epochs`,
`--batch-size`, `--amp`, ...) are short aliases listed in ALIASES.
"""
import argparse
import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field

from hvd_train.errors import ConfigError
from hvd_train.trust import TRUST_FLAG, refuse_code_from
from hvd_train.uris import redact, redact_all

LR_SCHEDULES = ("constant", "cosine", "step", "multistep", "exponential")  # multistep: timm's name for step
OPTIMIZERS = ("sgd", "adam", "adamw")  # torch's own; any other name is one of timm's (build.py checks it)
ERASE_MODES = ("const", "rand", "pixel")
AMP_MODES = ("off", "bf16", "fp16")
DEVICES = ("auto", "cuda", "cpu")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
PROFILE_RANKS = ("0", "all")
MAX_WORKERS = 64  # DataLoader processes per rank
MAX_IMAGE_SIDE = 8192  # pixels; a side of 8192 is already 200 MB per float image
RECIPE_MAX_BYTES = 2**20  # a recipe is a page of settings; a larger file is not one


def _require(ok, name, value, why):
    if not ok:
        raise ConfigError(f"{name}={value!r}: {why}")


def _choice(name, value, choices):
    _require(value in choices, name, value, f"must be one of: {', '.join(choices)}")


def opt(default, help):
    """A field with its default and its meaning: the --help text and the documentation of the field."""
    if isinstance(default, dict):  # keyword arguments for a plug-in: a fresh (empty) mapping per config
        return field(default_factory=dict, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _label(section, name):
    """How messages name a field: `optim.lr (--lr)`, with the short flag where there is one."""
    alias = next((flag for flag, dest in ALIASES.items() if dest == f"{section}.{name}"), None)
    return f"{section}.{name}" + (f" (--{alias})" if alias else "")


class _Section:
    """The check every section runs first: each float setting is a finite number.

    No setting uses inf for "unlimited" (those that can be switched off say so with 0 or -1), and nan passes no range
    check while inf passes many (lr > 0, clip_grad >= 0, ...). Checked here, for every float field at once, both get
    one message, whatever field they are given to and whether they come from the command line or a recipe.
    """

    def __post_init__(self):
        section = next(s.name for s in dataclasses.fields(Config) if s.type is type(self))
        for f in (f for f in dataclasses.fields(self) if f.type is float):
            value = getattr(self, f.name)
            _require(math.isfinite(value), _label(section, f.name), value,
                     f"must be a finite number, e.g. the default {f.default!r} ({f.metadata['help']})")


@dataclass
class DataConfig(_Section):
    dataset: str = opt("digits", "digits, synthetic, mnist, fashion_mnist, cifar10, cifar100, stl10, imagefolder, "
                       "shards (WebDataset tars: --data.train_shards/val_shards), or your own factory as "
                       "package.module:name (README: Bring your own model, data and task)")
    args: dict = opt({}, "keyword arguments for your own data set factory: key=value,... (a mapping in a recipe)")
    data_dir: str = opt("datasets", "where data sets are read from (and downloaded to with --download)")
    download: bool = opt(False, "fetch a missing data set (local rank 0 of each host; the others wait)")
    image_size: int = opt(0, "side of the square images fed to the model, in pixels; 0: the data set's own")
    val_fraction: float = opt(0.2, "share held out for validation where the data set has no split, 0 < x < 1")
    split_seed: int = opt(0, "seed of that split; fixed so every rank and every run agree")
    workers: int = opt(0, "DataLoader worker processes per rank (0: load in the training process)")
    drop_last: bool = opt(True, "drop each rank's last incomplete training batch, as timm's loader does (a full-rate "
                          "step on a handful of samples jolts the weights; the shuffle drops others each epoch); "
                          "false: every sample every epoch. Tar shards always train on full batches")
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

    def __post_init__(self):
        super().__post_init__()
        _require(bool(self.data_dir), "data.data_dir (--data-dir)", self.data_dir, "must name a directory")
        _require(self.image_size >= 0, "data.image_size (--image-size)", self.image_size,
                 "must be a size in pixels, or 0 for the data set's own")
        _require(0.0 < self.val_fraction < 1.0, "data.val_fraction", self.val_fraction,
                 "must be between 0 and 1 (exclusive), e.g. 0.2 for a 20% validation split")
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
                    "facts it names (num_classes, in_channels, image_size, ...) and --model-args")
    args: dict = opt({}, "keyword arguments for the model factory: key=value,... (values read as YAML: 4, 0.1, true, "
                     "text; a mapping in a recipe)")
    task: str = opt("", "what the model is trained to do: classification, vae, or your own task class as "
                    "package.module:Name; empty: the model's own (vae for vae, else classification)")
    task_args: dict = opt({}, "keyword arguments for the task class: key=value,...")
    init_from: str = opt("", "start from the weights in this local file (.pt/.pth state dict, .safetensors, or an "
                         "hvd-train checkpoint): tensors whose name and shape match are loaded, the rest (a head for "
                         "another number of classes) stay freshly initialised; rank 0 reads, the others receive")
    init_partial: bool = opt(False, "--init-from: load the matching tensors even when fewer than half of the "
                             "model's do (by default such a file is refused as another network's weights)")
    freeze: str = opt("", "parameters to keep fixed, by name: globs separated by commas (conv1.*,bn1.*); they are "
                      "left out of the optimizer and of Horovod's allreduce")
    freeze_bn_stats: bool = opt(True, "--freeze: BatchNorm layers whose parameters are all frozen also keep their "
                                "running statistics (false: the statistics go on updating)")
    channels_last: bool = opt(False, "weights and batches in channels-last (NHWC) memory: faster --amp convs on GPUs")
    compile: bool = opt(False, "torch.compile the model (the first steps compile; README says when it pays)")
    compile_mode: str = opt("default", "torch.compile mode: default, reduce-overhead (CUDA graphs), max-autotune, "
                            "max-autotune-no-cudagraphs")

    drop_path: float = opt(0.0, "stochastic depth: the probability of dropping a residual branch, deepest blocks "
                           "most (timm's drop_path_rate; torchvision's stochastic_depth_prob); models without "
                           "residual branches are refused")
    grad_checkpointing: bool = opt(False, "recompute activations in backward instead of keeping them: less "
                                   "memory, about a third more compute (timm models)")
    ema: bool = opt(False, "keep an exponential moving average of the weights (timm's ModelEmaV3), validated every "
                    "epoch beside them; best.pt, predict and export use the better of the two")
    ema_decay: float = opt(0.9998, "EMA: weight of the average at each optimizer step")
    ema_warmup: bool = opt(False, "EMA: let the decay grow from 0 with the steps (timm's warmup), for short runs")

    def __post_init__(self):
        super().__post_init__()
        _choice("model.compile_mode (--compile-mode)", self.compile_mode, COMPILE_MODES)
        _require(0.0 <= self.drop_path < 1.0, "model.drop_path (--drop-path)", self.drop_path,
                 "must be a probability in [0, 1), e.g. 0.1")
        _require(0.0 < self.ema_decay < 1.0, "model.ema_decay (--model-ema-decay)", self.ema_decay,
                 "must be in (0, 1), e.g. 0.9998")

    @property
    def freeze_patterns(self):
        """--freeze as a tuple of globs."""
        return tuple(p.strip() for p in self.freeze.split(",") if p.strip())

    @property
    def compiled_as(self):
        """What summaries record: the torch.compile mode, or False for an eager model."""
        return self.compile_mode if self.compile else False


@dataclass
class OptimConfig(_Section):
    optimizer: str = opt("sgd", "sgd, adam or adamw (torch's), or any optimizer timm's create_optimizer_v2 knows "
                         "(lamb, lars, lion, adamp, ...), wrapped by Horovod alike")
    epochs: int = opt(15, "passes over the training set")
    batch_size: int = opt(32, "samples per rank per backward pass; global batch: x ranks x batches_per_allreduce")
    lr: float = opt(0.025, "base learning rate for one rank and one batch; scaled by ranks x batches_per_allreduce")
    lr_schedule: str = opt("cosine", "per-step decay after warmup: cosine (to 0), step or multistep (x lr_gamma at "
                           "each of lr_milestones), exponential or constant")
    warmup_epochs: float = opt(0.0, "epochs of linear warmup from lr/scale to the scaled lr (Goyal et al. 2017)")
    lr_milestones: tuple = opt((30, 60, 80), "step schedule: epochs at which the rate is multiplied by lr_gamma")
    lr_gamma: float = opt(0.1, "step: factor at each milestone; exponential: factor per epoch")
    momentum: float = opt(0.9, "SGD momentum")
    nesterov: bool = opt(False, "SGD Nesterov momentum")
    weight_decay: float = opt(0.0, "L2 penalty (decoupled for adamw)")
    layer_decay: float = opt(0.0, "layer-wise rate decay: each block from the head down learns at this factor of "
                             "the one above (timm models, e.g. 0.65 for a ViT fine-tune); 0: off")
    decay_norm_and_bias: bool = opt(False, "also apply weight decay to biases and normalization layers")
    clip_grad: float = opt(0.0, "clip the global gradient norm to this after averaging; 0: off")
    amp: str = opt("off", "mixed precision: off, bf16 (CPU and GPU) or fp16 (GPU, with a gradient scaler)")

    def __post_init__(self):
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
                       "get a padded random crop and flip, digits a small affine, image folders RandomResizedCrop)")
    aa: str = opt("", "timm's auto-augment policy on training images: rand-m9-mstd0.5-inc1 (RandAugment), "
                  "augmix-m5-w4-d2 (AugMix), original or v0 (AutoAugment); empty: none")
    color_jitter: float = opt(0.0, "colour jitter strength (brightness, contrast, saturation); 0: none; ignored "
                              "with --aa, as in timm")
    reprob: float = opt(0.0, "random erasing: probability that a training image gets a box erased")
    remode: str = opt("pixel", "random erasing fill: const (zeros), rand (one colour per box) or pixel (noise)")
    recount: int = opt(1, "random erasing: boxes at most per image")
    mixup: float = opt(0.0, "mixup alpha (Beta distribution of the mixing weight); 0: off")
    cutmix: float = opt(0.0, "CutMix alpha; 0: off")
    mixup_prob: float = opt(1.0, "probability that a batch is mixed (when mixup or CutMix is on)")
    mixup_switch_prob: float = opt(0.5, "probability of CutMix instead of mixup when both are on")
    mixup_mode: str = opt("batch", "mix per batch, pair or elem (timm's modes)")
    mixup_off_epoch: int = opt(0, "epoch from which mixup and CutMix stop (the last epochs train on clean "
                               "images); 0: never")
    smoothing: float = opt(0.0, "label smoothing: the share of the target spread over all classes, e.g. 0.1")
    bce_loss: bool = opt(False, "binary cross-entropy on one-hot (or mixed) targets instead of softmax "
                         "cross-entropy (timm's BinaryCrossEntropy)")

    def __post_init__(self):
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
        _require(not (self.no_aug and (self.aa or self.reprob or self.color_jitter)), "aug.no_aug (--no-aug)", True,
                 "contradicts --aa, --reprob and --color-jitter, which augment: leave out one or the other")

    @property
    def mixing(self):
        """Whether mixup or CutMix is on."""
        return self.mixup > 0 or self.cutmix > 0


@dataclass
class HorovodConfig(_Section):
    batches_per_allreduce: int = opt(1, "backward passes summed locally before one allreduce (gradient accumulation)")
    fp16_allreduce: bool = opt(False, "compress gradients to fp16 for the allreduce (half the bytes on the wire)")
    use_adasum: bool = opt(False, "combine gradients with Adasum instead of averaging them")
    gradient_predivide_factor: float = opt(1.0, "divide gradients by this before the allreduce, the rest after")
    sync_bn: bool = opt(False, "batch-norm statistics computed over all ranks (hvd.SyncBatchNorm)")
    elastic: bool = opt(False, "elastic training under horovodrun --min-np/--max-np --host-discovery-script")
    commit_every: int = opt(20, "elastic: steps between state commits (at most this many are redone on a reset)")
    fusion_threshold_mb: float = opt(-1.0, "tensor fusion buffer, MB (0: none; -1: 8 on CPUs, 128 on GPUs); README")
    cycle_time_ms: float = opt(0.0, "Horovod's cycle, ms (0: by launch, README); launcher flags win")

    def __post_init__(self):
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


@dataclass
class CheckpointConfig(_Section):
    resume: str = opt("", "checkpoint to resume from: a path, or auto for the newest in <output dir>/checkpoints")
    keep_last: int = opt(3, "how many of the newest per-epoch checkpoints to keep (last.pt and best.pt are extra)")
    every_epochs: int = opt(1, "write a checkpoint every this many epochs (and after the last)")
    hist: int = opt(1, "how many of the best checkpoints to keep: best.pt and, from 2, best_epoch_NNNN.pt for each "
                    "of the N best epochs by the task's best metric")

    def __post_init__(self):
        super().__post_init__()
        _require(self.keep_last >= 0, "checkpoint.keep_last", self.keep_last, "must be 0 or more")
        _require(self.every_epochs >= 1, "checkpoint.every_epochs", self.every_epochs, "must be 1 or more")
        _require(self.hist >= 1, "checkpoint.hist (--checkpoint-hist)", self.hist, "must be 1 or more")


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
                       "(<output dir>/mlflow.db) unless --mlflow-uri names a tracking server")
    mlflow_uri: str = opt("", "MLflow tracking URI (http://host:5000, sqlite:///path.db, databricks); implies --mlflow")
    mlflow_experiment: str = opt("hvd-train", "MLflow experiment the run is logged in (created if missing)")
    wandb: bool = opt(False, "log the run to Weights & Biases offline from rank 0: <output dir>/wandb/offline-run-*, "
                      "uploaded later with `wandb sync` (no network while training)")
    wandb_project: str = opt("hvd-train", "W&B project of the run")

    def __post_init__(self):
        super().__post_init__()
        _require(self.log_every >= 1, "logging.log_every", self.log_every, "must be 1 or more steps")
        _require(self.progress_every >= 0, "logging.progress_every", self.progress_every, "must be 0 or more seconds")


@dataclass
class RunConfig(_Section):
    output_dir: str = opt("runs/latest", "where rank 0 writes summary, metrics, checkpoints and the resolved config")
    seed: int = opt(42, "base random seed; rank r seeds with seed + r, parameters come from rank 0")
    evaluate: bool = opt(False, "only evaluate the checkpoint given by --resume, then stop")
    overwrite: bool = opt(False, "start afresh in an output directory that holds a run, replacing its files")
    device: str = opt("auto", "auto (the GPU local_rank when CUDA sees one, else the CPU), cuda or cpu")
    name: str = opt("", "name of this configuration in the summary (default: the recipe's file name)")
    stop_at: float = opt(0.0, "stop once an epoch reaches this (98: val top-1 98%; VAE: val loss <= it); 0: off")
    freeze_timeout_s: float = opt(300.0, "end the job, naming the rank that holds it up, when this rank has waited "
                                  "this many seconds without progress (0: never; fixed-size jobs)")
    patience: int = opt(0, "early stopping: end training when the best metric has not improved for this many "
                        "epochs (decided on the global metric, every rank together); 0: off")
    divergence_factor: float = opt(100.0, "stop every rank (exit 3) when an epoch's training loss exceeds this many "
                                   "times the run's first-step loss: training that diverged but stayed finite; 0: off")

    def __post_init__(self):
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
    enabled: bool = opt(False, "time training steps on one synthetic in-memory batch instead of training")
    num_warmup_batches: int = opt(10, "untimed steps first: allocator, caches and Horovod's first negotiation settle")
    num_iters: int = opt(10, "timed iterations; images/s is reported as mean +- 1.96 std over them")
    num_batches_per_iter: int = opt(10, "training steps per timed iteration")

    def __post_init__(self):
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
                        "<output dir>/profile")
    start: int = opt(5, "training steps left out before the profiled ones (warm-up, Horovod's first negotiation, "
                     "torch.compile)")
    steps: int = opt(3, "training steps profiled")
    ranks: str = opt("0", "whose steps torch.profiler records: 0 (rank 0) or all (a trace per rank); Horovod's "
                     "timeline is rank 0's view of every rank")

    def __post_init__(self):
        super().__post_init__()
        _require(self.start >= 0, "profile.start (--profile-start)", self.start, "must be 0 or more steps")
        _require(1 <= self.steps <= 1000, "profile.steps (--profile-steps)", self.steps,
                 "must be 1 to 1000 steps (a trace of more is too large to open)")
        _choice("profile.ranks (--profile-ranks)", self.ranks, PROFILE_RANKS)


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

    def __post_init__(self):
        _require(not self.run.evaluate or bool(self.checkpoint.resume), "run.evaluate (--evaluate)",
                 self.run.evaluate, "needs a checkpoint: add --resume PATH or --resume auto")
        _require(not (self.horovod.elastic and self.data.download), "horovod.elastic (--elastic)", True,
                 "cannot download (--download) while workers come and go: fetch the data set once beforehand")
        _require(not (self.run.overwrite and self.checkpoint.resume), "run.overwrite (--overwrite)",
                 self.run.overwrite, "contradicts --resume: continue the run, or replace it, not both")
        _require(not (self.horovod.use_adasum and self.optim.amp == "fp16"), "horovod.use_adasum (--use-adasum)",
                 self.horovod.use_adasum, "cannot be combined with --amp fp16: the gradient scaler needs averaged "
                 "gradients, which Adasum does not produce; use --amp bf16")

        _require(not (self.model.channels_last and self.horovod.elastic), "model.channels_last (--channels-last)",
                 True, "cannot be combined with --elastic: Horovod's elastic state broadcasts the weights as they "
                 "are, and its collectives take only tensors in the default layout")
        _require(not (self.benchmark.enabled and (self.run.evaluate or self.horovod.elastic)),
                 "benchmark.enabled (--benchmark)", True, "times training steps on its own: leave out --evaluate "
                 "and --elastic")

        _require(self.model.compile or self.model.compile_mode == ModelConfig.compile_mode,
                 "model.compile_mode (--compile-mode)", self.model.compile_mode,
                 "has no effect without --compile: add --compile")
        _require(not (self.profile.enabled and self.run.evaluate), "profile.enabled (--profile)", True,
                 "records training steps, and --evaluate trains none: leave out one of them")

        if self.benchmark.enabled and self.run.output_dir == RunConfig.output_dir:
            self.run.output_dir = "runs/benchmark"  # beside a training run's default directory, not over it

    def to_dict(self):
        """The settings as they are stored and shown (config.json, checkpoints, summaries, trackers): URIs without
        their credentials (hvd_train/uris.py), which stay in this process alone."""
        d = dataclasses.asdict(self)
        d["logging"]["mlflow_uri"] = redact(d["logging"]["mlflow_uri"])
        for name in ("train_shards", "val_shards", "shard_index"):
            d["data"][name] = redact_all(d["data"][name])
        return d

    def to_json(self):
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# Short flags for the settings people reach for first; every field also has its `--section.field` form.
ALIASES = {
    "output-dir": "run.output_dir",
    "seed": "run.seed",
    "evaluate": "run.evaluate",
    "overwrite": "run.overwrite",
    "device": "run.device",
    "model": "model.name",
    "model-args": "model.args",
    "task": "model.task",
    "task-args": "model.task_args",
    "init-from": "model.init_from",
    "freeze": "model.freeze",
    "channels-last": "model.channels_last",
    "compile": "model.compile",
    "compile-mode": "model.compile_mode",
    "dataset": "data.dataset",
    "data-args": "data.args",
    "data-dir": "data.data_dir",
    "download": "data.download",
    "image-size": "data.image_size",
    "workers": "data.workers",
    "optimizer": "optim.optimizer",
    "opt": "optim.optimizer",
    "weight-decay": "optim.weight_decay",
    "layer-decay": "optim.layer_decay",
    "sched": "optim.lr_schedule",
    "no-aug": "aug.no_aug",
    "aa": "aug.aa",
    "color-jitter": "aug.color_jitter",
    "reprob": "aug.reprob",
    "remode": "aug.remode",
    "recount": "aug.recount",
    "mixup": "aug.mixup",
    "cutmix": "aug.cutmix",
    "mixup-prob": "aug.mixup_prob",
    "mixup-switch-prob": "aug.mixup_switch_prob",
    "mixup-mode": "aug.mixup_mode",
    "mixup-off-epoch": "aug.mixup_off_epoch",
    "smoothing": "aug.smoothing",
    "bce-loss": "aug.bce_loss",
    "drop-path": "model.drop_path",
    "grad-checkpointing": "model.grad_checkpointing",
    "model-ema": "model.ema",
    "model-ema-decay": "model.ema_decay",
    "model-ema-warmup": "model.ema_warmup",
    "checkpoint-hist": "checkpoint.hist",
    "patience": "run.patience",
    "epochs": "optim.epochs",
    "batch-size": "optim.batch_size",
    "lr": "optim.lr",
    "lr-schedule": "optim.lr_schedule",
    "warmup-epochs": "optim.warmup_epochs",
    "momentum": "optim.momentum",
    "clip-grad": "optim.clip_grad",
    "amp": "optim.amp",
    "batches-per-allreduce": "horovod.batches_per_allreduce",
    "fp16-allreduce": "horovod.fp16_allreduce",
    "use-adasum": "horovod.use_adasum",
    "sync-bn": "horovod.sync_bn",
    "elastic": "horovod.elastic",
    "resume": "checkpoint.resume",
    "stop-at": "run.stop_at",
    "freeze-timeout": "run.freeze_timeout_s",
    "benchmark": "benchmark.enabled",
    "num-warmup-batches": "benchmark.num_warmup_batches",
    "num-iters": "benchmark.num_iters",
    "num-batches-per-iter": "benchmark.num_batches_per_iter",
    "mlflow": "logging.mlflow",
    "mlflow-uri": "logging.mlflow_uri",
    "wandb": "logging.wandb",
    "profile": "profile.enabled",
    "profile-start": "profile.start",
    "profile-steps": "profile.steps",
    "profile-ranks": "profile.ranks",
}
CHOICES = {"optim.lr_schedule": LR_SCHEDULES, "optim.amp": AMP_MODES,
           "run.device": DEVICES, "model.compile_mode": COMPILE_MODES, "profile.ranks": PROFILE_RANKS,
           "aug.remode": ERASE_MODES}


def _fields():
    """(section name, section class, field) for every configurable field, in declaration order."""
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.type):
            yield section.name, section.type, f


def _parse_bool(text):
    lowered = str(text).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_int_tuple(text):
    try:
        return tuple(int(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers such as 30,60,80, got {text!r}")


def parse_mapping(text):
    """key=value,key=value -> a dict; each value is read as YAML (4, 0.5, true, a word), so it arrives typed."""
    import yaml

    out = {}
    for part in (p.strip() for p in str(text).split(",")):
        key, sep, value = part.partition("=")
        if not part:
            continue
        if not sep or not key.strip().isidentifier():
            raise argparse.ArgumentTypeError(f"expected key=value pairs separated by commas, such as depth=4,"
                                             f"dropout=0.1, got {part!r}")
        try:
            out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            out[key.strip()] = value
    return out


_PARSERS = {bool: _parse_bool, tuple: _parse_int_tuple, int: int, float: float, str: str, dict: parse_mapping}


class _Parser(argparse.ArgumentParser):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # argparse takes `-inf` and `-1e-3` after a flag for flags, and then says "expected one argument"; as no flag
        # of ours looks like a number, every negative number is a value, which the field's own check then judges.
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$|^-(inf|infinity|nan)$",
                                                   re.IGNORECASE)

    def error(self, message):
        # One exception type for every bad setting, so the entry point reports it once, the same way.
        raise ConfigError(f"{message} (see --help)")


def build_parser():
    parser = _Parser(
        prog="train_hvd.py",
        description="Data-parallel training with Horovod. Launch with horovodrun or mpirun; runs alone too. "
                    "Settings: defaults < --config YAML < these flags.",
        epilog="More commands of the installed hvd-train: doctor (check a job's hosts), shard (write tar shards), "
               "export (safetensors, TorchScript, ONNX), predict (classes of image files); hvd-train COMMAND --help.")
    parser.add_argument("--config", metavar="YAML", help="recipe with one mapping per section (see configs/)")
    parser.add_argument(TRUST_FLAG, action="store_true", dest="trust_code",
                        help="let the recipe name code: import paths (package.module:name) and pipe: shard commands; "
                             "without it a recipe is data and such values must be given as flags (README: What is "
                             "code and what is data)")
    alias_of = {}
    for flag, dest in ALIASES.items():  # a field may have several: --optimizer and timm's --opt
        alias_of.setdefault(dest, []).append(flag)
    groups = {}
    for section, _, f in _fields():
        if section not in groups:
            groups[section] = parser.add_argument_group(f"{section} settings")
        dest = f"{section}.{f.name}"
        flags = [f"--{dest}"]
        flags[:0] = [f"--{alias}" for alias in alias_of.get(dest, ())]
        extra = {"nargs": "?", "const": True} if f.type is bool else {}  # `--download` alone means true
        metavar = "KEY=VALUE,..." if f.type is dict else f.type.__name__.upper()
        if dest in CHOICES:
            extra["choices"] = CHOICES[dest]
            metavar = "{" + ",".join(CHOICES[dest]) + "}"
        default = ",".join(map(str, f.default)) if f.type is tuple else {} if f.type is dict else f.default
        groups[section].add_argument(
            *flags, dest=dest, type=_PARSERS[f.type], default=argparse.SUPPRESS, metavar=metavar,
            help=f"{f.metadata['help']} (default: {default!r})".replace("%", "%%"), **extra)
    return parser


def _check_yaml_value(where, f, value):
    """YAML gives typed values: accept the field's type (ints for floats, lists for tuples), refuse the rest."""
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        tuple: isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool)
                                                        for v in value),
        dict: isinstance(value, dict) and all(isinstance(k, str) and k.isidentifier() for k in value),
    }[f.type]
    if not ok:
        kind = {tuple: "tuple of whole numbers", dict: "mapping of names to values"}.get(f.type, f.type.__name__)
        raise ConfigError(f"{where}: expected {kind}, "
                          f"got {type(value).__name__} {value!r}")
    if f.type is float:
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{where}: a whole number of {len(str(abs(value)))} digits is too large for a float")
    return value


def _read_text(path):
    """The recipe's text, or a ConfigError saying why it cannot be read."""
    if os.path.isdir(path):
        raise ConfigError(f"--config {path}: is a directory; expected a YAML file such as configs/digits_cnn.yaml")
    try:
        with open(path, "rb") as fh:
            data = fh.read(RECIPE_MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file (recipes live in configs/)")
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror or e})")
    if len(data) > RECIPE_MAX_BYTES:
        raise ConfigError(f"--config {path}: larger than {RECIPE_MAX_BYTES // 1024} KB, which no recipe needs; give a "
                          f"YAML recipe such as configs/digits_cnn.yaml")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {data[e.start]:#04x} on line {line}); "
                          f"save it as UTF-8")


def _repeated_key(mapping, prefix=""):
    """(dotted key, first line, second line) of a key written twice in this YAML mapping node, else None.

    Keys pulled in by a merge (`<<: *base`) are left out: YAML lets a mapping's own keys override those."""
    first = {}
    for key, _ in mapping.value:
        if key.id != "scalar" or key.tag == "tag:yaml.org,2002:merge":
            continue
        line = key.start_mark.line + 1
        if (key.tag, key.value) in first:
            return prefix + key.value, first[key.tag, key.value], line
        first[key.tag, key.value] = line
    return None


def _refuse_repeats(root, path):
    """A section written twice, or a key written twice within one: PyYAML would keep the last without a word."""
    if root is None or root.id != "mapping":
        return  # load_recipe refuses a recipe that is not a mapping of sections
    repeated = _repeated_key(root)
    if repeated:
        raise ConfigError(f"--config {path}: section {repeated[0]} appears twice, on lines {repeated[1]} and "
                          f"{repeated[2]}; merge them into one")
    for key, value in root.value:
        repeated = _repeated_key(value, f"{key.value}.") if key.id == "scalar" and value.id == "mapping" else None
        if repeated:
            raise ConfigError(f"--config {path}: {repeated[0]} appears twice, on lines {repeated[1]} and "
                              f"{repeated[2]}; keep one")


def _refuse_aliases(root, path):
    """A YAML alias (*name) repeats a node wherever it is used; nested, a few hundred bytes expand to gigabytes
    (the "billion laughs"). Recipes are short enough to write out, so aliases are refused where they are used."""
    seen, stack = set(), [root] if root is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            raise ConfigError(f"--config {path}: the value anchored on line {node.start_mark.line + 1} is used "
                              f"again through an alias (*name); aliases are refused in recipes (they can expand "
                              f"without bound): write the values out")
        seen.add(id(node))
        if node.id == "mapping":
            stack += [n for pair in node.value for n in pair]
        elif node.id == "sequence":
            stack += node.value


def _parse_yaml(text, path):
    """yaml.safe_load, step by step: the document's nodes are checked for repeated keys before they become dicts."""
    import yaml

    loader = yaml.SafeLoader(text)
    loader.name = path  # PyYAML's own messages then name the file, as they do when given an open file
    try:
        root = loader.get_single_node()
        _refuse_aliases(root, path)
        _refuse_repeats(root, path)
        return None if root is None else loader.construct_document(root)
    finally:
        loader.dispose()


def load_recipe(path, known_only=False):
    """Read a YAML recipe into {section: {field: value}}, refusing unknown sections, unknown keys and wrong types
    (known_only: leaving out unknown sections and keys instead, for a run's config.json written by another
    version)."""
    import yaml

    text = _read_text(path)
    try:
        raw = _parse_yaml(text, path)
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML: {e}")
    if raw is None or raw == {}:
        raise ConfigError(f"--config {path}: holds no settings; write sections as in configs/digits_cnn.yaml, "
                          f"or leave out --config")
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of sections, got {type(raw).__name__}")
    sections = {s.name: s.type for s in dataclasses.fields(Config)}
    recipe = {}
    for section, values in raw.items():
        if section not in sections and known_only:
            continue
        if section not in sections:
            raise ConfigError(f"--config {path}: unknown section {section!r}; sections are: {', '.join(sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"--config {path}: section {section!r} must be a mapping of field: value")
        known = {f.name: f for f in dataclasses.fields(sections[section])}
        for key, value in values.items():
            if key not in known and known_only:
                continue
            if key not in known:
                raise ConfigError(f"--config {path}: unknown key {section}.{key}; {section} has: {', '.join(known)}")
            recipe.setdefault(section, {})[key] = _check_yaml_value(f"--config {path}: {section}.{key}",
                                                                    known[key], value)
    return recipe


def parse_config(argv=None):
    """Defaults < the run's recorded settings (resuming or evaluating) < YAML recipe < command line; raises
    ConfigError (with the field named) on an invalid value."""
    args = vars(build_parser().parse_args(argv))
    values = load_recipe(args["config"]) if args.get("config") else {}
    given = {f"{section}.{f.name}": args[f"{section}.{f.name}"] for section, _, f in _fields()
             if f"{section}.{f.name}" in args}
    refuse_code_from(values, f"--config {args.get('config')}", args.get("trust_code"), given)
    for key, value in given.items():
        section, name = key.split(".")
        values.setdefault(section, {})[name] = value
    recorded_at = recorded_config(values)
    notes = []
    if recorded_at:
        recorded = recorded_values(recorded_at)
        refuse_code_from(recorded, recorded_at, args.get("trust_code"), given)
        notes = changes_from(recorded, values, recorded_at)
        for section, fields in recorded.items():
            values[section] = {**fields, **values.get(section, {})}
    if args.get("config") and "name" not in values.get("run", {}):
        values.setdefault("run", {})["name"] = os.path.splitext(os.path.basename(args["config"]))[0]
    built = {s.name: s.type(**values.get(s.name, {})) for s in dataclasses.fields(Config)}
    cfg = Config(**built)
    cfg.notes = notes  # lines for the log, not a setting: what this run changed from its recorded settings
    return cfg


# What a resumed or evaluated run never takes from the recorded settings: where it is and what it does now.
NOT_RECORDED = {"run": ("output_dir", "evaluate", "overwrite"), "checkpoint": ("resume",)}
RECORDED = "config.json"  # the resolved settings a run writes into its output directory (hvd_train/run/directory.py)


def recorded_config(values):
    """The config.json of the run a --resume or --evaluate continues (beside the checkpoint's checkpoints/ folder,
    or in --output-dir for --resume auto), or None."""
    resume = values.get("checkpoint", {}).get("resume")
    if not resume:
        return None
    if resume == "auto":
        folder = values.get("run", {}).get("output_dir", RunConfig.output_dir)
    else:
        parent = os.path.dirname(os.path.abspath(resume))
        folder = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else parent
    path = os.path.join(folder, RECORDED)
    return path if os.path.isfile(path) else None


def recorded_values(path):
    """The settings recorded at `path`, less those a continuing run decides itself and any this version lacks."""
    recorded = load_recipe(path, known_only=True)
    for section, names in NOT_RECORDED.items():
        for name in names:
            recorded.get(section, {}).pop(name, None)
    return recorded


def changes_from(recorded, values, path):
    """One line per setting given again with another value than the run recorded."""
    notes = []
    for section, fields in values.items():
        for name, value in fields.items():
            before = recorded.get(section, {}).get(name)
            if name in recorded.get(section, {}) and _same(before, value) is False:
                notes.append(f"{section}.{name}: {before!r} -> {value!r} (recorded in {path})")
    return notes


def _same(a, b):
    return tuple(a) == tuple(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b


def config_from_dict(values):
    """Rebuild a Config from to_dict() output (as stored in checkpoints)."""
    return Config(**{s.name: s.type(**values.get(s.name, {})) for s in dataclasses.fields(Config)})
