"""The data sets that ship, each a factory of the same kind as a user's `--dataset package.module:name`.

A factory is called with the settings it names as parameters (`data_dir`, `image_size` where it is set, the
`data.*` fields, the run's `seed`) and returns `(train, val, facts)`: `val` is None where the data set has no split
of its own, and the app holds out `data.val_fraction`. The default of a factory's `image_size` is the data set's
native size. A factory with a `download(data_dir)` attribute is fetched by `--download` (once per host).

Most read their files from --data-dir (data/mnist.py, data/cifar.py, data/stl10.py, image folders, tar shards).
Two need none: scikit-learn's bundled handwritten digits (1,797 grey 8x8 images of 0-9, shipped with the package,
no download), and synthetic random images and labels of any shape, made on the fly for benchmarks and smoke tests.
"""
import dataclasses
import gzip
import importlib.util
import inspect
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, cast

import numpy as np
import torch
from torch.utils.data import Dataset

from hvd_train.data import cifar, mnist, stl10
from hvd_train.data.arrays import ImageTensorDataset
from hvd_train.data.augment import Augmentation
from hvd_train.data.images import describe
from hvd_train.data.shards import open_sets

if TYPE_CHECKING:
    from hvd_train.data.folders import ClassFolders
    from hvd_train.data.shards import ShardSet

IMAGE_FACTS = ("in_channels", "num_classes", "image_size")


def image_facts(channels: Optional[int], classes: Optional[int], size: int, val: object) -> dict[str, Any]:
    """What a data set of images tells the model and the exports: channels, classes, size and the validation
    preprocessing (from the validation samples themselves)."""
    return {"in_channels": channels, "num_classes": classes, "image_size": size, "preprocessing": describe(val, size)}


