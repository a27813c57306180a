"""CIFAR-10 and CIFAR-100 in both versions their authors publish, as found under --data-dir:

- python (what torchvision's download leaves): cifar-10-batches-py/{data_batch_1..5,test_batch} and
  cifar-100-python/{train,test}, pickled dicts of a (N, 3072) uint8 array and a label list;
- binary: cifar-10-batches-bin/{data_batch_1..5,test_batch}.bin, records of one label byte and 3,072 pixel bytes
  (1,024 red, 1,024 green, 1,024 blue, rows top to bottom), and cifar-100-binary/{train,test}.bin, whose records
  start with a coarse and a fine label byte.

The pickles are read by an unpickler that builds numpy arrays and nothing else, so a file cannot run code.
"""
import os
import pickle
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from hvd_train.data.arrays import ImageTensorDataset
from hvd_train.data.download import Layout, fetch, locate
from hvd_train.errors import DataError

PIXELS = 3 * 32 * 32


@dataclass(frozen=True)
class Cifar:
    title: str
    classes: int
    python: Layout
    binary: Layout
    label_key: str        # the python version's label list
    label_bytes: int      # labels before the pixels in a binary record; the last one is the class
    url: str              # the python version, which --download fetches (torchvision's URL and checksum)
    md5: str
    mean: tuple
    std: tuple


BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10 = Cifar("CIFAR-10", 10,
                Layout("cifar-10-batches-py", BATCHES + ("test_batch",), "python version, torchvision's download"),
                Layout("cifar-10-batches-bin", tuple(f"{b}.bin" for b in BATCHES + ("test_batch",)),
                       "binary version"),
                "labels", 1, "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                "c58f30108f718f92721af3b95e74349a",
                (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100 = Cifar("CIFAR-100", 100,
                 Layout("cifar-100-python", ("train", "test"), "python version, torchvision's download"),
                 Layout("cifar-100-binary", ("train.bin", "test.bin"), "binary version"),
                 "fine_labels", 2, "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
                 "eb9058c3a382ffc7106e4002c42a8d85",
                 (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))


class ArraysOnly(pickle.Unpickler):
    """Unpickles dicts, lists, strings and numpy arrays; any other class or function in the file is refused.
    (_codecs.encode turns text into bytes: Python 3 writes an array's bytes that way in protocol 2.)"""
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing {module}.{name}: a CIFAR batch holds only arrays and lists")
        return super().find_class(module, name)


def read_python_batch(path: str, spec: Cifar) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            batch = ArraysOnly(f, encoding="latin1").load()  # latin1: the files were pickled by Python 2
        batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}
        data, labels = batch["data"], batch[spec.label_key]
        # Checked before any conversion: a pickle of shared references (a list holding one list a million times)
        # is small on disk and enormous once copied into an array.
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
            raise TypeError(f"'data' is a {type(data).__name__}, not an array of bytes")
        if not isinstance(labels, list) or len(labels) != len(data) or \
                not all(type(v) is int for v in labels):
            raise TypeError(f"{spec.label_key!r} is not a list of {len(data)} whole numbers")
        labels = np.asarray(labels, dtype=np.int64)
    except (pickle.UnpicklingError, EOFError, KeyError, AttributeError, TypeError, ValueError) as e:
        raise DataError(f"{path}: not a {spec.title} python-version batch ({type(e).__name__}: {e}); the file is "
                        f"truncated or from another data set") from None
    if data.ndim != 2 or data.shape[1] != PIXELS or len(data) != len(labels):
        raise DataError(f"{path}: holds {data.shape} pixels for {len(labels)} labels; a {spec.title} batch holds "
                        f"(N, {PIXELS}) pixels and N labels")
    return data, labels


def read_binary_batch(path: str, spec: Cifar) -> tuple[np.ndarray, np.ndarray]:
    record = spec.label_bytes + PIXELS
    data = np.fromfile(path, dtype=np.uint8)
    if data.size == 0 or data.size % record:
        raise DataError(f"{path}: {data.size} bytes is not a whole number of {record}-byte {spec.title} records; "
                        f"the file is truncated or not {spec.title}'s binary version")
    records = data.reshape(-1, record)
    return records[:, spec.label_bytes:], records[:, spec.label_bytes - 1].astype(np.int64)


def to_dataset(batches: Sequence[tuple[np.ndarray, np.ndarray]], spec: Cifar, image_size: int) -> ImageTensorDataset:
    pixels = np.concatenate([b[0] for b in batches])
    labels = np.concatenate([b[1] for b in batches])
    if labels.min() < 0 or labels.max() >= spec.classes:
        raise DataError(f"{spec.title}: labels outside 0..{spec.classes - 1}; these files are another data set's")
    images = torch.from_numpy(pixels.reshape(-1, 3, 32, 32).copy())
    return ImageTensorDataset(images, torch.from_numpy(labels), image_size=image_size, mean=spec.mean, std=spec.std)


def load(spec: Cifar, data_dir: str, image_size: int = 0) -> list[ImageTensorDataset]:
    """(train, test) from whichever version is under data_dir (python first: it is what torchvision downloads)."""
    paths = locate(spec.title, data_dir, (spec.python, spec.binary), how_to_get(spec, data_dir))
    binary = all(p.endswith(".bin") for p in paths.values())
    read = read_binary_batch if binary else read_python_batch
    names = list(paths)
    train_names, test_names = names[:-1], names[-1:]  # the test split is each layout's last file
    return [to_dataset([read(paths[n], spec) for n in split], spec, image_size) for split in (train_names, test_names)]


def how_to_get(spec: Cifar, data_dir: str) -> str:
    return (f"Run once with --download (needs internet), or extract {os.path.basename(spec.url)} (the python "
            f"version, torchvision's) or the binary version into {data_dir}")


def download(spec: Cifar, data_dir: str) -> None:
    by_hand = f"download it elsewhere and extract it into {data_dir} (it makes {spec.python.folder}/)"
    fetch(spec.title, [spec.url], data_dir, by_hand, spec.md5)
