"""Data sets, the train/validation split and the per-rank loaders. No Horovod here: ranks are arguments."""
import multiprocessing
from dataclasses import dataclass, field
from typing import Optional

from torch.utils.data import DataLoader, DistributedSampler, Subset

from data import cifar10, imagefolder, mnist, stl10
from data.digits import load_digits_dataset
from data.errors import BadSampleError, DataError
from data.samplers import ShardSampler
from data.split import split_indices
from data.synthetic import SyntheticDataset

# name -> (channels, classes, native image size, download function or None); None where the config decides
DATASETS = {
    "digits": (1, 10, 8, None),
    "synthetic": (None, None, 224, None),
    "mnist": (1, 10, 28, mnist.download),
    "cifar10": (3, 10, 32, cifar10.download),
    "stl10": (3, 10, 96, stl10.download),
    "imagefolder": (3, None, 224, None),
}

__all__ = ["DATASETS", "BadSampleError", "DataError", "DataInfo", "LoaderSpec", "build_datasets", "build_loaders",
           "download_fn", "users_datasets"]
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


def download_fn(name):
    """The function that fetches data set `name` into a directory, or None where nothing is downloaded."""
    return DATASETS[name][3]


def build_datasets(dc):
    """The train and validation sets described by a DataConfig, split the same way on every rank."""
    if dc.dataset not in DATASETS:
        raise DataError(f"unknown data set {dc.dataset!r}; choose one of: {', '.join(sorted(DATASETS))} (--dataset)")
    channels, classes, native, _ = DATASETS[dc.dataset]
    size = dc.image_size or native
    presplit = True
    if dc.dataset == "digits":
        train = val = load_digits_dataset(dc.image_size)
        presplit = False
    elif dc.dataset == "synthetic":
        channels, classes = dc.synthetic_channels, dc.synthetic_classes
        train = SyntheticDataset(dc.synthetic_samples, channels, size, classes, seed=0)
        val = SyntheticDataset(max(1, dc.synthetic_samples // 4), channels, size, classes, seed=1)
    elif dc.dataset == "mnist":
        train, val = mnist.load(dc.data_dir, dc.image_size)
    elif dc.dataset == "cifar10":
        train, val = cifar10.load(dc.data_dir, dc.image_size)
    elif dc.dataset == "stl10":
        train, val = stl10.load(dc.data_dir, dc.image_size)
    else:
        train, val, presplit = imagefolder.load(dc.data_dir, size, dc.skip_bad_files)
        classes = len(train.classes)
    train, val = _held_out(train, val, presplit, dc, f" in {dc.data_dir}")
    return train, val, DataInfo(channels, classes, size, len(train), len(val))


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
    image = [facts.pop(name, None) for name in IMAGE_FACTS]
    return train, val, DataInfo(*image, len(train), len(val), extra=facts)


def _worker_context(workers):
    # forkserver: worker processes do not inherit the parent's threads and network state by fork, which some
    # InfiniBand and MPI stacks do not survive. Falls back to the platform default where it is missing.
    if workers == 0:
        return None
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else None


def build_loaders(train_set, val_set, spec, rank, world_size, train_sampler=None):
    """Training shards reshuffled each epoch (call train_sampler.set_epoch), validation shards with no repeats.

    train_sampler replaces the DistributedSampler (elastic runs pass Horovod's ElasticSampler).
    """
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