def fetched_by(download: Callable[[str], None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Gives a factory the function --download calls to fetch its files into a directory."""
    def attach(factory):
        factory.download = download
        return factory
    return attach


NO_AUGMENTATION = Augmentation(enabled=False)


def digits(image_size: int = 8, augment: Augmentation = NO_AUGMENTATION
           ) -> tuple[ImageTensorDataset, ImageTensorDataset, dict[str, Any]]:
    """scikit-learn's 1,797 8x8 digits (shipped with the package, no files): split by data.val_fraction (the
    training share augmented, the held-out share as it is)."""
    samples = load_digits_dataset(image_size)
    return (samples.augmented(augment, "digits"), samples,
            {**image_facts(1, 10, image_size, samples), "held_out": True})


def synthetic(image_size: int = 224, synthetic_samples: int = 1024, synthetic_channels: int = 3,
              synthetic_classes: int = 10) -> tuple["SyntheticDataset", "SyntheticDataset", dict[str, Any]]:
    """Random images for benchmarks and smoke tests; validation gets a quarter as many."""
    train = SyntheticDataset(synthetic_samples, synthetic_channels, image_size, synthetic_classes, seed=0)
    val = SyntheticDataset(max(1, synthetic_samples // 4), synthetic_channels, image_size, synthetic_classes, seed=1)
    return train, val, image_facts(synthetic_channels, synthetic_classes, image_size, val)


def _mnist_like(spec: mnist.Idx, kind: str) -> Callable[..., Any]:
    @fetched_by(partial(mnist.download, spec))
    def factory(data_dir: str, image_size: int = 28, augment: Augmentation = NO_AUGMENTATION
                ) -> tuple[ImageTensorDataset, ImageTensorDataset, dict[str, Any]]:
        train, val = mnist.load(spec, data_dir, image_size)
        return train.augmented(augment, kind), val, image_facts(1, 10, image_size, val)
    return factory


def _cifar(spec: cifar.Cifar, classes: int) -> Callable[..., Any]:
    @fetched_by(partial(cifar.download, spec))
    def factory(data_dir: str, image_size: int = 32, augment: Augmentation = NO_AUGMENTATION
                ) -> tuple[ImageTensorDataset, ImageTensorDataset, dict[str, Any]]:
        train, val = cifar.load(spec, data_dir, image_size)
        return train.augmented(augment, "natural"), val, image_facts(3, classes, image_size, val)
    return factory


@fetched_by(stl10.download)
def stl10_set(data_dir: str, image_size: int = 96, augment: Augmentation = NO_AUGMENTATION
              ) -> tuple[ImageTensorDataset, ImageTensorDataset, dict[str, Any]]:
    train, val = stl10.load(data_dir, image_size)
    return train.augmented(augment, "natural"), val, image_facts(3, 10, image_size, val)


def imagefolder(data_dir: str, image_size: int = 224, skip_bad_files: bool = False,
                augment: Augmentation = NO_AUGMENTATION) -> tuple["ClassFolders", "ClassFolders", dict[str, Any]]:
    """Class folders, with train/ and val/ or split by data.val_fraction (the same files read twice: training and
    evaluation transforms)."""
    from hvd_train.data.folders import load

    train, val, presplit = load(data_dir, image_size, skip_bad_files, augment)
    return train, val, {**image_facts(3, len(train.classes), image_size, val), "held_out": not presplit}


def shard_sets(train_shards: str = "", val_shards: str = "", shard_index: str = "", image_size: int = 0,
               augment: Augmentation = NO_AUGMENTATION) -> tuple["ShardSet", "ShardSet", dict[str, Any]]:
    """WebDataset tars written by `hvd-train shard`; the facts come from their index. Training samples are
    augmented as the data set they were written from (the index's source) would be."""
    train, val, facts = open_sets(train_shards, val_shards, shard_index)
    kind = "photos" if facts.get("transform") == "photos" else \
        KIND_OF.get(facts.get("source"))  # type: ignore[arg-type]  # no source: get(None), which typeshed refuses
    train = dataclasses.replace(train, augment=(augment, kind))
    if facts.get("transform") == "samples":  # a user's data set: its own facts, as its factory gave them
        known = {k: facts.get(k) for k in ("in_channels", "num_classes", "image_size") if facts.get(k) is not None}
        named = {"classes": facts["classes"]} if facts.get("classes") else {}
        return train, val, {**(facts.get("extra") or {}), **known, **named}  # the index's own facts win
    size = image_size or facts.get("image_size")
    # The cast: an index of images (a user's samples returned above) states its image size
    return train, val, image_facts(facts.get("in_channels"), facts.get("num_classes"), cast(int, size), val)


DATASETS: dict[str, Callable[..., Any]] = {
    "digits": digits, "synthetic": synthetic, "mnist": _mnist_like(mnist.MNIST, "digits"),
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


def find_dataset(name: str) -> Optional[Callable[..., Any]]:
    """The factory of the data set that ships with this name, or None."""
    return DATASETS.get(name)


def native_size(name: str) -> int:
    """The image size data set `name` has when --image-size is not set (its factory's default)."""
    return inspect.signature(DATASETS[name]).parameters["image_size"].default


def load_digits_dataset(image_size: int = 0) -> ImageTensorDataset:
    images, target = read_digits()
    # Pixels are counts 0..16; scaled to 0..1, with the channel axis the conv layers expect.
    return ImageTensorDataset(torch.from_numpy(images).unsqueeze(1), torch.from_numpy(target), image_size=image_size,
                              scale=16.0)


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images float32 (1797, 8, 8), labels int64), as sklearn.datasets.load_digits returns them.

    The file is read straight from scikit-learn's package folder: importing sklearn.datasets costs every rank about
    1.5 s of CPU (it imports SciPy), longer than a whole epoch of the digits takes."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    found = Path(next(iter(cast("list[str]", spec.submodule_search_locations))), "datasets", "data",
                 "digits.csv.gz") if spec else None
    if found is None or not found.is_file():  # another layout of scikit-learn: ask it (imports it)
        from sklearn.datasets import load_digits
        bunch = load_digits()
        return bunch.images.astype(np.float32), bunch.target.astype(np.int64)
    with gzip.open(found, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.float32)  # 64 pixels, then the label
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)


class SyntheticDataset(Dataset):
    """Sample i is always the same (seeded by i), so runs are repeatable and nothing is held in memory."""

    def __init__(self, num_samples: int, channels: int, image_size: int, num_classes: int, seed: int = 0) -> None:
        self.num_samples, self.num_classes, self.seed = num_samples, num_classes, seed
        self.shape = (channels, image_size, image_size)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randn(self.shape, generator=gen)
        label = torch.randint(0, self.num_classes, (), generator=gen)
        return image, label
