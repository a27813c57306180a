"""hvd-train: the application around Horovod's data-parallel recipe (train_hvd.py, also installed here as recipe).

app         the hvd-train commands, the checks before and after Horovod starts, the one error guard
training    the steps of a run that train_hvd.py calls, shared by fixed and elastic runs
build       the builders behind those steps: data sets, model, task, optimizer
checks      the checks of the settings that need a factory or the machine, before Horovod starts
engine      a step, an epoch, validation, and the one training loop (fit) that every mode drives through hooks
batches     a batch on its device, the mixed-precision context, the cut for gradient accumulation
schedule    the batch arithmetic (Batching) and the one learning-rate mechanism
config/     the one typed configuration (defaults < YAML recipe < command line), each field with its flags
run/        the output directory and everything written into it: checkpoints, the run's state, reports, trackers
guards/     the watchdog that names a frozen rank; Ctrl-C and SIGTERM
tools/      hvd-train doctor, shard, export, predict, and the inference they share
modes/      what differs from the recipe: elastic (its loop), evaluate and benchmark (they measure)
tasks, plugins, datasets, weights, regularize, profiling, trust, uris, api: the pieces those use
Horovod itself is used only through hvd_utils.
"""


def run(model=None, train_set=None, val_set=None, task=None, facts=None, argv=None):
    """The app around a user's own objects; see hvd_train/api.py. Returns the exit code."""
    from hvd_train.api import run as run_app

    return run_app(model=model, train_set=train_set, val_set=val_set, task=task, facts=facts, argv=argv)


def load_trained(source, trusted=False):
    """A trained model outside the job: (model on the CPU in eval mode, its ModelCard, the checkpoint), from a
    checkpoint file or a run directory's best.pt; see hvd_train/tools/inference.py."""
    from hvd_train.tools.inference import load_trained as load

    return load(source, trusted=trusted)
