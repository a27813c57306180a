"""The data set --dataset names, built the one way for those that ship (data/catalog.py) and the user's own. No
Horovod here: `hvd-train shard` and the loader benchmark build data sets outside a job."""
import dataclasses

from torch.utils.data import IterableDataset

from hvd_train import data
from hvd_train.data import datasets_from, is_streamed
from hvd_train.data.augment import seeded
from hvd_train.errors import ConfigError
from hvd_train.plugins import arguments, resolve, takes


def dataset_factory(name):
    """The factory --dataset names: one that ships (data/catalog.py) or the user's package.module:name."""
    return resolve(name, data.find_dataset, "--dataset", data.CHOICES)


def dataset_settings(dc, seed, augment=None):
    """What a data set factory may name as parameters: the data.* settings (image_size only where it is set, so that
    the factory's default, the data set's own size, applies otherwise), the run's seed and, for training, the
    augmentation (a data.augment.Augmentation; without one the factory's default, none, applies)."""
    settings = {f.name: getattr(dc, f.name) for f in dataclasses.fields(dc) if f.name not in ("dataset", "args")}
    if not dc.image_size:
        del settings["image_size"]
    if augment is not None:
        settings["augment"] = augment
    return {**settings, "seed": seed}


def build_datasets(dc, seed=0, augment=None):
    """The factory --dataset names, called with the settings it names and --data-args; it returns (train, val) or
    (train, val, facts), val None for the app's split. augment: the training run's Augmentation (tools that read a
    data set, such as hvd-train shard, pass none and get the samples as they are)."""
    name, factory = dc.dataset, dataset_factory(dc.dataset)
    kwargs = arguments(factory, dataset_settings(dc, seed, augment), dc.args, "--data-args", name)
    # Every rank makes the same data: a factory that draws from Python's, NumPy's or torch's global generator
    # draws from them seeded with the shared seed, not each rank's own (seed + rank), which continues after it.
    with seeded(seed):
        made = factory(**kwargs)
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 3) or \
            (len(made) == 3 and not isinstance(made[2], dict)):
        raise ConfigError(f"--dataset={name!r}: the factory must return (train, val) or (train, val, facts) with "
                          f"facts a dict such as {{'num_classes': 10}}; it returned {_describe(made)}")
    for split, dataset in zip(("training", "validation"), made[:2]):
        if (split == "validation" and dataset is None) or is_streamed(dataset):
            continue  # the app splits the training set; tar shards are planned by data/shard_index.py
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") or \
                not hasattr(dataset, "__getitem__"):
            raise ConfigError(f"--dataset={name!r}: the {split} set ({type(dataset).__name__}) has no __len__ and "
                              f"__getitem__: hvd-train shards a data set by index (DistributedSampler), so it must "
                              f"be map-style; wrap a stream in a map-style Dataset, or shard its files yourself")
    where = f" in {dc.data_dir}" if takes(factory, "data_dir") else ""
    train, val, info = datasets_from(made[0], made[1], made[2] if len(made) == 3 else {}, dc, where)
    info.called_with = kwargs  # what the setup's data line shows (hvd_train/run/setup_lines.py)
    return train, val, info


def _describe(value):
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"
