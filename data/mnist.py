"""MNIST in its original IDX files: <data_dir>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte."""
import os

from data.arrays import ImageTensorDataset
from data.errors import DataError

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def raw_dir(data_dir):
    return os.path.join(data_dir, "MNIST", "raw")


def download(data_dir):
    from torchvision.datasets import MNIST

    MNIST(data_dir, train=True, download=True)
    MNIST(data_dir, train=False, download=True)


def load(data_dir, image_size=0):
    missing = [f for f in FILES if not os.path.isfile(os.path.join(raw_dir(data_dir), f))]
    if missing:
        raise DataError(f"MNIST not found: {', '.join(missing)} missing in {raw_dir(data_dir)}. Run once with "
                        f"--download (needs internet), or put the four unzipped IDX files there "
                        f"(--data-dir sets the parent folder)")
    from torchvision.datasets.mnist import read_image_file, read_label_file

    splits = []
    for prefix in ("train", "t10k"):
        images = read_image_file(os.path.join(raw_dir(data_dir), f"{prefix}-images-idx3-ubyte")).unsqueeze(1)
        labels = read_label_file(os.path.join(raw_dir(data_dir), f"{prefix}-labels-idx1-ubyte"))
        splits.append(ImageTensorDataset(images, labels, image_size=image_size))
    return splits
