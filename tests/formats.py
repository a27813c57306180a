"""Writers for small data sets in the real on-disk formats, for the loader tests and the end-to-end runs."""
import struct

import numpy as np


def write_mnist(root, n_train=64, n_test=32, seed=0):
    """IDX files as distributed by LeCun et al., unzipped: root/MNIST/raw/*-ubyte. Returns the arrays written."""
    rng = np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + labels.tobytes())
        arrays[prefix] = (images, labels)
    return arrays


def write_cifar10(root, per_batch=20, n_test=20, seed=0):
    """CIFAR-10 binary version: root/cifar-10-batches-bin/{data_batch_1..5,test_batch}.bin."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-bin"
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", n_test)]:
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        images = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
        records = np.concatenate([labels[:, None], images.reshape(n, -1)], axis=1)
        (folder / f"{name}.bin").write_bytes(records.tobytes())
        written[name] = (images, labels)
    return written


def write_stl10(root, n_train=12, n_test=8, seed=0):
    """STL-10 binary version: root/stl10_binary/{train,test}_{X,y}.bin, images column-major, labels 1..10."""
    rng = np.random.default_rng(seed)
    folder = root / "stl10_binary"
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, size=(n, 3, 96, 96), dtype=np.uint8)  # (channel, row, column)
        labels = rng.integers(1, 11, size=n, dtype=np.uint8)
        (folder / f"{split}_X.bin").write_bytes(images.transpose(0, 1, 3, 2).tobytes())
        (folder / f"{split}_y.bin").write_bytes(labels.tobytes())
        written[split] = (images, labels)
    return written


def write_image_folder(root, classes=("cat", "dog", "owl"), per_class=6, size=20, seed=0):
    """class/*.png trees, one colour tint per class so a model can learn them."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 80, size=(size, size, 3), dtype=np.uint8)
            pixels[..., c] += 150
            Image.fromarray(pixels).save(root / name / f"{i}.png")
