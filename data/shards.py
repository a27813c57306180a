"""WebDataset tar shards: their index, the plan of each epoch, and the loader that streams them to a rank.

For data sets larger than a node, streamed from local disks, http(s):// servers or pipe: commands (the `webdataset`
library opens them), with exact epochs. A shard is a tar of samples, each a group of files with one key:
`000042.png` (or .jpg, ...) and `000042.cls` (the class index as text), or a user's sample in the structure the
index records (arrays read with allow_pickle=False, values as JSON, so a shard cannot run code). The index
(`index.json`, which `hvd-train shard` writes beside the shards: hvd_train/tools/shard.py) gives every shard's
sample count and the facts the model needs (classes, channels, image size, normalization).

Both are data from elsewhere. The index is read with a size bound, and every figure in it is checked before it
sizes anything. A shard is read as webdataset's tar_file_expander reads it, inflated where it is compressed, but
each file is refused before it is read where its tar header declares more than MEMBER_BYTES (a 10 KB sparse tar
can declare 1.5 GB), and each sample's class is checked against the index's facts.

The plan of an epoch follows from the index, the seed and the epoch number alone, so every rank computes the same
one without talking to the others:
- the training shards are shuffled by (seed, epoch) and dealt out: rank r reads shards r, r+W, ... (W ranks), and
  its loader workers split its shards the same way; each reads its shards whole, through a shuffle buffer seeded by
  (seed, epoch, rank, worker), and makes full batches only;
- every rank runs the same number of steps, the fewest full batches any rank holds that epoch, so shards of
  unequal size cannot leave one rank waiting in an allreduce for another that has run out (the samples beyond
  that are left out of that epoch only, and the next epoch's deal differs);
- validation: rank r reads validation shards r, r+W, ... whole, in order, so every sample counts exactly once.

A run resumed within an epoch reads the rest of it as the interrupted run would have, where the epoch's plan is the
one that run had (the same ranks, loader workers and batch): each worker passes over the batches it had given,
reading their samples (the shuffle buffer fills the same way) but neither decoding nor transforming them. With
another plan the epoch starts over. Later epochs follow the plan an uninterrupted run has.
"""
import bz2
import gzip
import io
import json
import lzma
import os
import random
import re
import socket
import subprocess
import tarfile
import urllib.parse
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from hvd_train.data.augment import derived_seed, seed_all, seeded
from hvd_train.data.images import Encoded, as_mode, collate_encoded
from hvd_train.data.workers import stop_signals_from
from hvd_train.errors import UNREADABLE_IMAGE, BadSampleError, DataError, redact_all
from hvd_train.provenance import RecordError, expand, index_facts

if TYPE_CHECKING:
    from _typeshed import SupportsRead
    from PIL import Image

    from hvd_train.data import LoaderSpec
    from hvd_train.data.augment import Augmentation
    from hvd_train.data.images import EncodedBatch

# --------------------------------------------------------------------------------------------------------------------
# Reading


