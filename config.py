"""The one typed configuration of a training run.

Each section is a dataclass; every field has a default and a comment with its meaning and unit, and each section
checks its own values in __post_init__ so a bad value stops the run before any process starts training.
The command line is generated from these fields: `--section.field VALUE` sets any of them, and the flags people
look for first (`--epochs`, `--batch-size`, `--lr`, ...) are short aliases listed in ALIASES.
"""
import argparse
import dataclasses
import inspect
import json
import re
from dataclasses import dataclass, field


LR_SCHEDULES = ("constant", "cosine")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the reason and the fix."""


def _require(ok, name, value, why):
    if not ok:
        raise ConfigError(f"{name}={value!r}: {why}")


@dataclass
class DataConfig:
    dataset: str = "digits"     # data set name (see data.DATASETS)
    val_fraction: float = 0.2   # share of the samples held out for validation, 0 < x < 1
    split_seed: int = 0         # seed of the train/validation split; fixed so every rank and every run agree
    workers: int = 0            # DataLoader worker processes per rank (0: load in the training process)

    def __post_init__(self):
        _require(0.0 < self.val_fraction < 1.0, "data.val_fraction", self.val_fraction,
                 "must be between 0 and 1 (exclusive), e.g. 0.2 for a 20% validation split")
        _require(self.workers >= 0, "data.workers", self.workers, "must be 0 or more")


@dataclass
class ModelConfig:
    name: str = "small_cnn"     # model name (see models.MODELS)


@dataclass
class OptimConfig:
    epochs: int = 15            # passes over the training set
    batch_size: int = 32        # samples per rank per step; the global batch is this times the number of ranks
    lr: float = 0.025           # base learning rate for one rank; multiplied by the number of ranks (linear scaling)
    lr_schedule: str = "cosine"  # per-step decay of the scaled rate: cosine (to 0 at the end) or constant
    momentum: float = 0.9       # SGD momentum
    weight_decay: float = 0.0   # L2 penalty added by SGD

    def __post_init__(self):
        _require(self.epochs > 0, "optim.epochs (--epochs)", self.epochs, "must be a positive number of epochs")
        _require(self.batch_size > 0, "optim.batch_size (--batch-size)", self.batch_size,
                 "must be a positive number of samples per rank")
        _require(self.lr > 0, "optim.lr (--lr)", self.lr, "must be a positive learning rate, e.g. 0.025")
        _require(self.lr_schedule in LR_SCHEDULES, "optim.lr_schedule (--lr-schedule)", self.lr_schedule,
                 f"must be one of: {', '.join(LR_SCHEDULES)}")
        _require(0.0 <= self.momentum < 1.0, "optim.momentum", self.momentum, "must be in [0, 1)")
        _require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be 0 or more")


@dataclass
class RunConfig:
    output_dir: str = "runs/latest"  # where rank 0 writes summary.json and the resolved config
    seed: int = 42                   # base random seed; rank r seeds with seed + r, parameters come from rank 0

    def __post_init__(self):
        _require(bool(self.output_dir), "run.output_dir (--output-dir)", self.output_dir, "must name a directory")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self):
        return dataclasses.asdict(self)

    def to_json(self):
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# Short flags for the settings people reach for first; every field also has its `--section.field` form.
ALIASES = {
    "output-dir": "run.output_dir",
    "seed": "run.seed",
    "epochs": "optim.epochs",
    "batch-size": "optim.batch_size",
    "lr": "optim.lr",
    "lr-schedule": "optim.lr_schedule",
    "momentum": "optim.momentum",
    "dataset": "data.dataset",
    "workers": "data.workers",
    "model": "model.name",
}


def _fields():
    """(section name, section class, field) for every configurable field, in declaration order."""
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.type):
            yield section.name, section.type, f


def _field_comments(cls):
    """The trailing comment of each field in the class source: the one place a field's meaning is written down."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+):.*?#\s*(.+)$", line)
        if m:
            comments[m.group(1)] = m.group(2).strip()
    return comments


def _parse_bool(text):
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One exception type for every bad setting, so the entry point reports it once, the same way.
        raise ConfigError(f"{message} (see --help)")


def build_parser():
    parser = _Parser(
        prog="train_hvd.py",
        description="Data-parallel training with Horovod. Launch with horovodrun or mpirun; runs alone too.")
    alias_of = {dest: flag for flag, dest in ALIASES.items()}
    groups, comments = {}, {}
    for section, cls, f in _fields():
        if section not in groups:
            groups[section] = parser.add_argument_group(f"{section} settings")
            comments[section] = _field_comments(cls)
        dest = f"{section}.{f.name}"
        flags = [f"--{dest}"]
        if dest in alias_of:
            flags.insert(0, f"--{alias_of[dest]}")
        groups[section].add_argument(
            *flags, dest=dest, type=_parse_bool if f.type is bool else f.type, default=argparse.SUPPRESS,
            metavar=f.type.__name__.upper(), help=f"{comments[section].get(f.name, '')} (default: {f.default!r})")
    return parser


def parse_config(argv=None):
    """Defaults, then command-line values; raises ConfigError (with the field named) on an invalid value."""
    args = vars(build_parser().parse_args(argv))
    sections = {}
    for section, cls, f in _fields():
        key = f"{section}.{f.name}"
        if key in args:
            sections.setdefault(section, {})[f.name] = args[key]
    built = {}
    for section in dataclasses.fields(Config):
        built[section.name] = section.type(**sections.get(section.name, {}))
    return Config(**built)
