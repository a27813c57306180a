"""Exact metrics across ranks: sums and counts reduced once, never a mean of per-rank means.

Alone (hvd.size() == 1) each function returns its local answer without Horovod: a collective would only wait for
Horovod's next cycle, which is 100 ms in a process started alone (hvd_utils/tuning.py)."""
import hashlib

import horovod.torch as hvd
import torch


def allreduce_sums(sums, name="metric_sums"):
    """Sum a dict of tensors over all ranks with one allreduce.

    Each value may have any shape (a scalar, per-class counts, a confusion matrix), the same on every rank. Keys
    are sorted so every rank packs the same values in the same order; float64 keeps large sample counts exact.
    Returns plain floats for scalars and float64 CPU tensors of their own shapes for the others.
    """
    keys = sorted(sums)
    values = [torch.as_tensor(sums[k], dtype=torch.float64).detach().cpu() for k in keys]
    if values and hvd.size() > 1:  # alone: no wait for Horovod's next cycle (100 ms when alone, hvd_utils/tuning.py)
        packed = hvd.allreduce(torch.cat([v.reshape(-1) for v in values]), op=hvd.Sum, name=name)
        values = [part.reshape(v.shape) for part, v in zip(packed.split([v.numel() for v in values]), values)]
    return summed(dict(zip(keys, values)))


def summed(sums):
    """Sums as allreduce_sums returns them: plain floats for scalars, float64 CPU tensors of their own shapes for
    the others."""
    values = {k: torch.as_tensor(v, dtype=torch.float64).detach().cpu() for k, v in sums.items()}
    return {k: float(v) if v.dim() == 0 else v for k, v in values.items()}


def params_fingerprint(model):
    """The first 8 bytes of a SHA-256 over every parameter and buffer, as an int: equal only for bitwise-equal
    weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little", signed=True)


def fingerprints_by_rank(model):
    """The parameter fingerprint of every rank, gathered on all of them (rank order)."""
    if hvd.size() == 1:
        return [params_fingerprint(model)]
    mine = torch.tensor([params_fingerprint(model)], dtype=torch.int64)
    return hvd.allgather(mine, name="params_fingerprint").tolist()


def sum_across_ranks(value, name):
    """A scalar summed over all ranks, as a Python number (one small allreduce and a host sync)."""
    tensor = torch.as_tensor(value, dtype=torch.float64).detach().cpu().reshape(1)
    if hvd.size() == 1:
        return tensor.item()
    return hvd.allreduce(tensor, op=hvd.Sum, name=name).item()


def gather_floats(values, name):
    """Every rank's list of floats (all the same length), gathered on all ranks, in rank order."""
    if hvd.size() == 1:
        return [[float(v) for v in values]]
    mine = torch.tensor([list(values)], dtype=torch.float64)
    return hvd.allgather(mine, name=name).tolist()


def gather_objects(obj, name):
    """Every rank's picklable `obj`, gathered on all ranks, in rank order."""
    if hvd.size() == 1:
        return [obj]
    return hvd.allgather_object(obj, name=name)