def transform_for(facts: Mapping[str, Any], image_size: int, train: bool,
                  augment: "Optional[tuple[Augmentation, Optional[str]]]" = None) -> Optional[Callable[[Any], Any]]:
    """Photos (written from an image folder) get ImageFolder's transform, on the image's bytes; arrays (CIFAR, MNIST,
    ...) are brought to image_size and, in training, augmented as the data set they were written from is (augment:
    (Augmentation, kind) or None). Both give uint8 images, normalized on the device with the index's mean and std
    (hvd_train/trainer.py). A user's samples (any other data set) take none (None)."""
    from torchvision.transforms import v2 as T

    augmentation, kind = augment or (None, None)
    if facts.get("transform") == "samples":  # a user's samples come back as they were written: nothing to do
        return None
    if facts.get("transform") == "photos":
        from hvd_train.data.folders import transforms

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

    def __init__(self, shards: "ShardSet", place: Place, transform: Optional[Callable[[Any], Any]],
                 shuffle_buffer: int) -> None:
        self.shards, self.place, self.transform, self.shuffle_buffer = shards, place, transform, shuffle_buffer
        self.structure = shards.facts.get("structure") if shards.facts.get("transform") == "samples" else None
        self.epoch = torch.ones(1, dtype=torch.int64).share_memory_()
        self.skip_epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.skip = torch.zeros(max(1, place.workers), dtype=torch.int64).share_memory_()

    def plan(self, epoch: int) -> tuple[list[list[int]], int]:
        """([worker] -> shard indices, steps) of this rank for `epoch`."""
        p = self.place
        parts: list[Any]  # training: [rank][worker] -> shard indices; validation: [worker] -> shard indices
        if self.shards.train:
            parts, steps = train_plan(self.shards, epoch, p.seed, p.world_size, p.workers, p.batch_size)
            return parts[p.rank], steps
        parts = by_worker(deal(list(range(len(self.shards.urls))), p.world_size, p.rank), p.workers)
        return parts, sum(-(-sum(self.shards.counts[i] for i in part) // p.batch_size) for part in parts)

    def __iter__(self) -> Iterator[Any]:
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

    def prepare(self, raw: tuple[dict[str, Any], str], key: tuple[int, ...], in_worker: bool) -> Any:
        """A sample as the model takes it, from its tar fields; a training image's transforms seeded by `key`."""
        sample, url = raw
        if self.structure is not None:
            return rebuild(sample, self.structure, url)
        classes = self.shards.facts.get("num_classes")  # the index's (read_index bounds it): the model's outputs
        classes = classes if type(classes) is int else None
        if self.shards.facts.get("transform") == "photos":  # the transform decodes the bytes (data/images.py)
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

    def transformed(self, image: Any, sample: Mapping[str, Any], url: str) -> Any:
        try:
            # prepare() transforms only an image: the index's transform is photos or arrays, whose transform_for is set
            return cast("Callable[[Any], Any]", self.transform)(image)
        except UNREADABLE_IMAGE as e:  # photos' bytes that do not decode
            raise BadSampleError(f"shard {url}: sample {sample['__key__']} does not decode ({e}); rewrite the "
                                 f"shard") from None

    def samples(self, shard_indices: Iterable[int]) -> Iterator[tuple[dict[str, Any], str]]:
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


def first_batch(shards: "ShardSet", image_size: Optional[int], count: int) -> Any:
    """The first `count` samples of a validation ShardSet, in shard order, prepared and collated as validation
    prepares them (one rank, no loader workers): what `hvd-train export` checks an export on."""
    place = Place(seed=0, rank=0, world_size=1, workers=0, batch_size=count)
    size = image_size or shards.facts.get("image_size")
    # size: the index's image size; None only for a user's samples, which take no transform
    return next(iter(ShardStream(shards, place, transform_for(shards.facts, cast(int, size), False), shuffle_buffer=0)))


def batches_before(counts: Sequence[int], steps: int) -> list[int]:
    """How many batches each loader worker has given when the loader has given `steps`: DataLoader takes one from
    each worker in turn, passing over a worker that has run out (`counts`: each worker's batches)."""
    taken, given = [0] * len(counts), 0
    while given < steps and any(t < c for t, c in zip(taken, counts)):
        for w, count in enumerate(counts):
            if given < steps and taken[w] < count:
                taken[w] += 1
                given += 1
    return taken


def describe(error: BaseException) -> str:
    text = str(error.args[0]) if error.args else type(error).__name__
    return text.split(" @ ")[0]  # webdataset appends the stream's repr


def shuffled(samples: Iterable[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """A shuffle buffer of `size` samples, as webdataset's: streamed data cannot be shuffled whole."""
    buffer = []
    for sample in samples:
        buffer.append(sample)
        if len(buffer) >= size:
            yield buffer.pop(rng.randrange(len(buffer)))
    rng.shuffle(buffer)
    yield from buffer


def collate(batch: Sequence[tuple[Any, Any]]) -> "tuple[Union[torch.Tensor, EncodedBatch], torch.Tensor]":
    if isinstance(batch[0][0], Encoded):  # photos left for the device to decode (--data.decode)
        return collate_encoded(batch)
    return torch.stack([image for image, _ in batch]), torch.tensor([label for _, label in batch])


# --------------------------------------------------------------------------------------------------------------------
# Loaders: what fit_epochs() needs of a training loader (len, iter) and of a sampler (set_epoch), in one object


class ShardLoader:
    """One split's loader for one rank. Training: len() is the steps every rank runs this epoch, and iterating
    yields exactly that many full batches."""

    def __init__(self, shards: "ShardSet", spec: "LoaderSpec", place: Place,
                 transform: Optional[Callable[[Any], Any]], context: Optional[str]) -> None:
        self.stream = ShardStream(shards, place, transform, spec.shuffle_buffer)
        # Its own generator: the loader's seed draw leaves the training process's random numbers (dropout) alone.
        # Seeded by seed + rank: each rank's workers their own base seed (torch adds each worker's id).
        self.loader = DataLoader(self.stream, batch_size=None, num_workers=spec.workers, pin_memory=spec.pin_memory,
                                 persistent_workers=spec.workers > 0, multiprocessing_context=context,
                                 worker_init_fn=stop_signals_from(os.getpid()),
                                 generator=torch.Generator().manual_seed(place.seed + place.rank))
        self.set_epoch(1)

    def set_epoch(self, epoch: int) -> None:
        self.stream.epoch[0] = epoch
        self.steps = self.stream.plan(epoch)[1]
        if self.stream.shards.train and self.steps == 0:  # an epoch no rank can train: the refusal says why
            p = self.stream.place
            check_plan(self.stream.shards, p.world_size, p.batch_size, p.workers, epoch, p.seed)
        if int(self.stream.skip_epoch[0]) == epoch:
            self.steps -= int(self.stream.skip.sum())

    def continue_epoch(self, epoch: int, steps: int, position: Mapping[str, Any]) -> bool:
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

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Any]:
        for step, batch in enumerate(self.loader):
            if step == self.steps:
                break
            yield batch


INDEX = "index.json"
INDEX_MAX_BYTES = 64 * 2**20  # read from a file or a server: bounded before it is parsed
MAX_SHARD_SAMPLES = 10**8  # samples one shard may claim (a tar of 100 million images is far past any writer's)
FORMAT = "hvd-train shards"


@dataclass(frozen=True)
class ShardSet:
    """One split's shards: their URLs, in the order given, and the sample count of each (from the index)."""
    urls: tuple
    counts: tuple
    facts: dict
    train: bool
    augment: Optional[tuple] = None  # training: (data.augment.Augmentation, kind of images) the loader transforms with

    def __len__(self) -> int:
        return sum(self.counts)


def shard_name(url: str) -> str:
    """The name a shard has in the index: the file name at the end of a path, URL or pipe: command."""
    last = url.split()[-1].strip("'\"") if url.startswith("pipe:") else url
    return os.path.basename(last.split("?")[0])


def default_index(pattern: str) -> Optional[str]:
    """index.json beside the first shard; a pipe: command has no "beside" and must name its index."""
    first = expand(pattern)[0]
    if first.startswith("pipe:"):
        return None
    return first.rsplit("/", 1)[0] + "/" + INDEX if "/" in first else INDEX


# curl as webdataset runs it for http(s)://, except that the URL goes in through curl's config on stdin: a token in
# the URL (?token=...) would otherwise be in curl's command line, which every user of the machine sees (ps).
CURL = ("curl", "--config", "-", "--connect-timeout", "30", "--retry", "30", "--retry-delay", "2", "-f", "-s", "-L")


def open_location(url: str) -> IO[bytes]:
    """A stream of the shard or index at `url`, as webdataset's gopen opens it; http(s):// through CURL."""
    from webdataset.gopen import Pipe, gopen

    if urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https"):
        return gopen(url)
    if any(c in url for c in "\r\n\0"):
        raise ValueError("a URL with a line break or NUL in it")
    pipe = Pipe(list(CURL), mode="rb", stdin=subprocess.PIPE, ignore_status=[141, 23])
    quoted = url.replace("\\", "\\\\").replace('"', '\\"')
    pipe.proc.stdin.write(f'url = "{quoted}"\n'.encode())
    pipe.proc.stdin.close()
    return pipe


def read_index(location: str) -> dict[str, Any]:
    """{'shards': {name: count}, 'facts': {...}} from a local path, http(s):// URL or pipe: command."""
    try:
        with open_location(location) as f:
            text = f.read(INDEX_MAX_BYTES + 1)
        if len(text) > INDEX_MAX_BYTES:
            raise DataError(f"shard index {location}: larger than {INDEX_MAX_BYTES // 2**20} MB, far more than an "
                            f"index of a million shards takes; it is not one `hvd-train shard` wrote")
        index = json.loads(text)
    except RecursionError:  # json nests recursively
        raise DataError(f"shard index {location}: its values nest thousands of levels deep; it is not one "
                        f"`hvd-train shard` wrote") from None
    except (OSError, ValueError) as e:  # a missing file, a failed download, text that is not JSON
        if isinstance(e, DataError):
            raise
        why = unreachable(location) or f"cannot read it ({e})"
        raise DataError(f"shard index {location}: {why}; write shards and their index with "
                        f"`hvd-train shard`, or name the index with --data.shard_index") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("shards"), dict) \
            or not isinstance(index.get("facts"), dict):
        raise DataError(f"shard index {location}: not an hvd-train shard index (written by `hvd-train shard`)")
    try:  # the gate (hvd_train/provenance.py): every fact typed and bounded, the data set's own facts plain, harmless
        index_facts(index["facts"], f"shard index {redact_all(location)}")
    except RecordError as e:
        raise DataError(str(e)) from None
    wrong = [n for n, c in index["shards"].items() if type(c) is not int or not 0 <= c <= MAX_SHARD_SAMPLES]
    if wrong:
        raise DataError(f"shard index {location}: shard {wrong[0]}'s sample count {index['shards'][wrong[0]]!r} is "
                        f"not a whole number from 0 to {MAX_SHARD_SAMPLES}; rewrite the index with `hvd-train shard`")
    return index


def open_split(pattern: str, index: Mapping[str, Any], location: str, train: bool) -> ShardSet:
    urls = expand(pattern)
    missing = [shard_name(u) for u in urls if shard_name(u) not in index["shards"]]
    if missing:
        raise DataError(f"shard index {location} has no entry for {', '.join(missing[:3])}"
                        f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}: the pattern names shards "
                        f"that index does not list; check the pattern, or rewrite the index with `hvd-train shard`")
    local = [u for u in urls if "://" not in u and not u.startswith("pipe:") and not os.path.isfile(u)]
    if local:
        raise DataError(f"shard {local[0]} does not exist{f' (and {len(local) - 1} more)' if len(local) > 1 else ''}"
                        f"; check --data.{'train' if train else 'val'}_shards")
    return ShardSet(tuple(urls), tuple(int(index["shards"][shard_name(u)]) for u in urls), index["facts"], train)


def open_sets(train_shards: str, val_shards: str, shard_index: str = ""
              ) -> tuple[ShardSet, ShardSet, dict[str, Any]]:
    """(train ShardSet, val ShardSet, facts) for --dataset shards."""
    for name, value in (("train_shards", train_shards), ("val_shards", val_shards)):
        if not value:
            raise DataError(f"--dataset shards needs --data.{name}: a shard path, URL or pipe: command, with "
                            f"braces for a range, e.g. 'shards/{name[:-7]}-{{000000..000009}}.tar'")
        try:
            expand(value)
        except (DataError, RecursionError) as e:  # braceexpand recurses once per nested brace
            raise DataError(f"--data.{name} {redact_all(value)[:200]!r}: {e or 'its braces nest too deeply'}") \
                from None
    location = shard_index or default_index(train_shards)
    if location is None:
        raise DataError("--data.train_shards is a pipe: command: name the shard index with --data.shard_index")
    index = read_index(location)
    return open_split(train_shards, index, location, True), open_split(val_shards, index, location, False), \
        index["facts"]


# --------------------------------------------------------------------------------------------------------------------
# The plan of an epoch


def deal(items: Sequence[int], parts: int, offset: int) -> list[int]:
    return list(items[offset::parts])


def by_worker(items: Sequence[int], workers: int) -> list[list[int]]:
    """items dealt to a rank's loader workers (one reader where there are none)."""
    return [deal(items, max(1, workers), w) for w in range(max(1, workers))]


def train_plan(shards: ShardSet, epoch: int, seed: int, world_size: int, workers: int,
               batch_size: int) -> tuple[list[list[list[int]]], int]:
    """[rank][worker] -> shard indices for this epoch, and the steps every rank runs."""
    order = list(range(len(shards.urls)))
    random.Random(f"{seed}:{epoch}").shuffle(order)  # a str seed hashes the same in every process
    per_rank = [deal(order, world_size, r) for r in range(world_size)]
    per_worker = [by_worker(mine, workers) for mine in per_rank]
    batches = [sum(sum(shards.counts[i] for i in part) // batch_size for part in parts) for parts in per_worker]
    return per_worker, min(batches)


def check_plan(shards: ShardSet, world_size: int, batch_size: int, workers: int, epoch: int = 1,
               seed: int = 0) -> None:
    """Refuse a job whose ranks cannot all train: fewer shards than ranks, or an epoch without a full batch. Every
    rank reaches the same verdict (the plan is the same everywhere), so they all stop together."""
    if len(shards.urls) < world_size:
        raise DataError(f"{len(shards.urls)} training shard(s) cannot feed {world_size} ranks: each rank reads "
                        f"whole shards; write at least {world_size} (hvd-train shard --shard-size smaller)")
    _, steps = train_plan(shards, epoch, seed, world_size, workers, batch_size)
    if steps == 0:
        raise DataError(f"a step takes {batch_size} samples per rank, but in epoch {epoch} some rank's shards (or "
                        f"one of its loader workers' shards) hold fewer; lower --batch-size or --workers, or write "
                        f"larger shards")


def unreachable(url: str) -> Optional[str]:
    """Why the server of an http(s):// shard cannot be reached (curl then gives webdataset an empty stream, which
    reads as an empty file), or None where it answers or the shard is not on a server."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=10).close()
    except OSError as e:
        return (f"the server {parts.hostname}:{port} does not answer ({e.strerror or e}); check that it runs and "
                f"that this host can reach it")
    return None


IMAGE_KEYS = ("png", "jpg", "jpeg", "ppm", "bmp", "pgm", "tif", "tiff", "webp")


def rebuild(sample: Mapping[str, Any], shape: Any, url: str, prefix: str = "") -> Any:
    """A user's sample from its tar fields and the structure the index records (hvd_train/tools/shard.py): arrays
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


def encoded(sample: Mapping[str, Any], url: str, num_classes: Optional[int] = None) -> tuple[bytes, int, str]:
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


def decode(sample: Mapping[str, Any], url: str, channels: int, num_classes: Optional[int] = None
           ) -> tuple["Image.Image", int]:
    """(PIL image, class) from one tar sample."""
    from PIL import Image

    data, label, image_key = encoded(sample, url, num_classes)
    try:
        with Image.open(io.BytesIO(data)) as image:
            return as_mode(image, "L" if channels == 1 else "RGB"), label
    except UNREADABLE_IMAGE as e:
        raise BadSampleError(f"shard {url}: sample {sample['__key__']}.{image_key} does not decode ({e}); rewrite "
                             f"the shard") from None


# A shard is data from elsewhere, and each of its files is read into memory whole: a file whose tar header declares
# more than this is refused before it is read (a 10 KB sparse tar, or a 1.4 MB gzip of zeros, can declare 1.5 GB).
MEMBER_BYTES = 256 * 2**20
MEMBER_BYTES_VARIABLE = "HVD_MAX_SHARD_MEMBER_BYTES"  # raises (or lowers) that bound, in bytes
# What tarfile may read for a member's own headers (pax records, GNU long names), which it holds whole: names and
# attributes take a few hundred bytes in any shard a writer makes.
HEADER_BYTES = 2**20


def member_bound() -> int:
    """The most bytes one file of a shard may hold: MEMBER_BYTES, or HVD_MAX_SHARD_MEMBER_BYTES where it is set."""
    text = os.environ.get(MEMBER_BYTES_VARIABLE, "").strip()
    if not text:
        return MEMBER_BYTES
    if not text.isdigit() or not 1 <= int(text) <= 2**50:
        raise BadSampleError(f"{MEMBER_BYTES_VARIABLE}={text[:40]!r}: give the most bytes one file of a shard may "
                             f"hold, a whole number from 1 (default {MEMBER_BYTES:,})")
    return int(text)


def too_large(shown: str, what: str, size: int, bound: int) -> BadSampleError:
    return BadSampleError(f"shard {shown}: {what} {size:,} bytes, more than the {bound:,} one file of a shard may "
                          f"take here; it is refused unread. If you trust this shard, raise the bound with "
                          f"{MEMBER_BYTES_VARIABLE}")


class Inflated:
    """A shard's bytes as tarfile reads them, after any decompression, counted as they are read: tarfile holds a
    member's headers whole (pax records, long names) before any header can be checked, so between two members it
    may read that member's declared size and HEADER_BYTES of the next one's headers, no more."""

    def __init__(self, stream: "SupportsRead[bytes]", shown: str, bound: int) -> None:
        self.stream, self.shown, self.bound = stream, shown, bound
        self.count, self.limit = 0, HEADER_BYTES

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.count += len(data)
        if self.count > self.limit:  # the member's data is within its declared size: the headers after it are not
            raise BadSampleError(f"shard {self.shown}: a member's headers (pax records, long names) take more than "
                                 f"{HEADER_BYTES:,} bytes, which tarfile would hold whole; no shard writer makes "
                                 f"those, and the shard is refused before they are read; rewrite it with "
                                 f"`hvd-train shard`")
        return data

    def member(self, size: int) -> None:
        """tarfile has read a member's header, which declares `size` bytes: its data and the next headers may come."""
        self.limit = self.count + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE + HEADER_BYTES


class Prefixed:
    """A stream whose first bytes were read (to tell its compression) and are given again."""

    def __init__(self, stream: "SupportsRead[bytes]", head: bytes) -> None:
        self.stream, self.head = stream, head

    def read(self, size: int = -1) -> bytes:
        if not self.head:
            return self.stream.read(size)
        if size is None or size < 0:
            data, self.head = self.head + self.stream.read(), b""
            return data
        data, self.head = self.head[:size], self.head[size:]
        return data


def uncompressed(stream: "SupportsRead[bytes]") -> "SupportsRead[bytes]":
    """`stream` inflated where it is compressed as tarfile's "r|*" tells (gzip, bzip2, xz), read as it is read."""
    head = b""
    while len(head) < 6:
        more = stream.read(6 - len(head))
        if not more:
            break
        head += more
    stream = Prefixed(stream, head)
    # The casts: typeshed asks these readers' files for seek() and tell(), which reading a stream through never calls
    if head.startswith(b"\x1f\x8b\x08"):
        return gzip.GzipFile(fileobj=cast("IO[bytes]", stream), mode="rb")
    if head.startswith(b"BZh"):
        return bz2.BZ2File(cast("IO[bytes]", stream))
    if head.startswith((b"\xfd7zXZ", b"\x5d\x00\x00\x80")):
        return lzma.LZMAFile(cast("IO[bytes]", stream))
    return stream


META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata files, which it skips


def tar_files(url: str, bound: int) -> Iterator[dict[str, Any]]:
    """{"fname", "data", "__url__"} of each regular file of the tar shard at `url`, then {} (webdataset's
    tar_file_expander, for its group_by_keys), each file bounded: refused (BadSampleError, naming the shard and the
    bound) where its header declares more than `bound` bytes, before it is read, and the inflated stream counted as
    it is read (Inflated)."""
    shown = redact_all(url)
    counted = Inflated(uncompressed(open_location(url)), shown, bound)
    stream = tarfile.open(fileobj=cast("IO[bytes]", counted), mode="r|")  # read as a stream: never seeks or writes
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
        # a regular member (isreg() above) always has a reader
        yield {"fname": info.name, "data": cast("IO[bytes]", stream.extractfile(info)).read(), "__url__": url}
        # as webdataset: a stream of a million members keeps none of them
        stream.members = []  # type: ignore[attr-defined]  # tarfile's own list, which typeshed does not declare
    yield {}
