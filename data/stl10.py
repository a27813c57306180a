"""STL-10 in its binary version: <data_dir>/stl10_binary/{train,test}_{X,y}.bin (labelled splits).

X files hold uint8 images of 3x96x96 stored column-major (each channel is written column by column);
y files hold one label byte per image, 1 to 10.
"""
import numpy as np
import torch

from hvd_train.data.arrays import ImageTensorDataset
from hvd_train.data.download import Layout, fetch, locate
from hvd_train.errors import DataError

URL = "https://ai.stanford.edu/~acoates/stl10/stl10_binary.tar.gz"
MD5 = "91f7769df0f17e558f3565bffb0c7dfb"  # the checksum torchvision publishes for it
FOLDER = "stl10_binary"
SIDE = 96
LAYOUT = Layout(FOLDER, ("train_X.bin", "train_y.bin", "test_X.bin", "test_y.bin"), "binary version")
MEAN, STD = (0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)


def download(data_dir: str) -> None:
    fetch("STL-10", [URL], data_dir, f"download it elsewhere and extract it into {data_dir} (it makes {FOLDER}/)",
          MD5)


def read_split(paths: dict[str, str], split: str) -> tuple[torch.Tensor, torch.Tensor]:
    x_path, y_path = paths[f"{split}_X.bin"], paths[f"{split}_y.bin"]
    pixels = np.fromfile(x_path, dtype=np.uint8)
    labels = np.fromfile(y_path, dtype=np.uint8).astype(np.int64) - 1
    if pixels.size != labels.size * 3 * SIDE * SIDE or labels.size == 0:
        raise DataError(f"{x_path} holds {pixels.size} bytes for {labels.size} labels in {y_path}; expected "
                        f"{3 * SIDE * SIDE} bytes per label: a file is truncated or not STL-10's binary version")
    if labels.min() < 0 or labels.max() > 9:
        raise DataError(f"{y_path}: labels outside 1..10; not STL-10's binary version")
    # Column-major on disk: swap the last two axes to get (channel, row, column).
    images = torch.from_numpy(pixels.reshape(-1, 3, SIDE, SIDE).transpose(0, 1, 3, 2).copy())
    return images, torch.from_numpy(labels)


def load(data_dir: str, image_size: int = 0) -> list[ImageTensorDataset]:
    paths = locate("STL-10", data_dir, (LAYOUT,),
                   f"Run once with --download (needs internet), or extract {URL} into {data_dir}")
    return [ImageTensorDataset(*read_split(paths, split), image_size=image_size, mean=MEAN, std=STD)
            for split in ("train", "test")]
