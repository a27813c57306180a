"""Which settings run code or send things away, and when the app lets a file choose them.

Four kinds of value make the app run code that is not its own, or send data and credentials where they say:
- an import path, `package.module:name`, for the model, the task or the data set: the module is imported and the
  name called;
- a shard or index location that is a `pipe:` command (webdataset runs it with the shell), or a URL that reaches
  the network (http, https, gs, hf, ...: the run fetches from where it says, some with the user's own tokens);
- the MLflow tracking URI: the run's metrics and parameters go there, and MLflow's client sends the user's
  credentials (MLFLOW_TRACKING_TOKEN, or the user name and password) with them;
- the arguments of a model that ships, where they name a file to read or a download (timm's `checkpoint_path`,
  `pretrained`, torchvision's `weights`), whether a recipe gives them as model arguments or a card as facts.

On the command line those are the user's own choice. Read from a file (a --config recipe, a run's config.json, a
checkpoint's stored config or model card, an export's sidecar .json) they are refused unless the user passes
--trust-code on the command line, or gives the same setting as a flag: the file may come from someone else, and
reading a file must not be enough to run what it names or to send anything away. A location is judged as the
reader will use it: after webdataset's expansion ('::' lists, WDS_ variables, braces), every name it expands to,
without regard to case. Names that ship (`resnet18`, `cifar10`, `classification`) and plain values are data.
"""
from urllib.parse import urlsplit

from hvd_train.data.errors import DataError
from hvd_train.data.shard_index import expand
from hvd_train.errors import ConfigError
from hvd_train.plugins import is_import_path
from hvd_train.uris import redact, redact_all

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
DEFAULT_DATASET = "digits"  # data.dataset where neither a file nor the command line names one (config/learning.py)


def reaches(location):
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


def judged(values, dataset=None):
    """[(setting, value as it may be shown, why it needs trust)] for every value in {section: {field: value}} that
    runs code, sends things away or makes a factory read files. dataset: the data set the run uses where `values`
    do not name it (the command line's, else the default)."""
    found = []
    for section, name in IMPORT_PATHS:
        value = values.get(section, {}).get(name)
        if isinstance(value, str) and is_import_path(value):  # what plugins.resolve imports
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


def strings_in(value, path=""):
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


def refuse_code_from(values, where, trusted, given=None):
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
