"""What is code and what is data in files from elsewhere: checked records, and the settings a file may not choose.

A file someone else may have written (a --config recipe, a run's config.json, a checkpoint, its stored config or
model card, an export's sidecar .json, a shard index) is data. What a reader parsed from one passes through here
before any code of the app uses it: `plain` for a checkpoint's or a sidecar's values, `index_facts` for a shard
index's facts; a recipe's or config.json's settings are typed by hvd_train/config/loading.py (`settings`), and every
field of them, nested arguments included, is judged by `refuse_code_from`. What the app writes is redacted by
hvd_train/errors.py; docs/reliability.md (What is code and what is data) says all this to the user.

- `plain`: only plain types (mappings with string keys, lists, tuples, strings, bytes, numbers, None, tensors), at
  most MAX_DEPTH deep, MAX_NODES values and MAX_TEXT_BYTES of text, counted as a tree: a value reached twice counts
  twice. A pickle or a YAML document can refer to one list a million times in a few bytes; counting every reference
  bounds what later code builds from it (a JSON summary, a dataclass copy, a message).
- `index_facts`: each known fact of its type and within its bound, and the data set's own facts (`extra`) plain
  values under names that neither stand for the known facts nor make a model read files.

Four kinds of value make the app run code that is not its own, or send data and credentials where they say: an
import path, `package.module:name`, for the model, the task or the data set (the module is imported and the name
called); a shard or index location that is a `pipe:` command (webdataset runs it with the shell) or a URL that
reaches the network (http, https, gs, hf, ...: some fetch with the user's own tokens); the MLflow tracking URI (the
run's metrics go there, with the user's MLflow credentials); and the arguments of a model that ships which name a
file to read or a download (FILE_ARGUMENTS: timm's `checkpoint_path`, `pretrained`, torchvision's `weights`), as
model arguments or a card's facts. On the command line those are the user's own choice. Read from a file they are
refused unless the user passes --trust-code, or gives the same setting as a flag: reading a file must not be enough
to run what it names or to send anything away. A location is judged as the reader will use it: after webdataset's
expansion (`expand`: '::' lists, WDS_ variables, braces, at most MAX_SHARDS names), every name it expands to,
without regard to case. Names that ship (`resnet18`, `cifar10`, `classification`) and plain values are data.
"""
import os
import re
import string
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union
from urllib.parse import urlsplit

from hvd_train.errors import ConfigError, DataError, redact, redact_all

if TYPE_CHECKING:
    import torch

MAX_DEPTH = 32
MAX_NODES = 2_000_000  # a checkpoint of 1024 ranks' RNG states and 1,000 epochs of history is about 700,000
MAX_TEXT_BYTES = 64 * 2**20


class RecordError(ValueError):
    """A structure read from a file is not plain data within the bounds; the message says where and why."""


def _is_tensor(value: object) -> bool:
    import torch

    return torch.is_tensor(value) or isinstance(value, torch.Size)


def _check_stored(tensor: Union["torch.Tensor", "torch.Size"], where: str) -> None:
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


def plain(value: Any, where: str, depth: int = MAX_DEPTH, nodes: int = MAX_NODES, text: int = MAX_TEXT_BYTES) -> Any:
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


# A shard index's facts: the known ones by type and bound (they size the model and every decoded image).
FACT_KINDS: dict[str, tuple[Any, Optional[int]]] = {
    "num_classes": (int, 10**6), "in_channels": (int, 64), "image_size": (int, 8192), "max_side": (int, 8192),
    "source": (str, 200), "transform": (str, 20), "mean": (list, 64), "std": (list, 64),
    "classes": (list, 10**6), "structure": ((dict, list, str), None), "extra": (dict, 1000)}
TRANSFORMS = ("arrays", "photos", "samples")
# Names the data set's own facts may not take: the known facts (which they would override), what a factory's
# reader of files takes (hvd_train/provenance.py FILE_ARGUMENTS), and what the app itself reads from facts.
RESERVED_EXTRA = ("num_classes", "in_channels", "image_size", "classes", "preprocessing", "held_out")


def index_facts(facts: object, where: str) -> dict[str, Any]:
    """The facts of a shard index as a checked record (module docstring); DataError-free: raises RecordError."""

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


