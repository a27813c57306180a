"""WebDataset tar shards: data sets larger than a node, streamed from local disks, http(s):// servers or pipe:
commands (the `webdataset` library opens and unpacks them), with exact epochs.

A shard is a tar of samples, each a group of files with one key: `000042.png` (or .jpg, ...) and `000042.cls` (the
class index as text). An index (`hvd-train shard` writes `index.json` beside the shards) gives every shard's
sample count and the facts the model needs (classes, channels, image size, normalization).

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
import bz2
import gzip
import io
import json
import lzma
import os
import random
import re
import tarfile
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from hvd_train.data import photos
from hvd_train.data.augment import derived_seed, seed_all, seeded
from hvd_train.data.errors import UNREADABLE_IMAGE, BadSampleError
from hvd_train.data.images import as_mode
from hvd_train.data.shard_index import by_worker, check_plan, deal, open_location, train_plan, unreachable
from hvd_train.data.workers import stop_signals_from
from hvd_train.uris import redact_all

IMAGE_KEYS = ("png", "jpg", "jpeg", "ppm", "bmp", "pgm", "tif", "tiff", "webp")
# A shard is data from elsewhere, and each of its files is read into memory whole: a file whose tar header declares
# more than this is refused before it is read (a 10 KB sparse tar, or a 1.4 MB gzip of zeros, can declare 1.5 GB).
MEMBER_BYTES = 256 * 2**20
MEMBER_BYTES_VARIABLE = "HVD_MAX_SHARD_MEMBER_BYTES"  # raises (or lowers) that bound, in bytes
# What tarfile may read for a member's own headers (pax records, GNU long names), which it holds whole: names and
# attributes take a few hundred bytes in any shard a writer makes.
HEADER_BYTES = 2**20


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


def rebuild(sample, shape, url, prefix=""):
    """A user's sample from its tar fields and the structure the index records (data/shard_writer.py): arrays
    read with allow_pickle=False, values as JSON, so a shard cannot run code."""
    if shape == "leaf":
        try:
            if prefix + "npy" in sample:
                return torch.from_numpy(np.load(io.BytesIO(sample[prefix + "npy"]), allow_pickle=False))
            return json.loads(sample[prefix + "json"])
        except KeyError:
            raise BadSampleError(f"shard {url}: sample {sample.get('__key__')} has no field {prefix}npy or "
                                 f"{prefix}json, which the index's structure names; rewrite the shard") from None
        except ValueError as e:
            raise BadSampleError(f"shard {url}: sample {sample.get('__key__')}.{prefix}*: {e}") from None
    kind, parts = shape
    if kind == "dict":
        return {k: rebuild(sample, v, url, f"{prefix}{k}.") for k, v in parts.items()}
    items = [rebuild(sample, v, url, f"{prefix}{j}.") for j, v in enumerate(parts)]
    return tuple(items) if kind == "tuple" else items


def encoded(sample, url, num_classes=None):
    """(image bytes, class, the image's field) from one tar sample; the class is a whole number from 0 to
    num_classes - 1 (the index's facts), else BadSampleError naming the sample: the loss would fail on it mid-epoch."""
    image_key = next((k for k in IMAGE_KEYS if k in sample), None)
    if image_key is None or "cls" not in sample:
        files = sorted(k for k in sample if not k.startswith("__"))
        raise BadSampleError(f"shard {url}: sample {sample.get('__key__')} has {files}; each needs an image "
                             f"({', '.join(IMAGE_KEYS[:3])}, ...) and a .cls file")
    try:
        label = int(sample["cls"])
    except ValueError:  # not a number, or one of more digits than Python converts
        raise BadSampleError(f"shard {redact_all(url)}: sample {str(sample.get('__key__'))[:200]}.cls holds "
                             f"{bytes(sample['cls'][:40])!r}, not a class number; rewrite the shard") from None
    if num_classes is not None and not 0 <= label < num_classes:
        raise BadSampleError(f"shard {redact_all(url)}: sample {str(sample.get('__key__'))[:200]} has class "
                             f"{label}, outside 0 to {num_classes - 1} (the index's facts say num_classes "
                             f"{num_classes}); rewrite the shard or its index with `hvd-train shard`")
    return sample[image_key], label, image_key


def decode(sample, url, channels, num_classes=None):
    """(PIL image, class) from one tar sample."""
    from PIL import Image

    data, label, image_key = encoded(sample, url, num_classes)
    try:
        with Image.open(io.BytesIO(data)) as image:
            return as_mode(image, "L" if channels == 1 else "RGB"), label
    except UNREADABLE_IMAGE as e:
        raise BadSampleError(f"shard {url}: sample {sample['__key__']}.{image_key} does not decode ({e}); rewrite "
                             f"the shard") from None


def member_bound():
    """The most bytes one file of a shard may hold: MEMBER_BYTES, or HVD_MAX_SHARD_MEMBER_BYTES where it is set."""
    text = os.environ.get(MEMBER_BYTES_VARIABLE, "").strip()
    if not text:
        return MEMBER_BYTES
    if not text.isdigit() or not 1 <= int(text) <= 2**50:
        raise BadSampleError(f"{MEMBER_BYTES_VARIABLE}={text[:40]!r}: give the most bytes one file of a shard may "
                             f"hold, a whole number from 1 (default {MEMBER_BYTES:,})")
    return int(text)


def too_large(shown, what, size, bound):
    return BadSampleError(f"shard {shown}: {what} {size:,} bytes, more than the {bound:,} one file of a shard may "
                          f"take here; it is refused unread. If you trust this shard, raise the bound with "
                          f"{MEMBER_BYTES_VARIABLE}")


class Inflated:
    """A shard's bytes as tarfile reads them, after any decompression, counted as they are read: tarfile holds a
    member's headers whole (pax records, long names) before any header can be checked, so between two members it
    may read that member's declared size and HEADER_BYTES of the next one's headers, no more."""

    def __init__(self, stream, shown, bound):
        self.stream, self.shown, self.bound = stream, shown, bound
        self.count, self.limit = 0, HEADER_BYTES

    def read(self, size=-1):
        data = self.stream.read(size)
        self.count += len(data)
        if self.count > self.limit:  # the member's data is within its declared size: the headers after it are not
            raise BadSampleError(f"shard {self.shown}: a member's headers (pax records, long names) take more than "
                                 f"{HEADER_BYTES:,} bytes, which tarfile would hold whole; no shard writer makes "
                                 f"those, and the shard is refused before they are read; rewrite it with "
                                 f"`hvd-train shard`")
        return data

    def member(self, size):
        """tarfile has read a member's header, which declares `size` bytes: its data and the next headers may come."""
        self.limit = self.count + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE + HEADER_BYTES


class Prefixed:
    """A stream whose first bytes were read (to tell its compression) and are given again."""

    def __init__(self, stream, head):
        self.stream, self.head = stream, head

    def read(self, size=-1):
        if not self.head:
            return self.stream.read(size)
        if size is None or size < 0:
            data, self.head = self.head + self.stream.read(), b""
            return data
        data, self.head = self.head[:size], self.head[size:]
        return data


def uncompressed(stream):
    """`stream` inflated where it is compressed as tarfile's "r|*" tells (gzip, bzip2, xz), read as it is read."""
    head = b""
    while len(head) < 6:
        more = stream.read(6 - len(head))
        if not more:
            break
        head += more
    stream = Prefixed(stream, head)
    if head.startswith(b"\x1f\x8b\x08"):
        return gzip.GzipFile(fileobj=stream, mode="rb")
    if head.startswith(b"BZh"):
        return bz2.BZ2File(stream)
    if head.startswith((b"\xfd7zXZ", b"\x5d\x00\x00\x80")):
        return lzma.LZMAFile(stream)
    return stream


META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata files, which it skips


def tar_files(url, bound):
    """{"fname", "data", "__url__"} of each regular file of the tar shard at `url`, then {} (webdataset's
    tar_file_expander, for its group_by_keys), each file bounded: refused (BadSampleError, naming the shard and the
    bound) where its header declares more than `bound` bytes, before it is read, and the inflated stream counted as
    it is read (Inflated)."""
    shown = redact_all(url)
    counted = Inflated(uncompressed(open_location(url)), shown, bound)
    stream = tarfile.open(fileobj=counted, mode="r|")
    for info in stream:
        if info.size > bound:
            raise too_large(shown, f"member {info.name[:200]!r} declares", info.size, bound)
        counted.member(info.size)
        if info.issparse():  # holes tarfile fills with zeros: a few bytes of file for any size; no writer makes one
            raise BadSampleError(f"shard {shown}: member {info.name[:200]!r} is a sparse file, which no shard writer "
                                 f"makes; rewrite the shard with `hvd-train shard`")
        meta = META.match(info.name) or ("/" not in info.name and info.name.startswith("__")
                                         and info.name.endswith("__"))
        if not info.isreg() or meta:
            continue
        yield {"fname": info.name, "data": stream.extractfile(info).read(), "__url__": url}
        stream.members = []  # as webdataset: a stream of a million members keeps none of them
    yield {}


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
