"""hvd-train shard: write a data set (one that ships, or your own map-style one) as WebDataset tar shards and their
index, for training from them with --dataset shards.

    hvd-train shard --from imagefolder --data-dir photos/ --out shards/ --shard-size 5000
    hvd-train shard --from myproj.data:datasets --data-args size=64 --out shards/   # your factory, any samples
    horovodrun -np 8 ... train_hvd.py --dataset shards \
        --data.train_shards 'shards/train-{000000..000099}.tar' --data.val_shards 'shards/val-{000000..000003}.tar'

Images go in as they are stored: an image folder's files byte for byte (a JPEG stays that JPEG; --max-side resizes
the larger ones), arrays (CIFAR, MNIST, STL-10, the digits) as lossless PNG. A user's samples go in as they are
(tensors as .npy, numbers and text as .json, their tuple and dict nesting in the index), and come back out the same.
Each split becomes OUT/{train,val}-NNNNNN.tar of at most --shard-size samples, each written whole under a temporary
name and then renamed, and OUT/index.json lists every shard's sample count and the facts the model needs. Reading
them back is data/shards.py's.
"""
import argparse
import io
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Iterator, Sequence, Union, cast

import numpy as np
import torch
from torch.utils.data import Subset

from hvd_train.config import DataConfig, parse_mapping
from hvd_train.config.schema import MAX_IMAGE_SIDE
from hvd_train.data import build_datasets, dataset_factory
from hvd_train.data.arrays import ImageTensorDataset
from hvd_train.data.catalog import DATASETS
from hvd_train.data.images import as_mode, read_image_file
from hvd_train.data.shards import FORMAT, INDEX
from hvd_train.errors import UNREADABLE_IMAGE, ConfigError, DataError
from hvd_train.files import atomic_write, temporary_beside
from hvd_train.provenance import is_import_path

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from hvd_train.data import DataInfo

SHIPPED = sorted(name for name in DATASETS if name not in ("synthetic", "shards"))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hvd-train shard", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", required=True, metavar="DATASET",
                   help=f"the data set to write, read from --data-dir as for training: one of "
                   f"{', '.join(SHIPPED)}, or your own factory as package.module:name (its samples are written as "
                   f"they are: tensors, numbers, text, in tuples or dicts)")
    p.add_argument("--data-args", default={}, type=parse_mapping, metavar="KEY=VALUE,...",
                   help="keyword arguments for your own data set factory, as train_hvd.py --data-args")
    p.add_argument("--data-dir", default="datasets", help="where that data set is (default: %(default)s)")
    p.add_argument("--download", action="store_true", help="fetch it into --data-dir first where it is missing "
                   "(needs internet), as train_hvd.py --download does")
    p.add_argument("--out", required=True, help="the directory the shards and index.json go to (new or empty)")
    p.add_argument("--shard-size", type=int, default=10000, help="samples per shard (default: %(default)s); at "
                   "least one shard per rank: a job on N ranks needs N training shards or more")
    p.add_argument("--image-size", type=int, default=0, help="the facts' image size (0: the data set's own)")
    p.add_argument("--max-side", type=int, default=0, metavar="N",
                   help="photos (image folders): images longer than N pixels on their longer side are written "
                   "resized to N there (JPEG quality 90, PNG stays PNG); smaller files go as they are. Decoding then "
                   "costs what an image of that size costs, whatever the camera wrote (0: every file as it is; "
                   "recorded in the index)")
    p.add_argument("--val-fraction", type=float, default=0.2, help="held out where the data set has no split")
    p.add_argument("--split-seed", type=int, default=0, help="seed of that split")
    args = p.parse_args(argv)
    if args.source not in SHIPPED and not is_import_path(args.source):
        p.error(f"--from {args.source}: choose one of {', '.join(SHIPPED)}, or give your own data set factory as "
                f"package.module:name")
    if args.max_side < 0 or args.max_side > MAX_IMAGE_SIDE:
        p.error(f"--max-side {args.max_side}: give a side in pixels, 1 to {MAX_IMAGE_SIDE}, or 0 to keep every "
                f"file as it is (e.g. 512 for training at 224)")
    if args.shard_size < 1:
        p.error(f"--shard-size {args.shard_size}: must be a positive number of samples")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    try:
        fetch = getattr(dataset_factory(args.source), "download", None)
        if args.download and fetch is not None:
            fetch(args.data_dir)
        dc = DataConfig(dataset=args.source, data_dir=args.data_dir, image_size=args.image_size,
                        val_fraction=args.val_fraction, split_seed=args.split_seed, args=args.data_args)
        train, val, info = build_datasets(dc)
        index = write_shards(train, val, info, args.source, args.out, args.shard_size, args.max_side)
    except (DataError, ConfigError) as e:
        print(f"hvd-train shard: error: {e}", file=sys.stderr)
        return 2
    shards = index["shards"]
    for split in ("train", "val"):
        names = sorted(n for n in shards if n.startswith(f"{split}-"))
        print(f"{split}: {sum(shards[n] for n in names)} samples in {len(names)} shard(s): "
              f"--data.{split}_shards '{args.out.rstrip('/')}/{split}-{{{names[0][len(split) + 1:-4]}.."
              f"{names[-1][len(split) + 1:-4]}}}.tar'")
    print(f"index: {args.out.rstrip('/')}/index.json")
    return 0


