"""hvd-train: the application around Horovod's data-parallel recipe (train_hvd.py is the entry point).

config      the one typed configuration (defaults < YAML recipe < command line)
build       the parts a mode needs: checks, data, model, optimizer, learning-rate schedule, the Trainer
engine      a step, an epoch, validation, and the one training loop (fit) that every mode drives through hooks
schedule    the one learning-rate mechanism: the rate as a function of progress in (fractional) epochs
run_state   what a run has done so far (epochs, steps, history, best metric) and what follows each epoch
run_dir     every file a run writes, claiming the directory, and the one atomic writer
checkpoint  one save and one load
reporting   metrics.jsonl, TensorBoard, the curves, the setup lines and summary.json
modes/      elastic, evaluate, benchmark (the fixed-size training run, the recipe, is in train_hvd.py)
plugins     how a model, data set or task is named (one that ships, or package.module:name) and built
tasks       the task interface, and classification and the VAE written against it
weights     --init-from and --freeze
api         hvd_train.run(): the app around the objects of a user's own script
model_card  what rebuilds and feeds a trained model; inference, export, predict: using it after training
tracking    MLflow and W&B (offline) on rank 0
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