TRUST_FLAG = "--trust-code"
# Settings that name code, by their place in the config: (section, field).
IMPORT_PATHS = (("model", "name"), ("model", "task"), ("data", "dataset"))
SHARD_LOCATIONS = (("data", "train_shards"), ("data", "val_shards"), ("data", "shard_index"))
# Settings that choose where the run sends its data and the user's credentials.
DESTINATIONS = (("logging", "mlflow_uri"),)
# Arguments of the factories that ship which make them read a file or fetch one (timm, torchvision).
FILE_ARGUMENTS = ("checkpoint_path", "pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "weights",
                  "cache_dir", "pretrained_strict")
# Mappings of arguments whose values reach factories as they are: a location among them is judged as a shard's is.
NESTED = (("model", "args"), ("model", "facts"), ("model", "task_args"), ("data", "args"))
LOCAL_SCHEMES = ("", "file")  # what webdataset opens as a local file; every other scheme has a handler that fetches
DEFAULT_DATASET = "digits"  # data.dataset where neither a file nor the command line names one (config/schema.py)


def reaches(location: object) -> Optional[str]:
    """What a shard or index location reaches once expanded as the reader expands it: "a command" when any name
    holds `pipe:` (in any case, anywhere: braces can bring it to the front), "the network" when any has a scheme
    that fetches, else None. Raises DataError for a pattern that cannot be expanded within the bounds."""
    if not isinstance(location, str) or not location:
        return None
    try:
        names = expand(location)
    except RecursionError:  # braceexpand recurses once per nested brace
        raise DataError("its braces nest too deeply to expand") from None
    if any("pipe:" in name.lower() for name in names):
        return "a command"
    if any(urlsplit(name.strip()).scheme.lower() not in LOCAL_SCHEMES for name in names):
        return "the network"
    return None


def judged(values: Mapping[str, Mapping[str, Any]], dataset: Optional[str] = None) -> list[tuple[str, Any, str]]:
    """[(setting, value as it may be shown, why it needs trust)] for every value in {section: {field: value}} that
    runs code, sends things away or makes a factory read files. dataset: the data set the run uses where `values`
    do not name it (the command line's, else the default)."""
    found = []
    for section, name in IMPORT_PATHS:
        value: Any = values.get(section, {}).get(name)
        if isinstance(value, str) and is_import_path(value):  # what registry.resolve imports
            found.append((f"{section}.{name}", value, "an import path: its module is imported and run"))
    for section, name in SHARD_LOCATIONS:
        value = values.get(section, {}).get(name)
        try:
            where = reaches(value)
        except DataError as e:
            raise ConfigError(f"{section}.{name}={str(value)[:200]!r}: {e}") from None
        if where == "a command":
            found.append((f"{section}.{name}", redact_all(value), "a pipe: command, run by the shell"))
        elif where == "the network":
            found.append((f"{section}.{name}", redact_all(value), "a location on the network: the run would fetch "
                          "data from where the file says"))
    for section, name in DESTINATIONS:
        value = values.get(section, {}).get(name)
        if value:
            found.append((f"{section}.{name}", redact(value), "where the run's metrics and your MLflow credentials "
                          "would be sent"))
    model = values.get("model", {})
    for part in ("args", "facts"):  # a card's facts reach a factory that takes **kwargs as its arguments do
        given = model.get(part) or {}
        for key in FILE_ARGUMENTS:
            if isinstance(given, dict) and key in given:
                found.append((f"model.{part}.{key}", given[key], "an argument that makes the model read or fetch a "
                              "file"))
    dataset = values.get("data", {}).get("dataset") or dataset or DEFAULT_DATASET
    if values.get("data", {}).get("args") and isinstance(dataset, str) and not is_import_path(dataset):
        # A factory that ships takes its settings from the data.* fields; arguments would replace them (the shards'
        # locations among them) past the checks above.
        found.append(("data.args", values["data"]["args"], f"arguments for {dataset}, a data set that ships, which "
                      f"would replace its own settings"))
    for section, name in NESTED:
        for key, value in strings_in(values.get(section, {}).get(name)):
            if not any(mark in value.lower() for mark in ("://", "ipe:", "{")):
                continue  # a number, a word: what urlsplit would take for a scheme ("gelu:x") is no location
            try:
                where = reaches(value)
            except DataError:
                where = "a command"  # braces past the bounds: refused as what they could hide
            if where:
                found.append((f"{section}.{name}.{key}", redact_all(value), f"{where} given as an argument"))
    return found


def strings_in(value: object, path: str = "") -> list[tuple[str, str]]:
    """(dotted key, string) of every string in a mapping of arguments, nested mappings and lists included (the gate
    has bounded their size), without recursion."""
    stack, found = [(path, value)], []
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            found.append((where, item))
        elif isinstance(item, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in item.items())
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(item))
    return sorted(found)


