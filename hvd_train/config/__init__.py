"""The one typed configuration of a training run.

Each section is a dataclass; every field is opt(default, help, flags, choices): its help (meaning, unit) is its --help
text and its line in docs/settings.md, its flags the short spellings beside it; each section checks its own values in
__post_init__, so a bad value stops the run before any rank starts training. Values come from the defaults, then an
optional YAML recipe (`--config configs/x.yaml`, sections as keys), then the command line: `--section.field VALUE`
sets any field, and the flags people look for first (`--epochs`, `--batch-size`, `--amp`, ...) are short ones.

fields.py    opt(), the checks every section runs, the named choices and bounds
learning.py  data, model, optim, aug: what is learned and how
job.py       horovod, checkpoint, logging, run, benchmark, profile: how the job runs
schema.py    Config (the sections and the checks across them), every field with its flags (ALIASES, CHOICES)
recipe.py    YAML recipes, read as data
recorded.py  config.json, and what a resumed or evaluated run takes from it
cli.py       the command line, and parse_config: the settings of a run
"""
from hvd_train.config.fields import (AMP_MODES, COMPILE_MODES, DEVICES, ERASE_MODES, LR_SCHEDULES, MAX_IMAGE_SIDE,
                                     MAX_WORKERS, OPTIMIZERS, PROFILE_RANKS, RECIPE_MAX_BYTES, opt)
from hvd_train.config.learning import AugConfig, DataConfig, ModelConfig, OptimConfig
from hvd_train.config.job import (BenchmarkConfig, CheckpointConfig, HorovodConfig, LoggingConfig, ProfileConfig,
                                  RunConfig)
from hvd_train.config.schema import ALIASES, CHOICES, Config, settings_rows
from hvd_train.config.recipe import load_recipe
from hvd_train.config.recorded import RECORDED, config_from_dict, recorded_values
from hvd_train.config.cli import build_parser, parse_config, parse_mapping
from hvd_train.errors import ConfigError

__all__ = ["AMP_MODES", "COMPILE_MODES", "DEVICES", "ERASE_MODES", "LR_SCHEDULES", "MAX_IMAGE_SIDE", "MAX_WORKERS",
           "OPTIMIZERS", "PROFILE_RANKS", "RECIPE_MAX_BYTES", "opt", "AugConfig", "DataConfig", "ModelConfig",
           "OptimConfig", "BenchmarkConfig", "CheckpointConfig", "HorovodConfig", "LoggingConfig", "ProfileConfig",
           "RunConfig", "ALIASES", "CHOICES", "Config", "settings_rows", "load_recipe", "RECORDED", "config_from_dict",
           "recorded_values", "build_parser", "parse_config", "parse_mapping", "ConfigError"]
