"""How a loader's batch reaches the model: on the device, images as normalized floats, training's random erasing,
and on GPUs the next batch prepared on a side stream while the current step runs (timm's PrefetchLoader).

The loaders hand images over as uint8 (data/photos.py, data/arrays.py): a quarter of float32's bytes through pinned
memory, and the CPU spends its time decoding rather than converting and normalizing pixels. Here a batch whose first
item is a uint8 (N, C, H, W) tensor becomes float32 (x / 255 - mean) / std on the device, with the data set's mean and
std (its preprocessing record; 0 and 1 where it has none: a user's data set that returns uint8 images gets them
scaled to 0..1). A batch of photos still encoded (--data.decode gpu) is decoded, cropped and flipped first
(data/photos.py: crop_batch). Batches of any other form (floats, dicts of token ids) only move to the device.

Random erasing (--reprob) works on normalized images, so it happens here too, through timm's RandomErasing, drawing
from generators seeded by (seed, rank, epoch, step): a resumed run erases as the run it continues did.
"""
import logging
import random
from typing import Optional

import torch

from hvd_train.batches import to_device
from hvd_train.data.augment import derived_seed
from hvd_train.data.photos import EncodedBatch, crop_batch, decode_batch

log = logging.getLogger("hvd_train")


class Feed:
    """Batches from a loader as the model takes them. mean, std: the images' per-channel figures (None: 0 and 1);
    erasing: timm's RandomErasing for training batches, or None."""

    def __init__(self, device, mean=None, std=None, erasing=None, seed=0, rank=0):
        self.device, self.erasing, self.seed, self.rank = device, erasing, seed, rank
        self.said = False  # whether the log says yet where photos are decoded
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)

    @classmethod
    def of_run(cls, cfg, info, device, rank):
        """The feed of a run: the data's preprocessing (mean, std) and --reprob."""
        return cls(device, *image_figures(info), erasing_of(cfg.aug, device), cfg.run.seed, rank)

    def __call__(self, batch, key=None):
        """One batch on the device, its images normalized; erased when `key` (epoch, step) names a training step."""
        images = batch[0] if isinstance(batch, (tuple, list)) and batch else None
        if isinstance(images, EncodedBatch):
            if not self.said:
                log.info("photos are decoded, cropped and flipped on %s, a batch at a time (--data.decode): the "
                         "loader workers read their bytes and draw their crops", self.device)
                self.said = True
            ready = self.normalize(crop_batch(images, decode_batch(images, self.device)), scale=255.0)
        elif torch.is_tensor(images) and images.dtype == torch.uint8 and images.dim() == 4:
            ready = self.normalize(images.to(self.device, non_blocking=True).float(), scale=255.0)
        else:
            return to_device(batch, self.device)
        if key is not None and self.erasing is not None:
            ready = self.erase(ready, key)
        return type(batch)([ready, *to_device(list(batch[1:]), self.device)])

    def normalize(self, images, scale):
        images = images.div_(scale)
        if self.mean is not None:
            images = images.sub_(self.mean).div_(self.std)
        return images

    def erase(self, images, key):
        state = random.getstate()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                seed = derived_seed("erase", self.seed, self.rank, *key)
                random.seed(seed)
                torch.manual_seed(seed)
                return self.erasing(images)
        finally:
            random.setstate(state)

    def batches(self, loader, epoch=None, first_step=1):
        """The loader's batches ready for the model; `epoch` given: training's, numbered from first_step (the keys
        of their erasing). On a GPU each batch is copied and prepared on a side stream while the step before it
        runs."""
        keys = (None if epoch is None else (epoch, step) for step in _count(first_step))
        if self.device.type != "cuda":
            for batch, key in zip(loader, keys):
                yield self(batch, key)
            return
        stream, current = torch.cuda.Stream(device=self.device), torch.cuda.current_stream(self.device)
        ready = None
        for batch, key in zip(loader, keys):
            with torch.cuda.stream(stream):
                upcoming = self(batch, key)
            if ready is not None:
                yield ready
            current.wait_stream(stream)
            _record(upcoming, current)  # its memory stays the step's until the step is done with it
            ready = upcoming
        if ready is not None:
            yield ready


def _count(start):
    while True:
        yield start
        start += 1


def _record(batch, stream):
    if torch.is_tensor(batch):
        batch.record_stream(stream)
    elif isinstance(batch, dict):
        for value in batch.values():
            _record(value, stream)
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            _record(value, stream)


def erasing_of(aug_cfg, device) -> Optional[object]:
    """timm's RandomErasing for --reprob, on `device`; None where it is off."""
    if aug_cfg.no_aug or not aug_cfg.reprob:
        return None
    from timm.data.random_erasing import RandomErasing

    return RandomErasing(aug_cfg.reprob, mode=aug_cfg.remode, max_count=aug_cfg.recount, device=device)


def image_figures(info):
    """(mean, std) of the data's images from its preprocessing record; (None, None) where it has none."""
    pre = info.preprocessing if info is not None else None
    return (pre.mean, pre.std) if pre is not None else (None, None)
