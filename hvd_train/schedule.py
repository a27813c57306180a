"""The batch arithmetic (Batching: made once per number of ranks), and the one learning-rate mechanism: the rate
is a function of how far training has come, in (fractional) epochs.

A fixed run is at epoch - 1 + step / steps_per_epoch; an elastic run, whose steps per epoch change with the number
of workers, at epoch - 1 + samples processed / samples in the epoch. Both set the rate before every optimizer step,
so the same schedule holds whatever the number of ranks, and a resumed run needs only its epoch to continue it.
"""
import math
from dataclasses import dataclass

import hvd_utils
from hvd_train.config import LR_SCHEDULES


@dataclass(frozen=True)
class Batching:
    """The batch arithmetic of a run on `ranks` ranks, made in one place: samples per rank per step (the batch x
    batches per allreduce), the global batch, and the learning rate's multiplier (the linear scaling rule; Adasum
    counts only the local accumulation) and the rate it gives."""
    per_rank: int
    ranks: int
    global_batch: int
    lr_scale: float
    lr: float


def batching(cfg, ranks):
    accumulate = cfg.horovod.batches_per_allreduce
    scale = hvd_utils.lr_scale(ranks, accumulate, cfg.horovod.use_adasum)
    per_rank = cfg.optim.batch_size * accumulate
    return Batching(per_rank, ranks, per_rank * ranks, scale, cfg.optim.lr * scale)


def lr_factor(epochs_done, epochs, schedule, warmup_epochs=0.0, warmup_start=1.0, milestones=(), gamma=0.1):
    """Multiplier of the scaled learning rate after `epochs_done` (fractional) of `epochs`.

    Warmup (Goyal et al. 2017) climbs linearly from `warmup_start` (1 / scale: the unscaled rate) to 1 over
    `warmup_epochs`; then `schedule` decays: cosine to 0 at the end, step by `gamma` at each epoch in `milestones`,
    exponential by `gamma` per epoch, or constant.
    """
    if epochs_done < warmup_epochs:
        return warmup_start + (1.0 - warmup_start) * epochs_done / warmup_epochs
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = (epochs_done - warmup_epochs) / max(1e-9, epochs - warmup_epochs)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    if schedule in ("step", "multistep"):
        return gamma ** sum(1 for m in milestones if epochs_done >= m)
    if schedule == "exponential":
        return gamma ** epochs_done
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")


class LRSchedule:
    """optim_cfg's schedule at the rate scaled by `lr_scale` (ranks x batches per allreduce; an elastic run
    updates it when the workers change)."""

    def __init__(self, optim_cfg, lr_scale):
        self.cfg, self.lr_scale = optim_cfg, lr_scale

    def lr(self, epochs_done):
        c = self.cfg
        factor = lr_factor(epochs_done, c.epochs, c.lr_schedule, c.warmup_epochs, 1.0 / self.lr_scale,
                           c.lr_milestones, c.lr_gamma)
        return c.lr * self.lr_scale * factor

    def apply(self, optimizer, epochs_done):
        """Set the rate for this point of training on every parameter group; returns it."""
        lr = self.lr(epochs_done)
        for group in optimizer.param_groups:
            # timm's layer-wise decay (--layer-decay) gives each group its share of the rate.
            group["lr"] = lr * group.get("lr_scale", 1.0)
        return lr
