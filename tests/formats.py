"""Writers for small data sets in the real on-disk formats, for the loader tests and the end-to-end runs."""
import gzip
import pickle
import struct

import numpy as np


def write_mnist(root, n_train=64, n_test=32, seed=0, folder="MNIST/raw", gz=False):
    """IDX files as LeCun et al. (and Zalando, for Fashion-MNIST) publish them: gzipped (gz=True, as torchvision's
    download leaves them) or unzipped, in root/folder (torchvision's MNIST/raw, FashionMNIST/raw, or "" for root).
    Returns the arrays written."""
    rng = np.random.default_rng(seed)
    raw = root / folder
    raw.mkdir(parents=True, exist_ok=True)
    write = (lambda path, data: path.with_name(path.name + ".gz").write_bytes(gzip.compress(data))) if gz else \
        (lambda path, data: path.write_bytes(data))
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        write(raw / f"{prefix}-images-idx3-ubyte", struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes())
        write(raw / f"{prefix}-labels-idx1-ubyte", struct.pack(">II", 0x801, n) + labels.tobytes())
        arrays[prefix] = (images, labels)
    return arrays


def write_cifar_python(root, classes=10, per_batch=20, n_test=20, seed=0):
    """CIFAR's python version as torchvision's download leaves it: pickled dicts with bytes keys (the files were
    pickled by Python 2), b"data" a (N, 3072) uint8 array, b"labels" (CIFAR-10) or b"fine_labels" and
    b"coarse_labels" (CIFAR-100) lists. root/cifar-10-batches-py/{data_batch_1..5,test_batch} or
    root/cifar-100-python/{train,test}. Returns {file: (images (N, 3, 32, 32), labels)}."""
    rng = np.random.default_rng(seed)
    if classes == 10:
        folder, files = root / "cifar-10-batches-py", [(f"data_batch_{i}", per_batch) for i in range(1, 6)]
        files.append(("test_batch", n_test))
    else:
        folder, files = root / "cifar-100-python", [("train", per_batch * 5), ("test", n_test)]
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, n in files:
        images = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
        labels = rng.integers(0, classes, size=n).tolist()
        batch = {b"batch_label": name.encode(), b"data": images.reshape(n, -1)}
        if classes == 10:
            batch[b"labels"] = labels
        else:
            batch.update({b"fine_labels": labels, b"coarse_labels": [label // 5 for label in labels]})
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
        written[name] = (images, np.array(labels))
    return written


def write_cifar100_binary(root, n_train=100, n_test=20, seed=0):
    """CIFAR-100 binary version: root/cifar-100-binary/{train,test}.bin, records of a coarse label byte, a fine
    label byte and 3,072 pixel bytes."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-100-binary"
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, n in (("train", n_train), ("test", n_test)):
        fine = rng.integers(0, 100, size=n, dtype=np.uint8)
        images = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
        records = np.concatenate([(fine // 5)[:, None], fine[:, None], images.reshape(n, -1)], axis=1)
        (folder / f"{name}.bin").write_bytes(records.tobytes())
        written[name] = (images, fine)
    return written


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


def write_image_folder(root, classes=("cat", "dog", "owl"), per_class=6, size=20, seed=0, ext="png"):
    """class/*.png (or .jpg) trees, one colour tint per class so a model can learn them."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 80, size=(size, size, 3), dtype=np.uint8)
            pixels[..., c] += 150
            Image.fromarray(pixels).save(root / name / f"{i}.{ext}")


def write_desktop_litter(root):
    """What copying a folder from a Mac, a notebook or an editor leaves among the images: .DS_Store files,
    AppleDouble ._name.png files (an image's name, not an image), notes, and a hidden folder of copies.
    Returns how many such files were written."""
    written = 0
    for folder in [root] + [p for p in root.iterdir() if p.is_dir()]:
        (folder / ".DS_Store").write_bytes(b"\0\0\0\1Bud1" + bytes(40))
        (folder / "notes.txt").write_text("labelled by hand\n")
        written += 2
        for image in list(folder.glob("*.png"))[:1]:
            (folder / f"._{image.name}").write_bytes(b"\0\5\26\7\0\2\0\0Mac OS X        ")
            written += 1
    checkpoints = root / ".ipynb_checkpoints"
    checkpoints.mkdir()
    (checkpoints / "copy.png").write_bytes(next(root.glob("*/*.png")).read_bytes())
    return written + 1


# What the device's crop (torch's antialiased resize in float32) may differ from the workers' (the same resize on
# uint8, rounded to whole levels), in levels of 0..255: the mean over every pixel, and the 99th percentile.
MEAN_LEVELS, P99_LEVELS = 0.5, 2.0
# A JPEG decoded in draft mode (libjpeg's scaled DCT) against decoded whole and resized: measured 3-4 levels.
DRAFT_MEAN_LEVELS = 6.0
# nvjpeg on a GPU against libjpeg-turbo in the workers: their IDCT and chroma upsampling differ, so the GPU's crops
# differ by more than rounding (measured on an H200 at 224 px: mean 0.72 levels, 99th percentile 5.4).
NVJPEG_MEAN_LEVELS, NVJPEG_P99_LEVELS = 1.5, 10.0


def photo(width, height, seed, quality=90):
    """A JPEG cut from one of scikit-learn's bundled photographs, resized to width x height."""
    import io

    from PIL import Image
    from sklearn.datasets import load_sample_image

    rng = np.random.default_rng(seed)
    source = Image.fromarray(load_sample_image(("china.jpg", "flower.jpg")[seed % 2]))
    left, top = int(rng.integers(0, 100)), int(rng.integers(0, 80))
    cut = source.crop((left, top, left + 520, top + 390)).resize((width, height), Image.BICUBIC)
    out = io.BytesIO()
    cut.save(out, "JPEG", quality=quality)
    return out.getvalue()


def both_ways(paths, train, size=224, device="cpu"):
    """(the loader workers' uint8 crops, the device's float crops) of the same draws (seed i for file i) of the
    photos at `paths`: data/images.py's two sides, the device's on `device`."""
    import torch

    from hvd_train.data.augment import seed_all
    from hvd_train.data.images import PhotoTransform, collate_encoded, crop_batch, decode_batch

    plain, encoded = PhotoTransform(size, train), PhotoTransform(size, train).on_device()
    cpu, samples = [], []
    for i, path in enumerate(paths):
        seed_all(i)
        cpu.append(plain(path))
        seed_all(i)
        samples.append((encoded(path), 0))
    batch, _ = collate_encoded(samples)
    return torch.stack(cpu), crop_batch(batch, decode_batch(batch, torch.device(device)))
