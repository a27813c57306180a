"""Checkpoints across ranks: rank 0 reads, every rank receives; every rank's RNG state is gathered for saving."""
import horovod.torch as hvd

import checkpoint
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
        except (checkpoint.CheckpointError, RuntimeError, ValueError) as e:
            error = e
    error, result = hvd.broadcast_object((error, result), root_rank=0, name=name)
    if error is not None:
        raise error
    return result


def _check_fits(ckpt, path, expect):
    for key, value in expect.items():
        if ckpt.get(key) != value:
            raise checkpoint.CheckpointError(f"{path} was written for {key}={ckpt.get(key)!r}, this run has "
                                             f"{key}={value!r}; use a matching --model/--dataset or another file")


def restore(path, model, optimizer, scheduler, scaler, expect, steps_per_epoch):
    """Load `path` on rank 0 into the model, optimizer, schedule and scaler, then give every rank the same state.

    `expect` maps checkpoint fields (model_name, task, num_classes) to this run's values; a mismatch is refused
    with the field named. Returns the checkpoint's counters and history, the same on every rank, and restores each
    rank's own RNG state when the world size is unchanged.
    """
    def load_on_root():
        ckpt = checkpoint.load(path)
        _check_fits(ckpt, path, expect)
        try:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise checkpoint.CheckpointError(f"{path}: its weights do not fit this model ({str(e).splitlines()[0]})")
        return {k: ckpt[k] for k in ("epoch", "step", "best_metric", "best_epoch", "history", "world_size", "rng",
                                     "scheduler", "scaler")}

    meta = decide_on_root(load_on_root, "resume")
    if meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    else:  # written by an elastic run, which sets the rate from its progress: put the schedule at that point
        scheduler.last_epoch = meta["epoch"] * steps_per_epoch - 1
        scheduler.step()
    if scaler is not None and meta["scaler"]:
        scaler.load_state_dict(meta["scaler"])
    if meta["world_size"] == hvd.size():
        checkpoint.set_rng_state(meta["rng"][hvd.rank()])
    return meta


def load_weights(path, model, expect, optimizer=None):
    """The model weights (and the optimizer state, when given) from a checkpoint: rank 0 reads, every rank
    receives. For --evaluate, and for elastic runs, which restore their counters themselves."""
    def load_on_root():
        ckpt = checkpoint.load(path)
        _check_fits(ckpt, path, expect)
        try:
            model.load_state_dict(ckpt["model"])
            if optimizer is not None:
                optimizer.load_state_dict(ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise checkpoint.CheckpointError(f"{path}: its weights do not fit this model ({str(e).splitlines()[0]})")
        return {k: ckpt.get(k) for k in ("epoch", "step", "best_metric", "best_epoch", "history")}

    meta = decide_on_root(load_on_root, "weights")
    with default_layout(model, optimizer):  # Horovod takes channels-last weights in the default layout only
        if optimizer is not None:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return meta


def gather_rng_states():
    """Every rank's RNG states, in rank order (a collective: every rank must call it)."""
    if hvd.size() == 1:
        return [checkpoint.rng_state()]
    return hvd.allgather_object(checkpoint.rng_state(), name="rng_states")
