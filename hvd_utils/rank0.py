"""Files across ranks: rank 0 decides (reads a checkpoint, checks a directory), every rank receives the outcome."""
import horovod.torch as hvd


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
        except (RuntimeError, ValueError) as e:  # the app's errors about files and settings are ValueErrors
            error = e
    error, result = hvd.broadcast_object((error, result), root_rank=0, name=name)
    if error is not None:
        raise error
    return result


def broadcast_module(module, root_rank=0):
    """Rank 0's state of a module that is not the trained model (the weights' average, --model-ema) to every rank."""
    if hvd.size() > 1:
        hvd.broadcast_parameters(module.state_dict(), root_rank=root_rank)
