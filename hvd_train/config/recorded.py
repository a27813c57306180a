"""The settings a run recorded (config.json), and what a resumed or evaluated run takes from them."""
import dataclasses
import os

from hvd_train.config.job import RunConfig
from hvd_train.config.schema import Config
from hvd_train.config.recipe import load_recipe


# What a resumed or evaluated run never takes from the recorded settings: where it is and what it does now.
NOT_RECORDED = {"run": ("output_dir", "evaluate", "overwrite"), "checkpoint": ("resume",)}
RECORDED = "config.json"  # the resolved settings a run writes into its output directory (hvd_train/run/directory.py)


def recorded_config(values):
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


def recorded_values(path):
    """The settings recorded at `path`, less those a continuing run decides itself and any this version lacks."""
    recorded = load_recipe(path, known_only=True)
    for section, names in NOT_RECORDED.items():
        for name in names:
            recorded.get(section, {}).pop(name, None)
    return recorded


def changes_from(recorded, values, path):
    """One line per setting given again with another value than the run recorded."""
    notes = []
    for section, fields in values.items():
        for name, value in fields.items():
            before = recorded.get(section, {}).get(name)
            if name in recorded.get(section, {}) and _same(before, value) is False:
                notes.append(f"{section}.{name}: {before!r} -> {value!r} (recorded in {path})")
    return notes


def _same(a, b):
    return tuple(a) == tuple(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b


def config_from_dict(values):
    """Rebuild a Config from to_dict() output (as stored in checkpoints)."""
    return Config(**{s.name: s.type(**values.get(s.name, {})) for s in dataclasses.fields(Config)})
