"""The data sets that ship, each a factory of the same kind as a user's `--dataset package.module:name`.

A factory is called with the settings it names as parameters (`data_dir`, `image_size` where it is set, the
`data.*` fields, the run's `seed`) and returns `(train, val, facts)`: `val` is None where the data set has no split
of its own, and the app holds out `data.val_fraction`. The default of a factory's `image_size` is the data set's
native size. A factory with a `download(data_dir)` attribute is fetched by `--download` (once per host).
"""
import dataclasses
import inspect
from functools import partial

from hvd_train.data import cifar, mnist, stl10
from hvd_train.data.augment import Augmentation
from hvd_train.data.digits import load_digits_dataset
from hvd_train.data.preprocessing import describe
from hvd_train.data.shard_index import open_sets
from hvd_train.data.synthetic import SyntheticDataset


def image_facts(channels, classes, size, val):
    """What a data set of images tells the model and the exports: channels, classes, size and the validation
    preprocessing (from the validation samples themselves)."""
    return {"in_channels": channels, "num_classes": classes, "image_size": size, "preprocessing": describe(val, size)}


def fetched_by(download):
    """Gives a factory the function --download calls to fetch its files into a directory."""
    def attach(factory):
        factory.download = download
        return factory
    return attach


NO_AUGMENTATION = Augmentation(enabled=False)


def digits(image_size=8, augment=NO_AUGMENTATION):
    """scikit-learn's 1,797 8x8 digits (shipped with the package, no files): split by data.val_fraction (the
    training share augmented, the held-out share as it is)."""
    samples = load_digits_dataset(image_size)
    return (samples.augmented(augment, "digits"), samples,
            {**image_facts(1, 10, image_size, samples), "held_out": True})


def synthetic(image_size=224, synthetic_samples=1024, synthetic_channels=3, synthetic_classes=10):
    """Random images for benchmarks and smoke tests; validation gets a quarter as many."""
    train = SyntheticDataset(synthetic_samples, synthetic_channels, image_size, synthetic_classes, seed=0)
    val = SyntheticDataset(max(1, synthetic_samples // 4), synthetic_channels, image_size, synthetic_classes, seed=1)
    return train, val, image_facts(synthetic_channels, synthetic_classes, image_size, val)


def _mnist_like(spec, kind):
    @fetched_by(partial(mnist.download, spec))
    def factory(data_dir, image_size=28, augment=NO_AUGMENTATION):
        train, val = mnist.load(spec, data_dir, image_size)
        return train.augmented(augment, kind), val, image_facts(1, 10, image_size, val)
    return factory


def _cifar(spec, classes):
    @fetched_by(partial(cifar.download, spec))
    def factory(data_dir, image_size=32, augment=NO_AUGMENTATION):
        train, val = cifar.load(spec, data_dir, image_size)
        return train.augmented(augment, "natural"), val, image_facts(3, classes, image_size, val)
    return factory


@fetched_by(stl10.download)
def stl10_set(data_dir, image_size=96, augment=NO_AUGMENTATION):
    train, val = stl10.load(data_dir, image_size)
    return train.augmented(augment, "natural"), val, image_facts(3, 10, image_size, val)


def imagefolder(data_dir, image_size=224, skip_bad_files=False, augment=NO_AUGMENTATION):
    """Class folders, with train/ and val/ or split by data.val_fraction (the same files read twice: training and
    evaluation transforms)."""
    from hvd_train.data import imagefolder as folders  # torchvision's datasets take a second to import: only where read

    train, val, presplit = folders.load(data_dir, image_size, skip_bad_files, augment)
    return train, val, {**image_facts(3, len(train.classes), image_size, val), "held_out": not presplit}


def shard_sets(train_shards="", val_shards="", shard_index="", image_size=0, augment=NO_AUGMENTATION):
    """WebDataset tars written by `hvd-train shard`; the facts come from their index. Training samples are
    augmented as the data set they were written from (the index's source) would be."""
    train, val, facts = open_sets(train_shards, val_shards, shard_index)
    kind = "photos" if facts.get("transform") == "photos" else KIND_OF.get(facts.get("source"))
    train = dataclasses.replace(train, augment=(augment, kind))
    if facts.get("transform") == "samples":  # a user's data set: its own facts, as its factory gave them
        known = {k: facts.get(k) for k in ("in_channels", "num_classes", "image_size") if facts.get(k) is not None}
        named = {"classes": facts["classes"]} if facts.get("classes") else {}
        return train, val, {**(facts.get("extra") or {}), **known, **named}  # the index's own facts win
    size = image_size or facts.get("image_size")
    return train, val, image_facts(facts.get("in_channels"), facts.get("num_classes"), size, val)


DATASETS = {"digits": digits, "synthetic": synthetic, "mnist": _mnist_like(mnist.MNIST, "digits"),
            "fashion_mnist": _mnist_like(mnist.FASHION_MNIST, "natural"), "cifar10": _cifar(cifar.CIFAR10, 10),
            "cifar100": _cifar(cifar.CIFAR100, 100), "stl10": stl10_set, "imagefolder": imagefolder,
            "shards": shard_sets}
# The kind of images each data set holds, which decides its default augmentation (data/augment.py).
KIND_OF = {"digits": "digits", "mnist": "digits", "fashion_mnist": "natural", "cifar10": "natural",
           "cifar100": "natural", "stl10": "natural", "imagefolder": "photos", "shards": "shards",
           "synthetic": "none"}
CHOICES = f"choose one of: {', '.join(DATASETS)}"
# The data sets read from --data-dir.
FROM_FILES = tuple(name for name, factory in DATASETS.items() if "data_dir" in inspect.signature(factory).parameters)


def find_dataset(name):
    """The factory of the data set that ships with this name, or None."""
    return DATASETS.get(name)


def native_size(name):
    """The image size data set `name` has when --image-size is not set (its factory's default)."""
    return inspect.signature(DATASETS[name]).parameters["image_size"].default
