"""`hvd-train shard`: any data set that ships, written as WebDataset tar shards with an index, for --dataset shards.

Images go in as they are stored: an image folder's files byte for byte (a JPEG stays that JPEG), arrays (CIFAR,
MNIST, STL-10, the digits) as lossless PNG. Each split becomes OUT/{train,val}-NNNNNN.tar of at most --shard-size
samples, and OUT/index.json lists every shard's sample count and the facts the model needs.
"""
import io
import json
import os

import numpy as np
from torch.utils.data import Subset

from data.arrays import ImageTensorDataset
from data.errors import DataError
from data.shards import FORMAT, INDEX


def raw_samples(dataset):
    """(extension, bytes, label) for each sample of a built-in data set, in order, undecoded where possible."""
    base, indices = dataset, range(len(dataset))
    if isinstance(dataset, Subset):
        base, indices = dataset.dataset, dataset.indices
    if isinstance(base, ImageTensorDataset):
        for i in indices:
            yield "png", png(base.images[i], base.scale), int(base.labels[i])
    elif hasattr(base, "samples"):  # an image folder: (path, class) pairs
        for i in indices:
            path, label = base.samples[i]
            with open(path, "rb") as f:
                yield os.path.splitext(path)[1][1:].lower(), f.read(), label
    else:
        raise DataError(f"cannot write {type(base).__name__} as shards: only the data sets that ship can be")


def png(image, scale):
    """A (C, H, W) image tensor as PNG bytes: uint8 as it is, floats in 0..scale mapped to 0..255."""
    from PIL import Image

    pixels = image.numpy()
    if pixels.dtype != np.uint8:
        pixels = np.clip(np.rint(pixels / scale * 255), 0, 255).astype(np.uint8)
    pixels = pixels[0] if pixels.shape[0] == 1 else pixels.transpose(1, 2, 0)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def facts_of(dataset, info, dataset_name):
    """What the reader needs to rebuild the data set's tensors: classes, channels, size, how to transform."""
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    facts = {"source": dataset_name, "num_classes": info.num_classes, "in_channels": info.in_channels,
             "image_size": info.image_size}
    if isinstance(base, ImageTensorDataset):
        facts.update(transform="arrays", mean=base.mean.flatten().tolist(), std=base.std.flatten().tolist())
    else:
        facts.update(transform="photos", classes=list(base.classes))
    return facts


def write_split(dataset, out, split, shard_size):
    """{shard name: samples} for the split's shards, written whole (a temporary name, then renamed)."""
    from webdataset import TarWriter

    counts, writer, name, key = {}, None, None, 0
    for ext, data, label in raw_samples(dataset):
        if writer is None or counts[name] == shard_size:
            if writer is not None:
                finish(writer, out, name)
            name = f"{split}-{len(counts):06d}.tar"
            counts[name] = 0
            writer = TarWriter(os.path.join(out, name + ".tmp"))
        writer.write({"__key__": f"{key:09d}", ext: data, "cls": str(label)})
        counts[name] += 1
        key += 1
    if writer is not None:
        finish(writer, out, name)
    return counts


def finish(writer, out, name):
    writer.close()
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


def write_shards(train, val, info, dataset_name, out, shard_size):
    """Write both splits and the index into `out` (which must not hold shards yet); returns the index."""
    if os.path.exists(os.path.join(out, INDEX)):
        raise DataError(f"{out} already holds shards ({INDEX}); choose an empty --out, or remove them first")
    os.makedirs(out, exist_ok=True)
    shards = {}
    for split, dataset in (("train", train), ("val", val)):
        shards.update(write_split(dataset, out, split, shard_size))
    index = {"format": FORMAT, "version": 1, "facts": facts_of(train, info, dataset_name), "shards": shards}
    with open(os.path.join(out, INDEX + ".tmp"), "w") as f:
        json.dump(index, f, indent=1)
    os.replace(os.path.join(out, INDEX + ".tmp"), os.path.join(out, INDEX))
    return index
