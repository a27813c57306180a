"""WebDataset tar shards: data sets larger than a node, streamed from local disks, http(s):// servers or pipe:
commands (the `webdataset` library opens and unpacks them), with exact epochs.

A shard is a tar of samples, each a group of files with one key: `000042.png` (or .jpg, ...) and `000042.cls` (the
class index as text). An index (`hvd-train shard` writes `index.json` beside the shards) gives every shard's
sample count and the facts the model needs (classes, channels, image size, normalization). A shard's files are
read, bounded, by data/shard_tar.py and made samples by data/shard_samples.py; here they are streamed, batched and
dealt out.

The plan of an epoch (data/shard_index.py, beside the index it reads) follows from the index, the seed and the epoch
number alone, so every rank computes the same one without talking to the others:
- the training shards are shuffled by (seed, epoch) and dealt out: rank r reads shards r, r+W, ... (W ranks), and
  its loader workers split its shards the same way; each reads its shards whole, through a shuffle buffer seeded by
  (seed, epoch, rank, worker), and makes full batches only;
- every rank runs the same number of steps, the fewest full batches any rank holds that epoch, so shards of
  unequal size cannot leave one rank waiting in an allreduce for another that has run out (the samples beyond
  that are left out of that epoch only, and the next epoch's deal differs);
- validation: rank r reads validation shards r, r+W, ... whole, in order, so every sample counts exactly once.

Resuming starts the next epoch of the checkpoint with the same plan an uninterrupted run has, so a resumed run reads
exactly the samples, in the same order, that one that never stopped reads, and no epoch reads a sample twice.
"""
import os
import random
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from hvd_train.data import photos
from hvd_train.data.augment import derived_seed, seed_all, seeded
from hvd_train.data.errors import UNREADABLE_IMAGE, BadSampleError
from hvd_train.data.shard_index import by_worker, check_plan, deal, train_plan, unreachable
from hvd_train.data.shard_samples import decode, encoded, rebuild
from hvd_train.data.shard_tar import member_bound, tar_files
from hvd_train.data.workers import stop_signals_from


# --------------------------------------------------------------------------------------------------------------------
# Reading


def transform_for(facts, image_size, train, augment=None):
    """Photos (written from an image folder) get ImageFolder's transform, on the image's bytes; arrays (CIFAR, MNIST,
    ...) are brought to image_size and, in training, augmented as the data set they were written from is (augment:
    (Augmentation, kind) or None). Both give uint8 images, normalized on the device with the index's mean and std
    (hvd_train/feed.py). A user's samples (any other data set) take none (None)."""
    from torchvision.transforms import v2 as T

    augmentation, kind = augment or (None, None)
    if facts.get("transform") == "samples":  # a user's samples come back as they were written: nothing to do
        return None
    if facts.get("transform") == "photos":
        from hvd_train.data.imagefolder import transforms

        return transforms(image_size, train, augmentation)
    steps = [T.PILToTensor()]
    if image_size != facts.get("image_size"):
        steps.append(T.Resize((image_size, image_size), antialias=True))
    channels = facts.get("in_channels", 3)
    if train and augmentation is not None and kind in ("natural", "digits"):
        steps.append(augmentation.tensor_transform(kind, image_size, facts.get("mean", [0.0] * channels),
                                                   facts.get("std", [1.0] * channels)))
    return T.Compose([step for step in steps if step is not None])


@dataclass(frozen=True)
class Place:
    """Where a loader sits in the job: what its epoch plans depend on besides the shards and the epoch."""
    seed: int
    rank: int
    world_size: int
    workers: int
    batch_size: int


