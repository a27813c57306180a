"""CIFAR-10 in its binary version: <data_dir>/cifar-10-batches-bin/{data_batch_1..5,test_batch}.bin.

Each record is one label byte then 3,072 pixel bytes (1,024 red, 1,024 green, 1,024 blue, rows top to bottom).
The binary version needs no unpickling, so reading it cannot run code.
"""
import os

import numpy as np
import torch

from data.arrays import ImageTensorDataset
from data.errors import DataError

URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
FOLDER = "cifar-10-batches-bin"
TRAIN_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)]
TEST_FILES = ["test_batch.bin"]
RECORD = 1 + 3 * 32 * 32
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def download(data_dir):
    from torchvision.datasets.utils import download_and_extract_archive

    download_and_extract_archive(URL, download_root=data_dir)


def read_batches(paths):
    raw = []
    for path in paths:
        data = np.fromfile(path, dtype=np.uint8)
        if data.size == 0 or data.size % RECORD:
            raise DataError(f"{path}: {data.size} bytes is not a whole number of {RECORD}-byte CIFAR-10 records; "
                            f"the file is truncated or not CIFAR-10's binary version")
        raw.append(data.reshape(-1, RECORD))
    records = np.concatenate(raw)
    images = torch.from_numpy(records[:, 1:].reshape(-1, 3, 32, 32).copy())
    labels = torch.from_numpy(records[:, 0].astype(np.int64))
    if labels.max() > 9:
        raise DataError(f"{paths[0]}: labels above 9; not CIFAR-10's binary version")
    return images, labels


def load(data_dir, image_size=0):
    folder = os.path.join(data_dir, FOLDER)
    missing = [f for f in TRAIN_FILES + TEST_FILES if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise DataError(f"CIFAR-10 not found: {', '.join(missing)} missing in {folder}. Run once with --download "
                        f"(needs internet), or extract {URL} into {data_dir}")
    return [ImageTensorDataset(*read_batches([os.path.join(folder, f) for f in files]), image_size=image_size,
                               mean=MEAN, std=STD) for files in (TRAIN_FILES, TEST_FILES)]
