"""scikit-learn's bundled handwritten digits: 1,797 grey 8x8 images of 0-9, shipped with the package (no download)."""
import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch

from hvd_train.data.arrays import ImageTensorDataset


def load_digits_dataset(image_size=0):
    images, target = read_digits()
    # Pixels are counts 0..16; scaled to 0..1, with the channel axis the conv layers expect.
    return ImageTensorDataset(torch.from_numpy(images).unsqueeze(1), torch.from_numpy(target), image_size=image_size,
                              scale=16.0)


def read_digits():
    """(images float32 (1797, 8, 8), labels int64), as sklearn.datasets.load_digits returns them.

    The file is read straight from scikit-learn's package folder: importing sklearn.datasets costs every rank about
    1.5 s of CPU (it imports SciPy), longer than a whole epoch of the digits takes."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    found = Path(next(iter(spec.submodule_search_locations)), "datasets", "data", "digits.csv.gz") if spec else None
    if found is None or not found.is_file():  # another layout of scikit-learn: ask it (imports it)
        from sklearn.datasets import load_digits
        bunch = load_digits()
        return bunch.images.astype(np.float32), bunch.target.astype(np.int64)
    with gzip.open(found, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.float32)  # 64 pixels, then the label
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)
