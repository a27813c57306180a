"""MNIST and Fashion-MNIST in their IDX files, gzipped as published or unzipped, where torchvision keeps them
(<data_dir>/MNIST/raw/, <data_dir>/FashionMNIST/raw/) or straight in --data-dir:
{train,t10k}-images-idx3-ubyte and {train,t10k}-labels-idx1-ubyte.

IDX: a big-endian header (two zero bytes, a type byte, 0x08 for uint8, the number of dimensions, then each
dimension as a 32-bit integer), then the data.
"""
import gzip
import os
from dataclasses import dataclass

import numpy as np
import torch

from hvd_train.data.arrays import ImageTensorDataset
from hvd_train.data.download import Layout, fetch, locate
from hvd_train.errors import DataError

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


@dataclass(frozen=True)
class Idx:
    title: str
    folder: str       # torchvision's folder under --data-dir
    mirrors_of: str   # the torchvision class whose files and checksums --download uses (and HTTPS mirrors)
    mirrors: tuple = ()  # HTTPS mirrors where torchvision lists only plain-HTTP ones


MNIST = Idx("MNIST", "MNIST", "MNIST")
# torchvision's only Fashion-MNIST mirror is an http:// S3 website; the same bucket over HTTPS, and the authors' repo.
FASHION_MNIST = Idx("Fashion-MNIST", "FashionMNIST", "FashionMNIST",
                    ("https://fashion-mnist.s3.eu-central-1.amazonaws.com/",
                     "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/"))


def layouts(spec: Idx) -> tuple[Layout, Layout]:
    return (Layout(os.path.join(spec.folder, "raw"), FILES, "torchvision's download", gzip_ok=True),
            Layout("", FILES, "the files as published", gzip_ok=True))


MAX_BYTES = 2**31  # the largest IDX payload read (MNIST's training images are 47 MB)


def read_idx(path: str, dims: int) -> np.ndarray:
    """The uint8 array in an IDX file with `dims` dimensions (.gz read as gzip). The header is read and checked
    first, and then exactly the bytes it announces: a small .gz that would unpack to gigabytes is refused."""
    opener = gzip.open if path.endswith(".gz") else open
    header = 4 + 4 * dims
    try:
        with opener(path, "rb") as f:
            head = f.read(header)
            if len(head) < header or head[:2] != b"\0\0" or head[2] != 0x08 or head[3] != dims:
                raise DataError(f"{path}: not a uint8 IDX file with {dims} dimension(s); expected one of "
                                f"{', '.join(FILES)}")
            shape = tuple(int.from_bytes(head[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
            size = int(np.prod(shape, dtype=np.int64))
            if size > MAX_BYTES:
                raise DataError(f"{path}: its header announces shape {shape} ({size} bytes), more than an IDX data "
                                f"set holds ({MAX_BYTES} at most); the file is not MNIST's")
            raw = f.read(size + 1)
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a cut .gz ends in EOFError
        raise DataError(f"{path}: cannot read it ({e}); the file is damaged, download it again") from None
    if len(raw) != size:
        state = "truncated" if len(raw) < size else "longer than its header says"
        raise DataError(f"{path}: holds {'more than ' if len(raw) > size else ''}{min(len(raw), size)} bytes of data "
                        f"for shape {shape}; the file is {state}")
    return np.frombuffer(raw, dtype=np.uint8).reshape(shape)


def load(spec: Idx, data_dir: str, image_size: int = 0) -> list[ImageTensorDataset]:
    paths = locate(spec.title, data_dir, layouts(spec),
                   f"Run once with --download (needs internet), or put the four IDX files in {data_dir}")
    splits = []
    for prefix in ("train", "t10k"):
        images = read_idx(paths[f"{prefix}-images-idx3-ubyte"], 3)
        labels = read_idx(paths[f"{prefix}-labels-idx1-ubyte"], 1)
        if len(images) != len(labels):
            raise DataError(f"{paths[f'{prefix}-images-idx3-ubyte']} holds {len(images)} images for {len(labels)} "
                            f"labels in {paths[f'{prefix}-labels-idx1-ubyte']}; they must match")
        splits.append(ImageTensorDataset(torch.from_numpy(images.copy()).unsqueeze(1),
                                         torch.from_numpy(labels.astype(np.int64)), image_size=image_size))
    return splits


def download(spec: Idx, data_dir: str) -> None:
    """The four .gz files, each checked against the checksum torchvision publishes, from HTTPS mirrors only."""
    from torchvision import datasets

    source = getattr(datasets, spec.mirrors_of)
    raw = os.path.join(data_dir, spec.folder, "raw")
    mirrors = spec.mirrors or tuple(m for m in source.mirrors if m.startswith("https://"))
    for filename, md5 in source.resources:
        fetch(spec.title, [mirror + filename for mirror in mirrors], raw,
              f"download the four .gz files from {mirrors[0]} elsewhere and put them in {raw}", md5,
              filename=filename, extract=False)
