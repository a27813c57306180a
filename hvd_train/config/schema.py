"""The whole configuration (one section per concern) with its cross-section checks, and every field with its
flags: what --help, docs/settings.md and the messages are made from."""
import dataclasses
import json
from dataclasses import dataclass, field

from hvd_train.uris import redact_values
from hvd_train.config.fields import MAX_BATCH_VALUES, MAX_SAMPLE_VALUES, SHARDABLE, _require
from hvd_train.config.learning import AugConfig, DataConfig, ModelConfig, OptimConfig
from hvd_train.config.job import (BenchmarkConfig, CheckpointConfig, HorovodConfig, LoggingConfig, ProfileConfig,
                                  RunConfig)


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

    def _check_sizes(self):
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

    def to_dict(self):
        """The settings as they are stored and shown (config.json, checkpoints, summaries, trackers): URIs without
        their credentials (hvd_train/uris.py), which stay in this process alone."""
        return redact_values(dataclasses.asdict(self))  # every string: shard commands and plug-in arguments too

    def to_json(self):
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _fields():
    """(section name, section class, field) for every configurable field, in declaration order."""
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.type):
            yield section.name, section.type, f


# Short flags for the settings people reach for first (each field's own `flags`), and the fields that take only
# some values; every field also has its `--section.field` form.
ALIASES = {flag: f"{section}.{f.name}" for section, _, f in _fields() for flag in f.metadata["flags"]}
CHOICES = {f"{section}.{f.name}": f.metadata["choices"] for section, _, f in _fields() if f.metadata["choices"]}


def settings_rows():
    """Every setting as documentation: section, `section.field`, short flags, default, meaning (docs/settings.md)."""
    for section, _, f in _fields():
        default = ",".join(map(str, f.default)) if f.type is tuple else {} if f.type is dict else f.default
        yield {"section": section, "setting": f"{section}.{f.name}", "flags": f.metadata["flags"],
               "default": default, "help": f.metadata["help"]}
