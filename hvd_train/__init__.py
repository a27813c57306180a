"""hvd-train: the application around Horovod's data-parallel recipe (train_hvd.py).

app         the hvd-train commands, the checks before and after Horovod starts, the one error guard
training    the steps of a run that train_hvd.py calls, shared by fixed and elastic runs
build       the builders behind those steps: data sets, model, task, optimizer
checks      the checks of the settings that need a factory or the machine, before Horovod starts
engine      a step, an epoch, and the one training loop (fit) that every mode drives through hooks
validation  each rank's shard evaluated, exact global metrics from one allreduce
epoch_line  an epoch's record and its line in the log; timing: every rank's step time by phase
batches     a batch on its device, the mixed-precision context, the cut for gradient accumulation
schedule    the batch arithmetic (Batching) and the one learning-rate mechanism
config/     the one typed configuration (defaults < YAML recipe < command line), each field with its flags
run/        the output directory and everything written into it: checkpoints, the run's state, reports, trackers
guards/     the watchdog that names a frozen rank; stacks on SIGUSR2; Ctrl-C and SIGTERM; a diverging loss
tools/      hvd-train doctor, shard, export, predict, and the inference they share
modes/      what differs from the recipe: elastic (its loop), evaluate and benchmark (they measure)
files       every write of the app (atomic, private, never through a link), for data/ and run/ alike
tasks, plugins, datasets, weights, regularize, profiling, trust, uris, api: the pieces those use
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
from pathlib import Path as _Path

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


def train(model=None, train_set=None, val_set=None, task=None, facts=None, argv=None):
    """The app around a user's own objects; see hvd_train/api.py. Returns the exit code."""
    from hvd_train.api import train as train_app

    return train_app(model=model, train_set=train_set, val_set=val_set, task=task, facts=facts, argv=argv)


def load_trained(source, trusted=False):
    """A trained model outside the job: (model on the CPU in eval mode, its ModelCard, the checkpoint), from a
    checkpoint file or a run directory's best.pt; see hvd_train/tools/inference.py."""
    from hvd_train.tools.inference import load_trained as load

    return load(source, trusted=trusted)
