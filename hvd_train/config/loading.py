"""The settings of a run, from defaults < the run's recorded settings < YAML recipe < command line, and the gate
every settings file passes.

The command line has one typed flag per field (--section.field, and the short flags of hvd_train/config/schema.py);
parse_config resolves the layers into a Config. A recipe (--config) is read as data: at most RECIPE_MAX_BYTES of
UTF-8 YAML, its aliases (which can expand without bound) and repeated keys refused before it becomes dicts. A run's
config.json (RECORDED) is what a resumed or evaluated run starts from, less where it is and what it does now
(NOT_RECORDED); a setting given again with another value is a note for the log.

`settings` is the gate for values a file holds (a recipe, a config.json, a checkpoint's stored config): known
sections and keys, each value of its field's type, mappings of names to plain values (hvd_train/provenance.py
plain); the settings that replace or move a run (run.output_dir, run.overwrite) come from the command line only.
"""
import argparse
import dataclasses
import os
import re
import reprlib
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, Sequence, cast

from hvd_train.config.schema import ALIASES, CHOICES, RECIPE_MAX_BYTES, Config, RunConfig, _fields
from hvd_train.errors import ConfigError
from hvd_train.provenance import TRUST_FLAG, RecordError, plain, refuse_code_from

if TYPE_CHECKING:
    import yaml
    from _typeshed import DataclassInstance


def _parse_bool(text: str) -> bool:
    lowered = str(text).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers such as 30,60,80, got {text!r}")


def parse_mapping(text: str) -> dict[str, Any]:
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


_PARSERS: dict[type, Callable[[str], Any]] = {bool: _parse_bool, tuple: _parse_int_tuple, int: int, float: float,
                                              str: str, dict: parse_mapping}


class _Parser(argparse.ArgumentParser):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # argparse takes `-inf` and `-1e-3` after a flag for flags, and then says "expected one argument"; as no flag
        # of ours looks like a number, every negative number is a value, which the field's own check then judges.
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$|^-(inf|infinity|nan)$",
                                                   re.IGNORECASE)

    def error(self, message: str) -> NoReturn:
        # One exception type for every bad setting, so the entry point reports it once, the same way.
        raise ConfigError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
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
    alias_of: dict[str, list[str]] = {}
    for flag, dest in ALIASES.items():  # a field may have several: --optimizer and timm's --opt
        alias_of.setdefault(dest, []).append(flag)
    groups = {}
    for section, _, f in _fields():
        if section not in groups:
            groups[section] = parser.add_argument_group(f"{section} settings")
        dest = f"{section}.{f.name}"
        flags = [f"--{dest}"]
        flags[:0] = [f"--{alias}" for alias in alias_of.get(dest, ())]
        extra: dict[str, Any] = {"nargs": "?", "const": True} if f.type is bool else {}  # `--download` alone means true
        metavar = "KEY=VALUE,..." if f.type is dict else cast(type, f.type).__name__.upper()
        if dest in CHOICES:
            extra["choices"] = CHOICES[dest]
            metavar = "{" + ",".join(CHOICES[dest]) + "}"
        default = ",".join(map(str, cast(tuple, f.default))) if f.type is tuple else {} if f.type is dict else f.default
        groups[section].add_argument(
            *flags, dest=dest, type=_PARSERS[cast(type, f.type)], default=argparse.SUPPRESS, metavar=metavar,
            help=f"{f.metadata['help']} (default: {default!r})".replace("%", "%%"), **extra)
    return parser


def parse_config(argv: Optional[Sequence[str]] = None) -> Config:
    """Defaults < the run's recorded settings (resuming or evaluating) < YAML recipe < command line; raises
    ConfigError (with the field named) on an invalid value."""
    args: Any = vars(build_parser().parse_args(argv))
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
    built = {s.name: cast(type, s.type)(**values.get(s.name, {})) for s in dataclasses.fields(Config)}
    cfg: Any = Config(**built)
    cfg.notes = notes  # lines for the log, not a setting: what this run changed from its recorded settings
    return cfg


def _read_text(path: str) -> str:
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


def _repeated_key(mapping: "yaml.MappingNode", prefix: str = "") -> Optional[tuple[str, int, int]]:
    """(dotted key, first line, second line) of a key written twice in this YAML mapping node, else None.

    Keys pulled in by a merge (`<<: *base`) are left out: YAML lets a mapping's own keys override those."""
    first: dict[tuple[str, str], int] = {}
    for key, _ in mapping.value:
        if key.id != "scalar" or key.tag == "tag:yaml.org,2002:merge":
            continue
        line = key.start_mark.line + 1
        if (key.tag, key.value) in first:
            return prefix + key.value, first[key.tag, key.value], line
        first[key.tag, key.value] = line
    return None


def _refuse_repeats(root: Optional["yaml.Node"], path: str) -> None:
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


def _refuse_aliases(root: Optional["yaml.Node"], path: str) -> None:
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


def _parse_yaml(text: str, path: str) -> Any:
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


