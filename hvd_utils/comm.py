"""Collectives over Horovod's: the allreduce as training uses it (for the communication benchmark,
bench/allreduce.py), and the gather and scatter Horovod lacks (for the sharded optimizer's and PowerSGD's
checkpoint state)."""
import horovod.torch as hvd
import torch

from hvd_utils.compression import wire_format


def allreduce_average(tensors, name, fp16=False, bf16=False):
    """Average `tensors` across ranks the way DistributedOptimizer does for one step's gradients: every allreduce is
    queued at once (Horovod fuses the ones that are ready in the same cycle, up to the fusion threshold), then
    waited for. fp16/bf16 send half-size copies (hvd_utils.compression). Returns the averaged tensors."""
    compression = wire_format(fp16, bf16)
    pending = []
    for i, tensor in enumerate(tensors):
        sent, ctx = compression.compress(tensor)
        # Fixed names: as in training, each step's tensors repeat the last step's, so Horovod's response cache
        # skips most of the negotiation.
        pending.append((hvd.allreduce_async_(sent, op=hvd.Average, name=f"{name}.{i}"), ctx))
    return [compression.decompress(hvd.synchronize(handle), ctx) for handle, ctx in pending]


def gather_to(root_rank, tensor, name):
    """Every rank's `tensor`, back to back in rank order, on root_rank alone (an alltoall in which every rank sends
    all of it there and nothing elsewhere: Horovod has no gather); the other ranks get an empty tensor."""
    splits = torch.zeros(hvd.size(), dtype=torch.int32)
    splits[root_rank] = tensor.numel()
    out = hvd.alltoall(tensor, splits=splits, name=name)
    return out[0] if isinstance(out, tuple) else out


def scatter_from(root_rank, tensors, name, dtype=torch.float32):
    """root_rank's `tensors` (one per rank, all of one length) dealt out: rank k gets tensors[k] (an alltoall in
    which only root_rank sends); the other ranks pass None."""
    splits = torch.zeros(hvd.size(), dtype=torch.int32)
    if hvd.rank() == root_rank:
        sent = torch.cat([t.reshape(-1).cpu() for t in tensors])
        splits[:] = tensors[0].numel()
    else:
        sent = torch.zeros(0, dtype=dtype)
    out = hvd.alltoall(sent, splits=splits, name=name)
    return out[0] if isinstance(out, tuple) else out
