"""The one gate for values read from files: what a file someone else may have written holds becomes a checked record
here, before any code of the app uses it.

Every reader of such a file hands what it parsed to this module: a recipe (--config) and a run's config.json
(`settings`), a checkpoint's plain values and an export's sidecar (`plain`), a shard index's facts (`index_facts`).
The rules that say which values run code or send things away are in hvd_train/trust.py, and `settings` applies them
to every field, nested arguments included; what is written is redacted by hvd_train/uris.py.

- `plain`: only plain types (mappings with string keys, lists, tuples, strings, bytes, numbers, None, tensors), at
  most MAX_DEPTH deep and at most MAX_NODES values and MAX_TEXT_BYTES of text, counted as a tree: a value reached
  twice counts twice. A pickle or a YAML document can refer to one list a million times in a few bytes; counting
  every reference bounds what later code builds from it (a JSON summary, a dataclass copy, a message).
- `settings`: known sections and keys, each value of its field's type, mappings of names to plain values; the
  settings that replace or move a run (run.output_dir, run.overwrite) come from the command line only.
- `index_facts`: the facts of a shard index, each known one of its type and within its bound, and the data set's
  own facts (`extra`) plain values under names that neither stand for the known facts nor make a model read files.
"""
import dataclasses
import reprlib

from hvd_train.errors import ConfigError

MAX_DEPTH = 32
MAX_NODES = 2_000_000  # a checkpoint of 1024 ranks' RNG states and 1,000 epochs of history is about 700,000
MAX_TEXT_BYTES = 64 * 2**20
# Settings a file never chooses: where the run is written and whether an earlier run there is replaced.
COMMAND_LINE_ONLY = {"run": ("output_dir", "overwrite")}


class RecordError(ValueError):
    """A structure read from a file is not plain data within the bounds; the message says where and why."""


def _is_tensor(value):
    import torch

    return torch.is_tensor(value) or isinstance(value, torch.Size)


def _check_stored(tensor, where):
    """A tensor may not claim more elements than its storage holds: strides of 0 (torch.expand) make a file of a
    kilobyte a tensor of 10**11 elements, which the first copy (a dtype change, a stack) would allocate."""
    import torch

    if isinstance(tensor, torch.Size) or tensor.layout != torch.strided:
        return
    try:
        stored = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor without storage of its own kind: nothing to expand
        return
    if tensor.numel() * tensor.element_size() > stored:
        raise RecordError(f"{where}: holds a tensor of shape {tuple(tensor.shape)} stored in {stored:,} bytes (its "
                          f"strides repeat them), which would take {tensor.numel() * tensor.element_size():,} bytes "
                          f"once copied; torch.save of a model's tensors writes none like it")


def plain(value, where, depth=MAX_DEPTH, nodes=MAX_NODES, text=MAX_TEXT_BYTES):
    """`value` itself when it is plain data within the bounds (module docstring); else RecordError naming `where`.
    Walked without recursion, and stopped at the first bound passed, so a bomb costs no more than the bound."""
    stack, count, size = [(value, 1)], 0, 0
    while stack:
        item, level = stack.pop()
        count += 1
        if count > nodes:
            raise RecordError(f"{where}: holds more than {nodes:,} values (counting each reference to a shared "
                              f"one), more than any file hvd-train writes")
        if level > depth:
            raise RecordError(f"{where}: its values nest more than {depth} levels deep; hvd-train writes none "
                              f"that deep")
        if isinstance(item, (str, bytes, bytearray)):
            size += len(item)
            if size > text:
                raise RecordError(f"{where}: holds more than {text // 2**20} MiB of text (counting each reference "
                                  f"to a shared string), more than any file hvd-train writes")
        elif isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, (str, int)):
                    raise RecordError(f"{where}: a key of type {type(key).__name__}; only names and numbers are "
                                      f"keys in files hvd-train writes")
                stack.append((key, level + 1))
                stack.append((child, level + 1))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, level + 1) for child in item)
        elif _is_tensor(item):
            _check_stored(item, where)
        elif item is None or isinstance(item, (bool, int, float, complex)):
            continue
        else:
            raise RecordError(f"{where}: holds a {type(item).__name__}, which is not plain data")
    return value


