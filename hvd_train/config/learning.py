"""The sections of what is learned and how: data, model, optimizer and schedule, augmentation and
regularisation."""

from dataclasses import dataclass

from hvd_train.config.fields import (AMP_MODES, COMPILE_MODES, DECODES, ERASE_MODES, LR_SCHEDULES, MAX_IMAGE_SIDE,
                                     MAX_WORKERS, OPTIMIZERS, _Section, _choice, _require, check_policy_figures, opt)


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

    def __post_init__(self):
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
        check_policy_figures(self.aa)
        _require(not (self.no_aug and (self.aa or self.reprob or self.color_jitter)), "aug.no_aug (--no-aug)", True,
                 "contradicts --aa, --reprob and --color-jitter, which augment: leave out one or the other")

    @property
    def mixing(self):
        """Whether mixup or CutMix is on."""
        return self.mixup > 0 or self.cutmix > 0
