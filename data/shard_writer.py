"""`hvd-train shard`: a data set (one that ships, or a user's map-style one) written as WebDataset tar shards with
an index, for --dataset shards.

Images go in as they are stored: an image folder's files byte for byte (a JPEG stays that JPEG), arrays (CIFAR,
MNIST, STL-10, the digits) as lossless PNG. A user's samples go in as they are (tensors as .npy, numbers and text
as .json, their tuple and dict nesting in the index), and come back out the same. Each split becomes
OUT/{train,val}-NNNNNN.tar of at most --shard-size
samples, and OUT/index.json lists every shard's sample count and the facts the model needs.
"""
import io
import json
import os

import numpy as np
import torch
from torch.utils.data import Subset

from hvd_train.data.arrays import ImageTensorDataset
from hvd_train.data.errors import UNREADABLE_IMAGE, DataError
from hvd_train.data.images import as_mode, read_image_file
from hvd_train.data.shard_index import FORMAT, INDEX
from hvd_train.files import atomic_write, temporary_beside


def raw_samples(dataset, max_side=0):
    """The tar fields of each sample, in order: a built-in data set's image undecoded where possible (extension:
    bytes; a photo longer than max_side, where given, resized to it) with its class ("cls"); any other data set's
    samples through encode() (.npy arrays, .json values)."""
    base, indices = dataset, range(len(dataset))
    if isinstance(dataset, Subset):
        base, indices = dataset.dataset, dataset.indices
    if isinstance(base, ImageTensorDataset):
        for i in indices:
            yield {"png": png(base.images[i], base.scale), "cls": str(int(base.labels[i]))}
    elif hasattr(base, "samples") and hasattr(base, "classes"):  # an image folder: (path, class) pairs
        for i in indices:
            path, label = base.samples[i]
            try:
                data = read_image_file(path)  # a regular file of a bounded size, or refused unread
            except UNREADABLE_IMAGE as e:
                raise DataError(f"{path}: cannot read this image ({e}); fix or remove the file") from None
            extension = os.path.splitext(path)[1][1:].lower()
            if max_side:
                extension, data = bounded(data, extension, max_side, path)
            yield {extension: data, "cls": str(label)}
    else:
        for i in range(len(dataset)):
            yield dict(encode(dataset[i], f"sample {i}"))


