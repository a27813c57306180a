"""The one typed configuration of a training run.

Each section is a dataclass; every field is opt(default, help, flags, choices): its help (meaning, unit) is its --help
text and its line in docs/settings.md, its flags the short spellings beside it; each section checks its own values in
__post_init__, so a bad value stops the run before any rank starts training. Values come from the defaults, then an
optional YAML recipe (`--config configs/digits_cnn.yaml`, sections as keys), then the command line:
`--section.field VALUE` sets any field, and the flags people look for first (`--epochs`, `--batch-size`, `--amp`, ...)
are short ones. A resumed or evaluated run starts from the settings it recorded (config.json), below the recipe and
the command line.

schema.py    the sections (data, model, optim, aug: what is learned and how; horovod, checkpoint, logging, run,
             benchmark, profile: how the job runs), opt(), the named choices and bounds, and Config with the checks
             across sections; every field with its flags (ALIASES, CHOICES)
loading.py   the command line and parse_config (the settings of a run), YAML recipes read as data, config.json and
             what a resumed or evaluated run takes from it, and `settings`, the gate every settings file passes
"""
from hvd_train.config.loading import (
                                     RECORDED,
                                     build_parser,
                                     config_from_dict,
                                     load_recipe,
                                     parse_config,
                                     parse_mapping,
                                     recorded_values,
)
from hvd_train.config.schema import (
                                     ALIASES,
                                     AMP_MODES,
                                     CHOICES,
                                     COMPILE_MODES,
                                     DEVICES,
                                     ERASE_MODES,
                                     LR_SCHEDULES,
                                     MAX_IMAGE_SIDE,
                                     MAX_WORKERS,
                                     OPTIMIZERS,
                                     PROFILE_RANKS,
                                     RECIPE_MAX_BYTES,
                                     AugConfig,
                                     BenchmarkConfig,
                                     CheckpointConfig,
                                     Config,
                                     DataConfig,
                                     HorovodConfig,
                                     LoggingConfig,
                                     ModelConfig,
                                     OptimConfig,
                                     ProfileConfig,
                                     RunConfig,
                                     opt,
                                     settings_rows,
)
from hvd_train.errors import ConfigError

__all__ = ["AMP_MODES", "COMPILE_MODES", "DEVICES", "ERASE_MODES", "LR_SCHEDULES", "MAX_IMAGE_SIDE", "MAX_WORKERS",
           "OPTIMIZERS", "PROFILE_RANKS", "RECIPE_MAX_BYTES", "opt", "AugConfig", "DataConfig", "ModelConfig",
           "OptimConfig", "BenchmarkConfig", "CheckpointConfig", "HorovodConfig", "LoggingConfig", "ProfileConfig",
           "RunConfig", "ALIASES", "CHOICES", "Config", "settings_rows", "load_recipe", "RECORDED", "config_from_dict",
           "recorded_values", "build_parser", "parse_config", "parse_mapping", "ConfigError"]
