"""Which settings run code, and when the app lets a file choose them.

Three kinds of value make the app run code that is not its own:
- an import path, `package.module:name`, for the model, the task or the data set: the module is imported and the
  name called;
- a `pipe:` shard location: webdataset runs it as a shell command;
- the arguments of a model that ships, where they name a file to read or a download (timm's `checkpoint_path`,
  `pretrained`, torchvision's `weights`).

On the command line those are the user's own choice. Read from a file (a --config recipe, a checkpoint's stored
config or model card, an export's sidecar .json) they are refused unless the user passes --trust-code on the command
line, or gives the same value as a flag: the file may come from someone else, and reading a file must not be
enough to run what it names. Names that ship (`resnet18`, `cifar10`, `classification`) and plain values are data.
"""
from hvd_train.errors import ConfigError
from hvd_train.plugins import is_import_path

TRUST_FLAG = "--trust-code"
# Settings that name code, by their place in the config: (section, field).
IMPORT_PATHS = (("model", "name"), ("model", "task"), ("data", "dataset"))
SHARD_LOCATIONS = (("data", "train_shards"), ("data", "val_shards"), ("data", "shard_index"))
# Arguments of the factories that ship which make them read a file or fetch one (timm, torchvision).
FILE_ARGUMENTS = ("checkpoint_path", "pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "weights",
                  "cache_dir", "pretrained_strict")


def runs_a_command(location):
    """Whether a shard location (patterns joined by '::') holds a pipe: command."""
    return isinstance(location, str) and any(p.strip().startswith("pipe:") for p in location.split("::"))


def code_in(values):
    """[(setting, value, what it runs)] for every value in {section: {field: value}} that runs code."""
    found = []
    for section, name in IMPORT_PATHS:
        value = values.get(section, {}).get(name)
        if isinstance(value, str) and is_import_path(value):  # what plugins.resolve imports
            found.append((f"{section}.{name}", value, "an import path: its module is imported and run"))
    for section, name in SHARD_LOCATIONS:
        value = values.get(section, {}).get(name)
        if runs_a_command(value):
            found.append((f"{section}.{name}", value, "a pipe: command, run by the shell"))
    args = values.get("model", {}).get("args") or {}
    for key in FILE_ARGUMENTS:
        if isinstance(args, dict) and key in args:
            found.append((f"model.args.{key}", args[key], "an argument that makes the model read or fetch a file"))
    return found


def refuse_code_from(values, where, trusted, given=None):
    """Refuse, in one ConfigError, the first value in `values` (read from `where`, a file) that runs code, unless
    `trusted` (--trust-code) or the command line gave the same setting (`given`: {"section.field": value})."""
    if trusted:
        return
    given = given or {}
    for setting, value, what in code_in(values):
        if setting in given or setting.rsplit(".", 1)[0] in given:
            continue
        raise ConfigError(f"{where}: {setting}={value!r} is {what}; a file is data and does not choose code for "
                          f"you. If you trust this file, pass {TRUST_FLAG} (docs/reliability.md: What is code and "
                          f"what is data), or give the setting on the command line yourself")
