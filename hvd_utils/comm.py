"""Collectives for the communication benchmark (bench/allreduce.py): Horovod's allreduce as training uses it."""
import horovod.torch as hvd

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
