"""The command line: one flag per field (--section.field, and the short flags), typed; and the settings resolved
from defaults < the run's recorded settings < YAML recipe < command line."""
import argparse
import dataclasses
import os
import re

from hvd_train.errors import ConfigError
from hvd_train.trust import TRUST_FLAG, refuse_code_from
from hvd_train.config.schema import ALIASES, CHOICES, Config, _fields
from hvd_train.config.recipe import load_recipe
from hvd_train.config.recorded import changes_from, recorded_config, recorded_values


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
                             "without it a recipe is data and such values must be given as flags (docs/reliability.md: "
                             "What is code and what is data)")
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
    if values.get("benchmark", {}).get("enabled"):
        # Benchmark mode's own default directory: beside a training run's, not over it.
        values.setdefault("run", {}).setdefault("output_dir", "runs/benchmark")
    built = {s.name: s.type(**values.get(s.name, {})) for s in dataclasses.fields(Config)}
    cfg = Config(**built)
    cfg.notes = notes  # lines for the log, not a setting: what this run changed from its recorded settings
    return cfg