class ShardStream(IterableDataset):
    """The samples of one rank's shards, each loader worker reading its own; training yields full batches only,
    shuffled through a buffer; validation yields every sample, in shard order.

    The epoch sits in shared memory: loader workers live across epochs (starting them costs seconds) and read it
    when an epoch's iteration starts, so they follow set_epoch without being restarted. So do the batches each
    worker leaves out of an epoch that a resumed run continues (`skip`, for the epoch `skip_epoch`): their samples
    are read, as the shuffle buffer must be filled the same way, but neither decoded nor transformed.

    Each training sample's random transforms draw from generators seeded by (seed, epoch, rank, worker, its place in
    the worker's stream), so a sample left out draws nothing that a later one would have drawn."""

    def __init__(self, shards, place, transform, shuffle_buffer):
        self.shards, self.place, self.transform, self.shuffle_buffer = shards, place, transform, shuffle_buffer
        self.structure = shards.facts.get("structure") if shards.facts.get("transform") == "samples" else None
        self.epoch = torch.ones(1, dtype=torch.int64).share_memory_()
        self.skip_epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.skip = torch.zeros(max(1, place.workers), dtype=torch.int64).share_memory_()

    def plan(self, epoch):
        """([worker] -> shard indices, steps) of this rank for `epoch`."""
        p = self.place
        if self.shards.train:
            parts, steps = train_plan(self.shards, epoch, p.seed, p.world_size, p.workers, p.batch_size)
            return parts[p.rank], steps
        parts = by_worker(deal(list(range(len(self.shards.urls))), p.world_size, p.rank), p.workers)
        return parts, sum(-(-sum(self.shards.counts[i] for i in part) // p.batch_size) for part in parts)

    def __iter__(self):
        info = get_worker_info()
        worker, epoch = (info.id if info is not None else 0), int(self.epoch[0])
        skipped = int(self.skip[worker]) * self.place.batch_size if int(self.skip_epoch[0]) == epoch else 0
        samples = self.samples(self.plan(epoch)[0][worker])
        if self.shards.train:
            rng = random.Random(f"{self.place.seed}:{epoch}:{self.place.rank}:{worker}")
            samples = shuffled(samples, self.shuffle_buffer, rng)
        batch, join = [], collate if self.structure is None else default_collate
        for n, raw in enumerate(samples):
            if n < skipped:
                continue
            item = self.prepare(raw, (self.place.seed, epoch, self.place.rank, worker, n), info is not None)
            batch.append(item)
            if len(batch) == self.place.batch_size:
                yield join(batch)
                batch = []
        if batch and not self.shards.train:
            yield join(batch)

    def prepare(self, raw, key, in_worker):
        """A sample as the model takes it, from its tar fields; a training image's transforms seeded by `key`."""
        sample, url = raw
        if self.structure is not None:
            return rebuild(sample, self.structure, url)
        classes = self.shards.facts.get("num_classes")  # the index's (read_index bounds it): the model's outputs
        classes = classes if type(classes) is int else None
        if self.shards.facts.get("transform") == "photos":  # the transform decodes the bytes (data/photos.py)
            image, label, _ = encoded(sample, url, classes)
        else:
            image, label = decode(sample, url, self.shards.facts.get("in_channels", 3), classes)
        if not self.shards.train:
            return self.transformed(image, sample, url), label
        if in_worker:  # nothing else draws in a loader worker
            seed_all(derived_seed(*key))
            return self.transformed(image, sample, url), label
        # In the training process the generators are put back after, so dropout draws as it would without shards.
        with seeded(derived_seed(*key)):
            return self.transformed(image, sample, url), label

    def transformed(self, image, sample, url):
        try:
            return self.transform(image)
        except UNREADABLE_IMAGE as e:  # photos' bytes that do not decode
            raise BadSampleError(f"shard {url}: sample {sample['__key__']} does not decode ({e}); rewrite the "
                                 f"shard") from None

    def samples(self, shard_indices):
        """(tar fields, url) of each sample of the shards, in order; a shard that cannot be read, or that holds
        another number of samples than the index says, is named."""
        from webdataset.tariterators import group_by_keys

        bound = member_bound()
        for i in shard_indices:
            url, expected, seen = self.shards.urls[i], self.shards.counts[i], 0
            try:
                for sample in group_by_keys(tar_files(url, bound)):
                    seen += 1
                    yield sample, url
            except BadSampleError:
                raise
            except Exception as e:  # webdataset, tarfile and curl signal unreadable shards with many types
                down = unreachable(url) if seen == 0 else None
                if down:
                    raise BadSampleError(f"shard {url}: {down}") from None
                raise BadSampleError(f"shard {url}: cannot read it after {seen} sample(s) ({describe(e)}); check "
                                     f"that it exists and is whole, or rewrite it with `hvd-train shard`") from None
            if seen != expected:
                raise BadSampleError(f"shard {url}: holds {seen} samples, its index says {expected}: the shard is "
                                     f"cut short or the index is stale; rewrite them with `hvd-train shard`")


def first_batch(shards, image_size, count):
    """The first `count` samples of a validation ShardSet, in shard order, prepared and collated as validation
    prepares them (one rank, no loader workers): what `hvd-train export` checks an export on."""
    place = Place(seed=0, rank=0, world_size=1, workers=0, batch_size=count)
    size = image_size or shards.facts.get("image_size")
    return next(iter(ShardStream(shards, place, transform_for(shards.facts, size, False), shuffle_buffer=0)))


def batches_before(counts, steps):
    """How many batches each loader worker has given when the loader has given `steps`: DataLoader takes one from
    each worker in turn, passing over a worker that has run out (`counts`: each worker's batches)."""
    taken, given = [0] * len(counts), 0
    while given < steps and any(t < c for t, c in zip(taken, counts)):
        for w, count in enumerate(counts):
            if given < steps and taken[w] < count:
                taken[w] += 1
                given += 1
    return taken


def describe(error):
    text = str(error.args[0]) if error.args else type(error).__name__
    return text.split(" @ ")[0]  # webdataset appends the stream's repr


def shuffled(samples, size, rng):
    """A shuffle buffer of `size` samples, as webdataset's: streamed data cannot be shuffled whole."""
    buffer = []
    for sample in samples:
        buffer.append(sample)
        if len(buffer) >= size:
            yield buffer.pop(rng.randrange(len(buffer)))
    rng.shuffle(buffer)
    yield from buffer


def collate(batch):
    if isinstance(batch[0][0], photos.Encoded):  # photos left for the device to decode (--data.decode)
        return photos.collate_encoded(batch)
    return torch.stack([image for image, _ in batch]), torch.tensor([label for _, label in batch])


# --------------------------------------------------------------------------------------------------------------------
# Loaders: what fit() needs of a training loader (len, iter) and of a sampler (set_epoch), in one object


class ShardLoader:
    """One split's loader for one rank. Training: len() is the steps every rank runs this epoch, and iterating
    yields exactly that many full batches."""

    def __init__(self, shards, spec, place, transform, context):
        self.stream = ShardStream(shards, place, transform, spec.shuffle_buffer)
        # Its own generator: the loader's seed draw leaves the training process's random numbers (dropout) alone.
        # Seeded by seed + rank: each rank's workers their own base seed (torch adds each worker's id).
        self.loader = DataLoader(self.stream, batch_size=None, num_workers=spec.workers, pin_memory=spec.pin_memory,
                                 persistent_workers=spec.workers > 0, multiprocessing_context=context,
                                 worker_init_fn=stop_signals_from(os.getpid()),
                                 generator=torch.Generator().manual_seed(place.seed + place.rank))
        self.set_epoch(1)

    def set_epoch(self, epoch):
        self.stream.epoch[0] = epoch
        self.steps = self.stream.plan(epoch)[1]
        if self.stream.shards.train and self.steps == 0:  # an epoch no rank can train: the refusal says why
            p = self.stream.place
            check_plan(self.stream.shards, p.world_size, p.batch_size, p.workers, epoch, p.seed)
        if int(self.stream.skip_epoch[0]) == epoch:
            self.steps -= int(self.stream.skip.sum())

    def continue_epoch(self, epoch, steps, position):
        """Read `epoch` from its step `steps` on (a run resumed from a checkpoint taken there), where the epoch's
        plan is the one the checkpoint's run had (the same ranks, loader workers and batch); returns whether it is."""
        p = self.stream.place
        if (position["world_size"], position.get("workers"), position["samples_per_rank"]) != \
                (p.world_size, p.workers, steps * p.batch_size):
            return False
        parts, _ = train_plan(self.stream.shards, epoch, p.seed, p.world_size, p.workers, p.batch_size)
        counts = [sum(self.stream.shards.counts[i] for i in part) // p.batch_size for part in parts[p.rank]]
        self.stream.skip[:] = torch.tensor(batches_before(counts, steps))
        self.stream.skip_epoch[0] = epoch
        return True

    def __len__(self):
        return self.steps

    def __iter__(self):
        for step, batch in enumerate(self.loader):
            if step == self.steps:
                break
            yield batch
