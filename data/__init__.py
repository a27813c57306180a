"""Data sets, the train/validation split and the per-rank loaders. No Horovod here: ranks are arguments."""
import multiprocessing
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

from torch.utils.data import DataLoader, DistributedSampler, Subset

from data import cifar, mnist, shards, stl10
from data.digits import load_digits_dataset
from data.errors import BadSampleError, DataError
from data.preprocessing import Preprocessing, class_names, describe
from data.samplers import ShardSampler
from data.split import split_indices
from data.synthetic import SyntheticDataset


@dataclass(frozen=True)
class Builtin:
    """A data set that ships: what it tells the model (None where the config decides) and how it is read."""
    channels: Optional[int]
    classes: Optional[int]
    size: int                                # native image size
    load: Optional[Callable] = None          # (data_dir, image_size) -> (train, test), for the files on disk
    download: Optional[Callable] = None      # (data_dir) -> None, for --download


DATASETS = {
    "digits": Builtin(1, 10, 8),
    "synthetic": Builtin(None, None, 224),
    "mnist": Builtin(1, 10, 28, partial(mnist.load, mnist.MNIST), partial(mnist.download, mnist.MNIST)),
    "fashion_mnist": Builtin(1, 10, 28, partial(mnist.load, mnist.FASHION_MNIST),
                             partial(mnist.download, mnist.FASHION_MNIST)),
    "cifar10": Builtin(3, 10, 32, partial(cifar.load, cifar.CIFAR10), partial(cifar.download, cifar.CIFAR10)),
    "cifar100": Builtin(3, 100, 32, partial(cifar.load, cifar.CIFAR100), partial(cifar.download, cifar.CIFAR100)),
    "stl10": Builtin(3, 10, 96, stl10.load, stl10.download),
    "imagefolder": Builtin(3, None, 224),
    "shards": Builtin(None, None, 0),  # the facts come from the shard index
}

__all__ = ["DATASETS", "BadSampleError", "DataError", "DataInfo", "LoaderSpec", "build_datasets", "build_loaders",
           "check_world", "download_fn", "is_streamed", "users_datasets"]
IMAGE_FACTS = ("in_channels", "num_classes", "image_size")


@dataclass
class DataInfo:
    """What the model and the run need to know about the data. None: the data set does not say (non-image data)."""
    in_channels: Optional[int]
    num_classes: Optional[int]
    image_size: Optional[int]
    num_train: int
    num_val: int
    extra: dict = field(default_factory=dict)  # a user's data set's other facts (vocab_size, block_size, ...)
    classes: Optional[list] = None  # the classes' names in label order, where the data set knows them
    preprocessing: Optional[Preprocessing] = None  # how an image file becomes a validation sample (predict, exports)

    def facts(self):
        """The facts a model factory may name as parameters: the known image facts and the extra ones."""
        known = {name: getattr(self, name) for name in IMAGE_FACTS if getattr(self, name) is not None}
        return {**known, **self.extra}


@dataclass
class LoaderSpec:
    batch_size: int           # samples per rank per step
    seed: int                 # the shuffle's seed, the same on every rank
    workers: int = 0          # DataLoader worker processes per rank
    pin_memory: bool = False  # page-locked batches (GPUs)
    image_size: int = 0       # tar shards: the size images are brought to (0: the index's)
    shuffle_buffer: int = 1000  # tar shards: samples held to shuffle the stream


def download_fn(name):
    """The function that fetches data set `name` into a directory, or None where nothing is downloaded."""
    return DATASETS[name].download