def bounded(data, extension, max_side, path):
    """(extension, bytes) of a photo at most max_side pixels on its longer side: the file as it is where it is
    already, else resized (antialiased, from a JPEG draft where libjpeg can scale) and written again, as JPEG at
    quality 90 (a PNG as PNG)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height, fmt = image.width, image.height, image.format
            if max(width, height) <= max_side:
                return extension, data
            scale = max_side / max(width, height)
            size = (max(1, round(width * scale)), max(1, round(height * scale)))
            image.draft("RGB", size)  # a JPEG decoded at 1/2, 1/4 or 1/8 where that is still at least `size`
            image = as_mode(image, "RGB").resize(size, Image.BICUBIC)
    except UNREADABLE_IMAGE as e:
        raise DataError(f"{path}: cannot read this image ({e}); fix or remove the file") from None
    out = io.BytesIO()
    if fmt == "PNG":
        image.save(out, "PNG")
        return "png", out.getvalue()
    image.save(out, "JPEG", quality=90)
    return "jpg", out.getvalue()


def encode(sample, where, prefix=""):
    """(field, bytes) for each leaf of a sample: tensors and arrays as .npy (read back without pickle), numbers,
    booleans and text as .json; tuples, lists and dicts nest by name (image.npy, 0.npy, target.box.npy)."""
    if torch.is_tensor(sample) or isinstance(sample, np.ndarray):
        out = io.BytesIO()
        np.save(out, sample.detach().cpu().numpy() if torch.is_tensor(sample) else sample, allow_pickle=False)
        yield prefix + "npy", out.getvalue()
    elif isinstance(sample, (bool, int, float, str)):
        yield prefix + "json", json.dumps(sample).encode()
    elif isinstance(sample, dict):
        for key in sorted(sample):
            if not isinstance(key, str) or not key.isidentifier():
                raise DataError(f"{where}: key {key!r} cannot name a field in a shard; use identifiers as keys")
            yield from encode(sample[key], where, f"{prefix}{key}.")
    elif isinstance(sample, (tuple, list)):
        for j, value in enumerate(sample):
            yield from encode(value, where, f"{prefix}{j}.")
    else:
        raise DataError(f"{where}: holds a {type(sample).__name__}, which a shard cannot hold; give samples of "
                        f"tensors, arrays, numbers and text, in tuples, lists or dicts")


def structure(sample):
    """The shape of a sample's nesting, for the reader to rebuild it: "leaf", ["tuple"|"list", [...]], or
    ["dict", {key: ...}]."""
    if isinstance(sample, dict):
        return ["dict", {k: structure(v) for k, v in sorted(sample.items())}]
    if isinstance(sample, (tuple, list)):
        return [type(sample).__name__, [structure(v) for v in sample]]
    return "leaf"


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
    """What the reader needs to rebuild the data set's samples: classes, channels, size, how to transform (images),
    or the samples' structure and the data set's own facts (any other data set)."""
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    # Facts that do not apply (a text data set has no channels) are left out, not written as null.
    known = (("num_classes", info.num_classes), ("in_channels", info.in_channels), ("image_size", info.image_size))
    facts = {"source": dataset_name, **{k: v for k, v in known if v is not None}}
    if isinstance(base, ImageTensorDataset):
        facts.update(transform="arrays", mean=base.mean.flatten().tolist(), std=base.std.flatten().tolist())
    elif hasattr(base, "samples") and hasattr(base, "classes"):
        facts.update(transform="photos", classes=list(base.classes))
    else:
        facts.update(transform="samples", structure=structure(dataset[0]), extra=dict(info.extra),
                     **({"classes": list(info.classes)} if info.classes else {}))
    return facts


def write_split(dataset, out, split, shard_size, max_side=0):
    """{shard name: samples} for the split's shards, each written whole under a temporary name of its own (never
    through a link someone planted in --out), then renamed."""
    counts, shard, name, key = {}, None, None, 0
    for fields in raw_samples(dataset, max_side):
        if shard is None or counts[name] == shard_size:
            if shard is not None:
                shard.finish()
            name = f"{split}-{len(counts):06d}.tar"
            counts[name] = 0
            shard = Shard(os.path.join(out, name))
        shard.writer.write({"__key__": f"{key:09d}", **fields})
        counts[name] += 1
        key += 1
    if shard is not None:
        shard.finish()
    return counts


class Shard:
    """A tar shard being written: a TarWriter on a new file beside `path`, renamed to `path` when finished."""

    def __init__(self, path):
        from webdataset import TarWriter

        fd, self.tmp = temporary_beside(path)
        self.path, self.file = path, os.fdopen(fd, "wb")
        self.writer = TarWriter(self.file)

    def finish(self):
        self.writer.close()
        self.file.close()
        os.replace(self.tmp, self.path)


def write_shards(train, val, info, dataset_name, out, shard_size, max_side=0):
    """Write both splits and the index into `out` (which must not hold shards yet); returns the index. max_side:
    photos longer than that are written resized to it (0: as they are)."""
    if os.path.exists(os.path.join(out, INDEX)):
        raise DataError(f"{out} already holds shards ({INDEX}); choose an empty --out, or remove them first")
    os.makedirs(out, exist_ok=True)
    shards = {}
    for split, dataset in (("train", train), ("val", val)):
        shards.update(write_split(dataset, out, split, shard_size, max_side))
    facts = facts_of(train, info, dataset_name)
    if max_side and facts.get("transform") == "photos":
        facts["max_side"] = max_side
    index = {"format": FORMAT, "version": 1, "facts": facts, "shards": shards}
    atomic_write(os.path.join(out, INDEX), lambda f: json.dump(index, f, indent=1))
    return index
