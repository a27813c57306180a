"""What every setting is made of: opt(default, help, flags, choices), the checks every section runs, the named
choices and bounds."""
import dataclasses
import math
import re
from dataclasses import field

from hvd_train.errors import ConfigError


LR_SCHEDULES = ("constant", "cosine", "step", "multistep", "exponential")  # multistep: timm's name for step
OPTIMIZERS = ("sgd", "adam", "adamw")  # torch's own; any other name is one of timm's (build.py checks it)
# --shard-optimizer steps a flat slice of the weights: optimizers whose update is element-wise (torch's and timm's
# names). LAMB, LARS and Adafactor look at whole tensors (trust ratios, factored moments).
SHARDABLE = ("sgd", "momentum", "nesterov", "adam", "adamw", "nadam", "nadamw", "radam", "adamax", "lion",
             "rmsprop", "rmsproptf", "adagrad")
ERASE_MODES = ("const", "rand", "pixel")
AMP_MODES = ("off", "bf16", "fp16")
DECODES = ("auto", "cpu", "gpu")  # where photos are decoded (data/photos.py)
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


def check_policy_figures(spec):
    """Refuse an --aa policy whose figures pass POLICY_BOUNDS (ConfigError); what timm cannot build is refused when
    the policy is built (data/augment.py check_policy)."""
    if len(spec) > POLICY_MAX_CHARS:
        raise ConfigError(f"aug.aa (--aa)={spec[:60]!r}...: {len(spec)} characters; a policy such as "
                          f"rand-m9-mstd0.5-inc1 takes a few")
    for part in spec.split("-")[1:]:
        key, figure = re.match(r"([a-z]*)(.*)", part).groups()
        try:
            value = float(figure) if figure else None
        except ValueError:
            continue  # timm's own parser judges what is not a figure
        if key in POLICY_BOUNDS and value is not None and not abs(value) <= POLICY_BOUNDS[key]:
            raise ConfigError(f"aug.aa (--aa)={spec!r}: {key}{figure} is past {POLICY_BOUNDS[key]}, the most this "
                              f"policy's {key} may be (timm's own policies: rand-m9-n2-mstd0.5, augmix-m5-w3)")


def _require(ok, name, value, why):
    if not ok:
        raise ConfigError(f"{name}={value!r}: {why}")


def _choice(name, value, choices):
    _require(value in choices, name, value, f"must be one of: {', '.join(choices)}")


def opt(default, help, flags=(), choices=None):
    """A field with its default and its meaning (the --help text and the documentation of the field); flags: its
    short command-line spellings (`lr` for --lr; every field also has --section.field); choices: the values it takes.
    """
    metadata = {"help": help, "flags": tuple(flags), "choices": choices}
    if isinstance(default, dict):  # keyword arguments for a plug-in: a fresh (empty) mapping per config
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


def _label(section, name):
    """How messages name a field: `optim.lr (--lr)`, with the short flag where there is one."""
    from hvd_train.config.schema import ALIASES  # the whole schema imports this module

    alias = next((flag for flag, dest in ALIASES.items() if dest == f"{section}.{name}"), None)
    return f"{section}.{name}" + (f" (--{alias})" if alias else "")


class _Section:
    """The check every section runs first: each float setting is a finite number.

    No setting uses inf for "unlimited" (those that can be switched off say so with 0 or -1), and nan passes no range
    check while inf passes many (lr > 0, clip_grad >= 0, ...). Checked here, for every float field at once, both get
    one message, whatever field they are given to and whether they come from the command line or a recipe.
    """

    def __post_init__(self):
        from hvd_train.config.schema import Config  # the whole schema imports this module

        section = next(s.name for s in dataclasses.fields(Config) if s.type is type(self))
        for f in (f for f in dataclasses.fields(self) if f.type is float):
            value = getattr(self, f.name)
            _require(math.isfinite(value), _label(section, f.name), value,
                     f"must be a finite number, e.g. the default {f.default!r} ({f.metadata['help']})")