def refuse_code_from(values: Mapping[str, Mapping[str, Any]], where: str, trusted: bool,
                     given: Optional[Mapping[str, Any]] = None) -> None:
    """Refuse, in one ConfigError, the first value in `values` (read from `where`, a file) that runs code or sends
    things away, unless `trusted` (--trust-code) or the command line gave the same setting (`given`:
    {"section.field": value})."""
    if trusted:
        return
    given = given or {}
    for setting, value, why in judged(values, given.get("data.dataset")):
        if setting in given or setting.rsplit(".", 1)[0] in given:
            continue
        raise ConfigError(f"{where}: {setting}={value!r} is {why}; a file is data and does not choose that for "
                          f"you. If you trust this file, pass {TRUST_FLAG} (docs/reliability.md: What is code and "
                          f"what is data), or give the setting on the command line yourself")


def is_import_path(name: str) -> bool:
    """A plug-in's `package.module:name` (code to import), as opposed to a name that ships."""
    return ":" in name


MAX_SHARDS = 10**6  # names a shard pattern may expand to (an index of a million shards is near its size bound)


def expand(pattern: str) -> list[str]:
    """'a-{000..009}.tar' or several patterns joined by '::' -> the list of shard URLs: webdataset's expansion (WDS_
    variables, then braces), refused past MAX_SHARDS names. A pattern comes from the command line or a file: a few
    braces can name billions of shards, and braceexpand lists every range in memory before it yields a name, so
    the names are counted first (names_in), without listing any."""
    import braceexpand
    from webdataset.shardlists import envsubst

    parts = []
    for part in pattern.split("::"):
        for _ in range(10):  # as webdataset: a variable's value may name another
            try:
                substituted = envsubst(part)
            except AssertionError:  # webdataset's word for a ${NAME} whose WDS_NAME is not set
                unset = next(n for n in re.findall(r"\$\{(\w+)\}", part) if f"WDS_{n}" not in os.environ)
                raise DataError(f"${{{unset}}} stands for the environment variable WDS_{unset}, which is not set; "
                                f"set it, or write the pattern out") from None
            if substituted == part:
                break
            part = substituted
        parts.append(part)
    if sum(names_in(part) for part in parts) > MAX_SHARDS:
        raise DataError(f"it expands to more than {MAX_SHARDS:,} shard names; name fewer shards")
    return [name for part in parts for name in braceexpand.braceexpand(part)]


def names_in(pattern: str) -> int:
    """How many names braceexpand makes of `pattern`, counted by its own grammar (escapes, nested groups, comma
    lists, number and letter ranges with steps); at most MAX_SHARDS + 1. Raises DataError where braceexpand would
    refuse the braces."""
    count, start, depth, pos = 1, 0, 0, 0
    while pos < len(pattern):
        if pattern[pos] == "\\":
            pos += 2
            continue
        if pattern[pos] == "{":
            if depth == 0:
                start = pos
            depth += 1
        elif pattern[pos] == "}":
            depth -= 1
            if depth == 0:
                count = min(count * _names_in_group(pattern[start + 1:pos]), MAX_SHARDS + 1)
        pos += 1
    if depth != 0:
        raise DataError(f"its braces do not balance: {pattern[:200]!r}")
    return count


def _names_in_group(expr: str) -> int:
    numbers = re.match(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$", expr)
    if numbers:
        first, last, step = int(numbers.group(1)), int(numbers.group(2)), int(numbers.group(3) or 1) or 1
        return len(range(first, last + 1, step) if first < last else range(first, last - 1, -step))
    letters = re.match(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$", expr)
    if letters:  # braceexpand's alphabet: the capitals first
        alphabet = string.ascii_uppercase + string.ascii_lowercase
        first, last, step = alphabet.index(letters.group(1)), alphabet.index(letters.group(2)), \
            int(letters.group(3) or 1) or 1
        return len(alphabet[first:last + 1:step] if first < last else alphabet[first:(last or -52) - 1:-step])
    items, start, depth, pos = [], 0, 0, 0
    while pos < len(expr):  # a comma list at the top of the group: the items' names, one after another
        if expr[pos] == "\\":
            pos += 2
            continue
        depth += {"{": 1, "}": -1}.get(expr[pos], 0)
        if expr[pos] == "," and depth == 0:
            items.append(expr[start:pos])
            start = pos + 1
        pos += 1
    if depth != 0 or not items:  # no list: the braces are kept as text around the group's own expansion
        return names_in(expr)
    return sum(names_in(item) for item in items + [expr[start:]])
