"""Wrapping the optimizer and making every rank start from rank 0's state."""
import horovod.torch as hvd


def scaled_lr(base_lr, world_size):
    """Linear scaling rule (Goyal et al. 2017): the global batch grows with the ranks, so does the step size."""
    return base_lr * world_size


def distributed_optimizer(optimizer, model):
    """Horovod: average gradients across ranks with ring-allreduce during backward()."""
    return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


def broadcast_state(model, optimizer, root_rank=0):
    """Horovod: copy parameters, buffers and optimizer state from root_rank, so all ranks start identical."""
    hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)
    hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)
