"""Files across ranks: rank 0 decides (reads a checkpoint, checks a directory), every rank receives the outcome."""
import horovod.torch as hvd
import torch


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


def broadcast_state_dict(state_dict, root_rank, name):
    """root_rank's nested dict of tensors and plain values to every rank: the structure as one object, each tensor
    with hvd.broadcast (no pickling of large tensors)."""
    tensors = []

    def strip(value):
        if torch.is_tensor(value):
            tensors.append(value)
            return ("__tensor__", len(tensors) - 1, tuple(value.shape), str(value.dtype).replace("torch.", ""))
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(v) for v in value)
        return value

    skeleton = hvd.broadcast_object(strip(state_dict) if hvd.rank() == root_rank else None, root_rank=root_rank,
                                    name=f"{name}.skeleton")

    def fill(value):
        if isinstance(value, tuple) and len(value) == 4 and value[0] == "__tensor__":
            _, i, shape, dtype = value
            # On the CPU: a checkpoint's tensors, wherever rank 0 read them to, travel through MPI or Gloo.
            t = tensors[i].cpu() if hvd.rank() == root_rank else torch.empty(shape, dtype=getattr(torch, dtype))
            return hvd.broadcast(t.contiguous(), root_rank, name=f"{name}.{i}")
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(v) for v in value)
        return value

    return fill(skeleton)
