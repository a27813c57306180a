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
import collections
import itertools
import logging
import queue
import random
import threading
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
        images = _images(batch)
        return self.erased(self.prepare(batch), key) if images is not None else to_device(batch, self.device)

    def prepare(self, batch):
        """One batch of images on the device: decoded where they are still encoded, and normalized."""
        images = _images(batch)
        if isinstance(images, EncodedBatch):
            if not self.said:
                log.info("photos are decoded, cropped and flipped on %s, a batch at a time (--data.decode): the "
                         "loader workers read their bytes and draw their crops", self.device)
                self.said = True
            ready = self.normalize(crop_batch(images, decode_batch(images, self.device)), scale=255.0)
        else:
            ready = self.normalize(images.to(self.device, non_blocking=True).float(), scale=255.0)
        return type(batch)([ready, *to_device(list(batch[1:]), self.device)])

    def erased(self, batch, key):
        """A prepared batch of images, erased where `key` names a training step and --reprob is on."""
        if key is None or self.erasing is None:
            return batch
        return type(batch)([self.erase(batch[0], key), *batch[1:]])

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
        runs. Photos still encoded (--data.decode gpu) are decoded on a thread of their own (ahead())."""
        keys = (None if epoch is None else (epoch, step) for step in _count(first_step))
        batches = iter(loader)
        first = next(batches, None)
        if first is None:
            return
        batches = itertools.chain([first], batches)
        if isinstance(_images(first), EncodedBatch):
            yield from self.ahead(batches, keys)
            return
        if self.device.type != "cuda":
            for batch, key in zip(batches, keys):
                yield self(batch, key)
            return
        stream, current = torch.cuda.Stream(device=self.device), torch.cuda.current_stream(self.device)
        ready = None
        for batch, key in zip(batches, keys):
            with torch.cuda.stream(stream):
                upcoming = self(batch, key)
            if ready is not None:
                yield ready
            current.wait_stream(stream)
            _record(upcoming, current)  # its memory stays the step's until the step is done with it
            ready = upcoming
        if ready is not None:
            yield ready

    def ahead(self, batches, keys):
        """Encoded photos decoded, cropped and normalized on a thread of their own, AHEAD batches before the step
        that takes them, and erased here in step order. The loader is read on this thread, as always: a data set
        loaded in this process draws its crops here, and the decoding thread draws nothing.

        Why a thread: torchvision's decode on a GPU waits on the host for its decoder's stream, and on a GPU
        without a hardware JPEG decoder (the H100, H200 and A100 have one) decodes the Huffman stage on the CPU;
        both happen with the GIL released, so on a thread of its own they overlap the step's launches instead of
        holding them back. (Measured on an H200 with the flat byte transfer not yet in place, the thread alone
        did not change the training rate: docs/data.md.)"""
        todo, out, stop = queue.Queue(), queue.Queue(), threading.Event()
        worker = threading.Thread(target=self._decode_ahead, args=(todo, out, stop), daemon=True,
                                  name="hvd-train-decode")
        worker.start()
        inflight = collections.deque()  # per batch in order: None (with the thread), or the loader's error

        def submit():
            try:
                batch = next(batches, _END)
            except Exception as e:  # raised in its place, after the batches before it
                inflight.append(e)
                return False
            if batch is _END:
                return False
            todo.put(batch)
            inflight.append(None)
            return True

        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        try:
            more = all(submit() for _ in range(AHEAD))
            for key in keys:
                if not inflight:
                    return
                error = inflight.popleft()
                if error is not None:
                    raise error
                item = out.get()
                more = more and submit()  # the thread decodes it while this step runs
                if isinstance(item, BaseException):
                    raise item
                batch, event = item
                if current is not None:
                    current.wait_event(event)
                    _record(batch, current)  # its memory stays the step's until the step is done with it
                yield self.erased(batch, key)
        finally:
            stop.set()  # what the thread holds is left unprepared
            todo.put(_END)
            worker.join()

    def _decode_ahead(self, todo, out, stop):
        """The decoding thread: each batch from `todo` prepared, on a side stream on a GPU with an event the step
        waits for, onto `out` (or the error it raised), until _END."""
        stream = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device and stream are each thread's own
            stream = torch.cuda.Stream(device=self.device)
        while True:
            batch = todo.get()
            if batch is _END or stop.is_set():
                return
            try:
                if stream is None:
                    out.put((self.prepare(batch), None))
                    continue
                with torch.cuda.stream(stream):
                    ready = self.prepare(batch)
                    event = torch.cuda.Event()
                    event.record(stream)
                out.put((ready, event))
            except BaseException as e:  # the training thread raises it, in its place among the batches
                out.put(e)


# Batches of encoded photos being prepared ahead of the step that takes them (Feed.ahead): two keep the decode
# busy while a step runs, and bound the memory they hold.
AHEAD = 2
_END = object()


def _images(batch):
    """The batch's images where the feed normalizes them (photos still encoded, or uint8 (N, C, H, W)); else None."""
    images = batch[0] if isinstance(batch, (tuple, list)) and batch else None
    if isinstance(images, EncodedBatch):
        return images
    if torch.is_tensor(images) and images.dtype == torch.uint8 and images.dim() == 4:
        return images
    return None


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
