"""Regularisation the training loop applies: mixup/CutMix of a batch and the exponential moving average of the
weights, both through timm's own classes (timm.data.Mixup, timm.utils.ModelEmaV3). What is Horovod-specific:

- Mixup draws its mixing weight and boxes from NumPy's global generator; here each batch draws from a generator
  seeded by (seed, rank, epoch, step), so ranks mix differently, every epoch differs, and a resumed or repeated run
  mixes exactly as before.
- The average is updated after every optimizer step on every rank. The weights are the same on every rank after
  each step, so their averages are too; BatchNorm statistics are not (each rank's come from its own samples), so
  the average's buffers are averaged over the ranks with the model's once per epoch, before validation.
"""
import numpy as np
import torch
from torch import nn

from hvd_train.data.augment import derived_seed


class Mixing:
    """timm's Mixup (mixup and/or CutMix, with label smoothing) on a batch (images, labels) -> (mixed images,
    labels, soft targets): the task learns from the soft targets and counts its accuracy against the labels."""

    def __init__(self, aug_cfg, num_classes, seed, rank):
        from timm.data import Mixup
        from timm.data.mixup import mixup_target

        self.mixup = Mixup(mixup_alpha=aug_cfg.mixup, cutmix_alpha=aug_cfg.cutmix, prob=aug_cfg.mixup_prob,
                           switch_prob=aug_cfg.mixup_switch_prob, mode=aug_cfg.mixup_mode,
                           label_smoothing=aug_cfg.smoothing, num_classes=num_classes)
        self.off_epoch, self.seed, self.rank = aug_cfg.mixup_off_epoch, seed, rank
        self.smoothing, self.num_classes = aug_cfg.smoothing, num_classes
        self.one_hot = mixup_target  # (labels, classes, weight 1, smoothing): an unmixed sample's target

    def __call__(self, batch, epoch, step):
        images, labels = batch[0], batch[1]
        # timm's batch and pair modes pair each sample with its mirror in the batch: an odd last sample is left
        # unmixed, with its (smoothed) one-hot target.
        even = images.shape[0] - images.shape[0] % 2
        self.mixup.mixup_enabled = not (self.off_epoch and epoch >= self.off_epoch)
        state = np.random.get_state()
        try:
            np.random.seed(derived_seed("mix", self.seed, self.rank, epoch, step, size=4))
            mixed, targets = self.mixup(images[:even].clone(), labels[:even]) if even else (images[:0], None)
        finally:
            np.random.set_state(state)
        if even < images.shape[0]:
            rest = self.one_hot(labels[even:], self.num_classes, 1.0, self.smoothing)
            mixed = torch.cat([mixed, images[even:]])
            targets = rest if targets is None else torch.cat([targets, rest])
        return (mixed, labels, targets)


class WeightAverage(nn.Module):
    """The exponential moving average of a model's weights (timm's ModelEmaV3) and the count of its updates, which
    sets the warmup of the decay and is saved with it: a module, so checkpoints and Horovod's elastic state carry
    both as one state_dict."""

    def __init__(self, model, decay, warmup=False):
        super().__init__()
        from timm.utils import ModelEmaV3

        self.average = ModelEmaV3(model, decay=decay, use_warmup=warmup)
        # A model compiled in place (--compile) is copied with its compiled forward, which calls the original
        # module: the average runs eagerly (it is only evaluated once per epoch).
        for module in self.average.module.modules():
            if getattr(module, "_compiled_call_impl", None) is not None:
                module._compiled_call_impl = None
        # On the CPU whatever the model's device (this module is never moved): reading it costs no device sync.
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))

    @property
    def module(self):
        """The averaged model."""
        return self.average.module

    @torch.no_grad()
    def restart(self, model):
        """Average from `model`'s weights as they are now (after the broadcast from rank 0, or --init-from)."""
        self.average.module.load_state_dict(model.state_dict())
        self.updates.zero_()

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        self.average.update(model, step=int(self.updates))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def weight_average(cfg, model):
    """--model-ema: the average of `model`'s weights, or None."""
    if not cfg.model.ema:
        return None
    return WeightAverage(model, cfg.model.ema_decay, cfg.model.ema_warmup)