def _shown(value):
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


def settings(raw, where, recorded=False):
    """{section: {field: value}} from the mapping `raw` a file holds (`where` names it in messages): unknown
    sections and keys refused, every value of its field's type. recorded: the file is a run's own record
    (config.json, a checkpoint's stored config, perhaps of another version): unknown sections and keys are left
    out, and so are the settings a file never chooses; a recipe that sets one of those is refused."""
    from hvd_train.config.schema import Config

    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of sections, got {type(raw).__name__}")
    sections = {s.name: s.type for s in dataclasses.fields(Config)}
    values = {}
    for section, fields in raw.items():
        if section not in sections:
            if recorded:
                continue
            raise ConfigError(f"{where}: unknown section {str(section)[:100]!r}; sections are: {', '.join(sections)}")
        if not isinstance(fields, dict):
            raise ConfigError(f"{where}: section {section!r} must be a mapping of field: value")
        known = {f.name: f for f in dataclasses.fields(sections[section])}
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


# A shard index's facts: the known ones by type and bound (they size the model and every decoded image).
FACT_KINDS = {"num_classes": (int, 10**6), "in_channels": (int, 64), "image_size": (int, 8192), "max_side": (int, 8192),
              "source": (str, 200), "transform": (str, 20), "mean": (list, 64), "std": (list, 64),
              "classes": (list, 10**6), "structure": ((dict, list, str), None), "extra": (dict, 1000)}
TRANSFORMS = ("arrays", "photos", "samples")
# Names the data set's own facts may not take: the known facts (which they would override), what a factory's
# reader of files takes (hvd_train/trust.py FILE_ARGUMENTS), and what the app itself reads from facts.
RESERVED_EXTRA = ("num_classes", "in_channels", "image_size", "classes", "preprocessing", "held_out")


def index_facts(facts, where):
    """The facts of a shard index as a checked record (module docstring); DataError-free: raises RecordError."""
    from hvd_train.trust import FILE_ARGUMENTS

    if not isinstance(facts, dict):
        raise RecordError(f"{where}: facts is a {type(facts).__name__}, not a mapping")
    plain(facts, f"{where}: facts", depth=16)
    for name, value in facts.items():
        if name not in FACT_KINDS:
            continue  # a later writer's fact this version does not read
        kind, most = FACT_KINDS[name]
        if value is None:
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise RecordError(f"{where}: facts.{name} is a {type(value).__name__}; rewrite the index with "
                              f"`hvd-train shard`")
        if kind is int and not 1 <= value <= most:
            raise RecordError(f"{where}: facts.{name} {value!r} is not a whole number from 1 to {most}; rewrite the "
                              f"index with `hvd-train shard`")
        if kind in (list, dict, str) and most is not None and len(value) > most:
            raise RecordError(f"{where}: facts.{name} holds {len(value):,} items, more than {most:,}")
    if facts.get("transform") is not None and facts["transform"] not in TRANSFORMS:
        raise RecordError(f"{where}: facts.transform {facts['transform']!r} is none of {', '.join(TRANSFORMS)}")
    for name in ("mean", "std"):
        if facts.get(name) is not None and not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   for v in facts[name]):
            raise RecordError(f"{where}: facts.{name} must be numbers, one per channel")
    for key, value in (facts.get("extra") or {}).items():
        if not isinstance(key, str) or not key.isidentifier() or key in RESERVED_EXTRA or key in FILE_ARGUMENTS:
            why = "stands for a fact the index states itself" if key in RESERVED_EXTRA else \
                "makes a model read or fetch a file" if key in FILE_ARGUMENTS else "is not a name"
            raise RecordError(f"{where}: facts.extra.{str(key)[:100]} {why}; a shard index is data and does not "
                              f"choose that; rewrite the index with `hvd-train shard`")
        scalars = value if isinstance(value, list) else [value]
        if len(scalars) > 10_000 or not all(v is None or isinstance(v, (bool, int, float, str)) for v in scalars):
            raise RecordError(f"{where}: facts.extra.{key} is not a number, a word or a short list of them")
    return facts