def raw_samples(dataset: "Dataset", max_side: int = 0) -> Iterator[dict[str, Union[bytes, str]]]:
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


def bounded(data: bytes, extension: str, max_side: int, path: str) -> tuple[str, bytes]:
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


def encode(sample: Any, where: str, prefix: str = "") -> Iterator[tuple[str, bytes]]:
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


def structure(sample: object) -> Union[str, list[Any]]:
    """The shape of a sample's nesting, for the reader to rebuild it: "leaf", ["tuple"|"list", [...]], or
    ["dict", {key: ...}]."""
    if isinstance(sample, dict):
        return ["dict", {k: structure(v) for k, v in sorted(sample.items())}]
    if isinstance(sample, (tuple, list)):
        return [type(sample).__name__, [structure(v) for v in sample]]
    return "leaf"


def png(image: torch.Tensor, scale: float) -> bytes:
    """A (C, H, W) image tensor as PNG bytes: uint8 as it is, floats in 0..scale mapped to 0..255."""
    from PIL import Image

    pixels = image.numpy()
    if pixels.dtype != np.uint8:
        pixels = np.clip(np.rint(pixels / scale * 255), 0, 255).astype(np.uint8)
    pixels = pixels[0] if pixels.shape[0] == 1 else pixels.transpose(1, 2, 0)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def facts_of(dataset: "Dataset", info: "DataInfo", dataset_name: str) -> dict[str, Any]:
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


def write_split(dataset: "Dataset", out: str, split: str, shard_size: int, max_side: int = 0) -> dict[str, int]:
    """{shard name: samples} for the split's shards, each written whole under a temporary name of its own (never
    through a link someone planted in --out), then renamed."""
    counts: dict[str, int]
    counts, shard, name, key = {}, None, None, 0
    for fields in raw_samples(dataset, max_side):
        if shard is None or counts[cast(str, name)] == shard_size:
            if shard is not None:
                shard.close()
            name = f"{split}-{len(counts):06d}.tar"
            counts[name] = 0
            shard = Shard(os.path.join(out, name))
        shard.writer.write({"__key__": f"{key:09d}", **fields})
        counts[cast(str, name)] += 1
        key += 1
    if shard is not None:
        shard.close()
    return counts


class Shard:
    """A tar shard being written: a TarWriter on a new file beside `path`, renamed to `path` when finished."""

    def __init__(self, path: str) -> None:
        from webdataset import TarWriter

        fd, self.tmp = temporary_beside(path)
        self.path, self.file = path, os.fdopen(fd, "wb")
        self.writer = TarWriter(self.file)

    def close(self) -> None:
        self.writer.close()
        self.file.close()
        os.replace(self.tmp, self.path)


def write_shards(train: "Dataset", val: "Dataset", info: "DataInfo", dataset_name: str, out: str, shard_size: int,
                 max_side: int = 0) -> dict[str, Any]:
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
