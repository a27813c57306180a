"""Data sets, the train/validation split and the per-rank loaders. No Horovod here: ranks are arguments."""
from dataclasses import dataclass

from torch.utils.data import DataLoader, DistributedSampler, Subset

from data.digits import load_digits_dataset
from data.samplers import ShardSampler
from data.split import split_indices

# name -> (loader of the full data set, in_channels, num_classes, image_size)
DATASETS = {
    "digits": (load_digits_dataset, 1, 10, 8),
}


@dataclass
class DataInfo:
    in_channels: int
    num_classes: int
    image_size: int
    num_train: int
    num_val: int


def build_datasets(name, val_fraction, split_seed):
    """The train and validation subsets of data set `name`, split the same way on every rank."""
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; choose one of: {', '.join(sorted(DATASETS))} (--dataset)")
    load, in_channels, num_classes, image_size = DATASETS[name]
    full = load()
    train_idx, val_idx = split_indices(len(full), val_fraction, split_seed)
    info = DataInfo(in_channels, num_classes, image_size, len(train_idx), len(val_idx))
    return Subset(full, train_idx), Subset(full, val_idx), info


def build_loaders(train_set, val_set, batch_size, rank, world_size, seed, workers=0, pin_memory=False):
    """Training shards reshuffled each epoch (call train_sampler.set_epoch), validation shards with no repeats."""
    # Horovod: each rank reads its own 1/world_size of the training set; the shared seed makes the shuffles agree.
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    val_sampler = ShardSampler(len(val_set), rank, world_size)
    common = dict(batch_size=batch_size, num_workers=workers, pin_memory=pin_memory,
                  persistent_workers=workers > 0)
    train_loader = DataLoader(train_set, sampler=train_sampler, **common)
    val_loader = DataLoader(val_set, sampler=val_sampler, **common)
    return train_loader, val_loader, train_sampler
