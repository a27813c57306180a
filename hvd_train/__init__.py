"""hvd-train: the application around Horovod's data-parallel recipe (train_hvd.py).

One room per concept; docs/architecture.md maps them, says what each may import (checked by `make lint`) and walks
a training step, a checkpoint and a setting through them:

app         the hvd-train commands, the checks before and after Horovod starts, the one error guard
api         hvd_train.train(): the app around a user's own model, data sets and task
training    a run assembled from its settings (data, model, task, optimizer, Trainer), opened, fitted, closed
trainer     the training loop: a step, an epoch, fit_epochs, evaluation, the schedule, the epoch's line
tasks       what a model is trained to do: losses, metrics, the best metric, exact averages over every sample
registry    how a model, a data set or a task is named and built, for those that ship and the user's own
config/     the one typed configuration: schema (sections, fields, flags), loading (defaults < recorded < YAML < CLI)
run/        the output directory and all that is written in it: directory, checkpoint, state, reports, tracking
guards/     the watchdog that names a frozen rank and dumps stacks; signals and time limits; a diverging loss
modes/      what differs from the recipe: elastic, evaluate, benchmark
tools/      hvd-train doctor, shard, export, predict, and the inference they share
provenance  what is code and what is data in files from elsewhere; files: every write; errors: what a user is told
timing, profiling, weights: where a step's time goes, --profile, fine-tuning from weights
Horovod itself is used only through hvd_utils.

data/, models/ and hostfiles/ are the package's hvd_train.data, hvd_train.models and hvd_train.hostfiles: the wheel
installs them inside it (setup.cfg's package_dir); in a checkout they sit beside it, at the top of the repository
(the layout users asked for), and the package's search path reaches them there. Either way they are found through
the package, never through the module search path, so a user's own data/ or models/ folder cannot shadow them.
The public names below are functions, never submodule names (tests/unit/test_api.py).
"""
import importlib.abc as _abc
import importlib.util as _util
import sys as _sys
import typing as _typing
from pathlib import Path as _Path

if _typing.TYPE_CHECKING:
    from typing import Any, Callable, Mapping, Optional, Sequence, Union

    from torch import nn
    from torch.utils.data import Dataset

    from hvd_train.run.model_card import ModelCard

BESIDE = ("data", "models", "hostfiles")


class _Beside(_abc.MetaPathFinder):
    """In a checkout, hvd_train.data is <checkout>/data (and so on), and nothing else of the checkout's top level."""

    def __init__(self, checkout):
        self.checkout = checkout

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package != __name__ or name not in BESIDE:
            return None
        folder = self.checkout / name
        return _util.spec_from_file_location(fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


_CHECKOUT = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "data").is_dir() and (_CHECKOUT / "data" / "__init__.py").is_file():
    _sys.meta_path.insert(0, _Beside(_CHECKOUT))


def train(model: "Union[nn.Module, Callable[..., nn.Module], None]" = None, train_set: "Optional[Dataset]" = None,
          val_set: "Optional[Dataset]" = None, task: object = None, facts: "Optional[Mapping[str, Any]]" = None,
          argv: "Optional[Sequence[str]]" = None) -> int:
    """The app around a user's own objects; see hvd_train/api.py. Returns the exit code."""
    from hvd_train.api import train as train_app

    return train_app(model=model, train_set=train_set, val_set=val_set, task=task, facts=facts, argv=argv)


def load_trained(source: str, trusted: bool = False) -> "tuple[nn.Module, ModelCard, dict[str, Any]]":
    """A trained model outside the job: (model on the CPU in eval mode, its ModelCard, the checkpoint), from a
    checkpoint file or a run directory's best.pt; see hvd_train/tools/inference.py."""
    from hvd_train.tools.inference import load_trained as load

    return load(source, trusted=trusted)