def build_datasets(dc):
    """The train and validation sets described by a DataConfig, split the same way on every rank."""
    if dc.dataset not in DATASETS:
        raise DataError(f"unknown data set {dc.dataset!r}; choose one of: {', '.join(sorted(DATASETS))} (--dataset)")
    if dc.dataset == "shards":
        return shard_sets(dc)
    builtin = DATASETS[dc.dataset]
    channels, classes, size = builtin.channels, builtin.classes, dc.image_size or builtin.size
    presplit = True
    if dc.dataset == "digits":
        train = val = load_digits_dataset(dc.image_size)
        presplit = False
    elif dc.dataset == "synthetic":
        channels, classes = dc.synthetic_channels, dc.synthetic_classes
        train = SyntheticDataset(dc.synthetic_samples, channels, size, classes, seed=0)
        val = SyntheticDataset(max(1, dc.synthetic_samples // 4), channels, size, classes, seed=1)
    elif builtin.load is not None:
        train, val = builtin.load(dc.data_dir, dc.image_size)
    else:
        from data import imagefolder  # torchvision's datasets take a second to import: only where they are read

        train, val, presplit = imagefolder.load(dc.data_dir, size, dc.skip_bad_files)
        classes = len(train.classes)
    train, val = _held_out(train, val, presplit, dc, f" in {dc.data_dir}")
    return train, val, DataInfo(channels, classes, size, len(train), len(val),
                                classes=class_names(dc.dataset, val), preprocessing=describe(val, size))


def shard_sets(dc):
    """The training and validation ShardSets and their DataInfo, from the shard index."""
    train, val, facts = shards.open_sets(dc)
    size = dc.image_size or facts.get("image_size")
    return train, val, DataInfo(facts.get("in_channels"), facts.get("num_classes"), size, len(train), len(val),
                                classes=class_names(dc.dataset, val), preprocessing=describe(val, size))


def _held_out(train, val, presplit, dc, where):
    """The two sets as given where the data set has its own split; else train's and val's views of the same samples
    cut by dc.val_fraction and dc.split_seed (the same cut on every rank). Both must be non-empty."""
    if not presplit:
        train_idx, val_idx = split_indices(len(train), dc.val_fraction, dc.split_seed)
        train, val = Subset(train, train_idx), Subset(val, val_idx)
    if len(train) == 0 or len(val) == 0:
        raise DataError(f"data set {dc.dataset!r}{where} has {len(train)} training and {len(val)} validation "
                        f"samples; both must be non-empty")
    return train, val


def users_datasets(train, val, facts, dc):
    """(train, val, DataInfo) from a user's data set factory's sets and facts: without a validation set, the
    training set is split by dc.val_fraction and dc.split_seed, as the built-in sets without a split are."""
    train, val = _held_out(train, train if val is None else val, val is not None, dc, "")
    facts = dict(facts)
    # Not for the model factory: what predict and the exports need to feed the model image files.
    named, recorded = class_names(dc.dataset, val, facts), facts.pop("preprocessing", None)
    facts.pop("classes", None)
    image = [facts.pop(name, None) for name in IMAGE_FACTS]
    try:
        preprocessing = Preprocessing.from_dict({"channels": image[0], "image_size": image[2], **recorded}) \
            if recorded else None
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"--dataset={dc.dataset!r}: its facts' 'preprocessing' {recorded!r} is not usable ({e}); "
                        f"give channels, image_size, mean, std and resize (stretch or center_crop)") from None
    return train, val, DataInfo(*image, len(train), len(val), extra=facts, classes=named, preprocessing=preprocessing)


def _worker_context(workers):
    # forkserver: worker processes do not inherit the parent's threads and network state by fork, which some
    # InfiniBand and MPI stacks do not survive. Falls back to the platform default where it is missing.
    if workers == 0:
        return None
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else None


def build_loaders(train_set, val_set, spec, rank, world_size, train_sampler=None):
    """Training shards reshuffled each epoch (call train_sampler.set_epoch), validation shards with no repeats.

    train_sampler replaces the DistributedSampler (elastic runs pass Horovod's ElasticSampler). For tar shards
    the training loader is its own sampler: it plans each epoch when told which it is.
    """
    if is_streamed(train_set):
        return shard_loaders(train_set, val_set, spec, rank, world_size)
    # Horovod: each rank reads its own 1/world_size of the training set; the shared seed makes the shuffles agree.
    if train_sampler is None:
        train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                           seed=spec.seed)
    val_sampler = ShardSampler(len(val_set), rank, world_size)
    common = dict(batch_size=spec.batch_size, num_workers=spec.workers, pin_memory=spec.pin_memory,
                  persistent_workers=spec.workers > 0, multiprocessing_context=_worker_context(spec.workers))
    train_loader = DataLoader(train_set, sampler=train_sampler, **common)
    val_loader = DataLoader(val_set, sampler=val_sampler, **common)
    return train_loader, val_loader, train_sampler


def shard_loaders(train_set, val_set, spec, rank, world_size):
    size = spec.image_size or train_set.facts.get("image_size")
    place = shards.Place(spec.seed, rank, world_size, spec.workers, spec.batch_size)
    loaders = [shards.ShardLoader(split, spec, place, shards.transform_for(split.facts, size, split.train),
                                  _worker_context(spec.workers)) for split in (train_set, val_set)]
    return loaders[0], loaders[1], loaders[0]


def is_streamed(train_set):
    return isinstance(train_set, shards.ShardSet)


def check_world(train_set, world_size, spec):
    """Tar shards: every rank needs whole shards of its own and a full batch from them (data/shards.py)."""
    shards.check_plan(train_set, world_size, spec.batch_size, spec.workers, seed=spec.seed)
