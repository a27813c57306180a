"""Checkpoints across ranks: rank 0 reads, every rank receives; every rank's RNG state is gathered for saving."""
import horovod.torch as hvd

from hvd_train import checkpoint
from hvd_train.errors import CheckpointError
from hvd_utils.optim import default_layout


def decide_on_root(fn, name):
    """fn() on rank 0, its result on every rank (file checks on a shared or a rank-0-only file system alike).

    An error on rank 0 is raised on every rank instead of leaving the others waiting in a broadcast that never
    comes."""
    if hvd.size() == 1:  # nobody to tell (and no wait for Horovod's cycle)
        return fn()
    result, error = None, None
    if hvd.rank() == 0:
        try:
            result = fn()
        except (CheckpointError, RuntimeError, ValueError) as e:
            error = e
    error, result = hvd.broadcast_object((error, result), root_rank=0, name=name)
    if error is not None:
        raise error
    return result


def _check_fits(ckpt, path, expect):
    """Every setting in `expect` the checkpoint records must match (older checkpoints record fewer)."""
    for key, value in expect.items():
        if key in ckpt and ckpt[key] != value:
            setting = checkpoint.FIT_SETTINGS.get(key, key)
            raise CheckpointError(f"{path} was written with {key}={ckpt[key]!r}, this run has {key}={value!r}: a "
                                  f"checkpoint fits only a run with the same {key} ({setting}); use the "
                                  f"checkpoint's setting, or another file")


def load_checkpoint(path, model, expect, optimizer=None):
    """Load `path` on rank 0 into the model (and the optimizer, when given), then give every rank those weights and
    that state: the one loader of resuming, elastic and evaluation runs alike.

    `expect` maps checkpoint fields (model_name, task, num_classes, dataset, ...) to this run's values; a mismatch is
    refused with the field named. Returns the checkpoint's other fields (counters, history, scaler, world size, RNG
    states), the same on every rank.
    """
    def load_on_root():
        ckpt = checkpoint.load(path)
        _check_fits(ckpt, path, expect)
        try:
            model.load_state_dict(ckpt["model"])
            if optimizer is not None:
                optimizer.load_state_dict(ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"{path}: its weights do not fit this model ({str(e).splitlines()[0]})")
        return {k: v for k, v in ckpt.items() if k not in ("model", "optimizer", "config")}

    meta = decide_on_root(load_on_root, "checkpoint")
    with default_layout(model, optimizer):  # Horovod takes channels-last weights in the default layout only
        if optimizer is not None:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return meta


def restore_rng(meta):
    """This rank's RNG states from a checkpoint's, where it was written by as many ranks as there are now (with
    another number of ranks, rank r's stream would not continue anyway)."""
    if meta.get("world_size") == hvd.size() and meta.get("rng"):
        checkpoint.set_rng_state(meta["rng"][hvd.rank()])


def gather_rng_states():
    """Every rank's RNG states, in rank order (a collective: every rank must call it)."""
    if hvd.size() == 1:
        return [checkpoint.rng_state()]
    return hvd.allgather_object(checkpoint.rng_state(), name="rng_states")
