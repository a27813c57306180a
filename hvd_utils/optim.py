"""Wrapping the optimizer, the synchronize-then-step pattern, and making every rank start from rank 0's state."""
import horovod.torch as hvd
import torch
from horovod.torch.optimizer import _DistributedAdasumOptimizer


def lr_scale(world_size, batches_per_allreduce=1, use_adasum=False):
    """The learning-rate multiplier. Linear scaling rule (Goyal et al. 2017): the rate grows with the global
    batch, ranks x batches per allreduce. Adasum adapts to the number of ranks by itself, so only the local
    accumulation counts there (as in Horovod's own examples on the CPU)."""
    return batches_per_allreduce * (1 if use_adasum else world_size)


def distributed_optimizer(optimizer, model, batches_per_allreduce=1, fp16_allreduce=False, use_adasum=False,
                          gradient_predivide_factor=1.0):
    """Horovod: average gradients across ranks with ring-allreduce during backward().

    The wrapper is a new optimizer over the same parameters; state loaded into the old one is not carried over,
    so load checkpoints into the returned optimizer.
    """
    return hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=batches_per_allreduce,
        op=hvd.Adasum if use_adasum else hvd.Average,
        gradient_predivide_factor=gradient_predivide_factor)


def _is_adasum(optimizer):
    # hvd.DistributedOptimizer builds a new class from the wrapped optimizer's class and copies in the methods of
    # its Adasum variant, so isinstance cannot tell; the methods can (not `step`, which torch re-wraps).
    return type(optimizer).__dict__.get("skip_synchronize") is _DistributedAdasumOptimizer.__dict__["skip_synchronize"]


def apply_gradients(optimizer, step, before_step=None):
    """Horovod: wait for the averaged gradients, let before_step() see them (unscale, clip), then step() without
    a second allreduce. Works for a plain torch optimizer too (one process, or before wrapping).

    Adasum's optimizer steps locally and then combines the parameter updates, so there are no combined gradients
    to look at: before_step() sees this rank's own.
    """
    if not hasattr(optimizer, "synchronize") or _is_adasum(optimizer):
        if before_step is not None:
            before_step()
        return step()
    optimizer.synchronize()
    if before_step is not None:
        before_step()
    with optimizer.skip_synchronize():
        return step()


def broadcast_state(model, optimizer, root_rank=0):
    """Horovod: copy optimizer state, parameters and buffers from root_rank, so all ranks start identical.

    The optimizer state goes first: on a rank with empty state, Horovod initialises it with one zero-gradient step,
    which moves parameters under weight decay; broadcasting the parameters afterwards undoes that.
    """
    hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)
    hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)


def sync_batch_norm(model):
    """Horovod: replace every BatchNorm with hvd.SyncBatchNorm, whose statistics cover all ranks' samples."""
    for name, child in model.named_children():
        if isinstance(child, torch.nn.modules.batchnorm._BatchNorm):
            sync = hvd.SyncBatchNorm(child.num_features, eps=child.eps, momentum=child.momentum,
                                     affine=child.affine, track_running_stats=child.track_running_stats)
            sync.load_state_dict(child.state_dict())
            setattr(model, name, sync)
        else:
            sync_batch_norm(child)
    return model


def average_buffers(model):
    """Horovod: average floating-point buffers (BatchNorm running statistics) over the ranks.

    Each rank updates its running statistics from its own samples, so without this the ranks, and the validation
    and checkpoints they produce, would disagree. hvd.SyncBatchNorm models agree already; this costs one small
    allreduce per epoch: every buffer is queued at once, so Horovod fuses them (one by one, a ResNet-50's 106
    buffers waited for 106 cycles).
    """
    if hvd.size() == 1:
        return
    handles = [hvd.allreduce_async_(buf, op=hvd.Average, name=f"buffer.{name}")
               for name, buf in model.named_buffers() if buf.is_floating_point()]
    for handle in handles:
        hvd.synchronize(handle)