def load_recipe(path: str, known_only: bool = False) -> dict[str, dict[str, Any]]:
    """Read a YAML recipe into {section: {field: value}} through the gate (settings, below): unknown
    sections, unknown keys, wrong types and the settings a file never chooses refused (known_only: a run's
    config.json, perhaps of another version: those left out instead)."""
    import yaml

    text = _read_text(path)
    try:
        raw = _parse_yaml(text, path)
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML: {e}")
    except RecursionError:  # PyYAML composes nested values recursively
        raise ConfigError(f"--config {path}: its values nest hundreds of levels deep; a recipe is sections of "
                          f"settings (configs/digits_cnn.yaml)") from None
    except ConfigError:  # a key or section written twice, an alias: already one line naming the file
        raise
    except ValueError as e:  # a value YAML cannot build: an integer past Python's 4300 digits
        why = "an integer of more than 4300 digits, far past any setting" if "digits" in str(e) else \
            str(e).splitlines()[0][:200]
        raise ConfigError(f"--config {path}: a value cannot be read ({why})") from None
    if raw is None or raw == {}:
        raise ConfigError(f"--config {path}: holds no settings; write sections as in configs/digits_cnn.yaml, "
                          f"or leave out --config")
    return settings(raw, f"--config {path}", recorded=known_only)


# What a resumed or evaluated run never takes from the recorded settings: where it is and what it does now.
NOT_RECORDED = {"run": ("output_dir", "evaluate", "overwrite"), "checkpoint": ("resume",)}
RECORDED = "config.json"  # the resolved settings a run writes into its output directory (hvd_train/run/directory.py)


def recorded_config(values: dict[str, dict[str, Any]]) -> Optional[str]:
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


def recorded_values(path: str) -> dict[str, dict[str, Any]]:
    """The settings recorded at `path`, less those a continuing run decides itself and any this version lacks."""
    recorded = load_recipe(path, known_only=True)
    for section, names in NOT_RECORDED.items():
        for name in names:
            recorded.get(section, {}).pop(name, None)
    return recorded


def changes_from(recorded: dict[str, dict[str, Any]], values: dict[str, dict[str, Any]], path: str) -> list[str]:
    """One line per setting given again with another value than the run recorded."""
    notes = []
    for section, fields in values.items():
        for name, value in fields.items():
            before = recorded.get(section, {}).get(name)
            if name in recorded.get(section, {}) and _same(before, value) is False:
                notes.append(f"{section}.{name}: {before!r} -> {value!r} (recorded in {path})")
    return notes


def _same(a: Any, b: Any) -> bool:
    return tuple(a) == tuple(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b


def config_from_dict(values: dict[str, Any]) -> Config:
    """Rebuild a Config from to_dict() output (as stored in checkpoints)."""
    return Config(**{s.name: cast(type, s.type)(**values.get(s.name, {})) for s in dataclasses.fields(Config)})


# Settings a file never chooses: where the run is written and whether an earlier run there is replaced.
COMMAND_LINE_ONLY = {"run": ("output_dir", "overwrite")}


def _shown(value: Any) -> str:
    """A value as a message may show it: bounded however large or shared it is (reprlib's limits)."""
    shown = reprlib.Repr()
    shown.maxstring = shown.maxother = 200
    return shown.repr(value)


def _field_value(where, f, value):
    """A value of field `f`: the field's type (ints for floats, lists for tuples), or ConfigError."""
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
        raise ConfigError(f"{where}: expected {kind}, got {type(value).__name__} {_shown(value)}")
    if f.type is dict:
        try:
            plain(value, where, depth=8, nodes=100_000, text=2**20)  # a recipe is at most 1 MB
        except RecordError as e:
            raise ConfigError(str(e)) from None
    if f.type is float:
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{where}: a whole number of {len(str(abs(value)))} digits is too large for a float")
    return value


def settings(raw: object, where: str, recorded: bool = False) -> dict[str, dict[str, Any]]:
    """{section: {field: value}} from the mapping `raw` a file holds (`where` names it in messages): unknown
    sections and keys refused, every value of its field's type. recorded: the file is a run's own record
    (config.json, a checkpoint's stored config, perhaps of another version): unknown sections and keys are left
    out, and so are the settings a file never chooses; a recipe that sets one of those is refused."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of sections, got {type(raw).__name__}")
    sections = {s.name: s.type for s in dataclasses.fields(Config)}
    values: dict[str, dict[str, Any]] = {}
    for section, fields in raw.items():
        if section not in sections:
            if recorded:
                continue
            raise ConfigError(f"{where}: unknown section {str(section)[:100]!r}; sections are: {', '.join(sections)}")
        if not isinstance(fields, dict):
            raise ConfigError(f"{where}: section {section!r} must be a mapping of field: value")
        known = {f.name: f for f in dataclasses.fields(cast("type[DataclassInstance]", sections[section]))}
        for key, value in fields.items():
            if key in COMMAND_LINE_ONLY.get(section, ()):
                # A run's own record (and its config.json used as a recipe) holds both: where it was written is
                # left out, and so is an overwrite that is off; one that is on is refused.
                if recorded or key == "output_dir" or value is False:
                    continue
                flag = "--output-dir" if key == "output_dir" else "--overwrite"
                raise ConfigError(f"{where}: {section}.{key} is set; a file does not choose where a run is written "
                                  f"or whether an earlier run there is replaced: give {flag} on the command line")
            if key not in known:
                if recorded:
                    continue
                raise ConfigError(f"{where}: unknown key {section}.{str(key)[:100]}; {section} has: "
                                  f"{', '.join(known)}")
            values.setdefault(section, {})[key] = _field_value(f"{where}: {section}.{key}", known[key], value)
    return values
