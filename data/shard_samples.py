"""A shard's sample from its tar fields: an image and its class (checked against the index's facts), decoded or
left as bytes for the photos' transform, or a user's sample rebuilt from the structure the index records
(data/shard_writer.py writes them; data/shards.py streams them)."""
import io
import json

import numpy as np
import torch

from hvd_train.data.errors import UNREADABLE_IMAGE, BadSampleError
from hvd_train.data.images import as_mode
from hvd_train.uris import redact_all

IMAGE_KEYS = ("png", "jpg", "jpeg", "ppm", "bmp", "pgm", "tif", "tiff", "webp")


def rebuild(sample, shape, url, prefix=""):
    """A user's sample from its tar fields and the structure the index records (data/shard_writer.py): arrays
    read with allow_pickle=False, values as JSON, so a shard cannot run code."""
    if shape == "leaf":
        try:
            if prefix + "npy" in sample:
                return torch.from_numpy(np.load(io.BytesIO(sample[prefix + "npy"]), allow_pickle=False))
            return json.loads(sample[prefix + "json"])
        except KeyError:
            raise BadSampleError(f"shard {url}: sample {sample.get('__key__')} has no field {prefix}npy or "
                                 f"{prefix}json, which the index's structure names; rewrite the shard") from None
        except ValueError as e:
            raise BadSampleError(f"shard {url}: sample {sample.get('__key__')}.{prefix}*: {e}") from None
    kind, parts = shape
    if kind == "dict":
        return {k: rebuild(sample, v, url, f"{prefix}{k}.") for k, v in parts.items()}
    items = [rebuild(sample, v, url, f"{prefix}{j}.") for j, v in enumerate(parts)]
    return tuple(items) if kind == "tuple" else items


def encoded(sample, url, num_classes=None):
    """(image bytes, class, the image's field) from one tar sample; the class is a whole number from 0 to
    num_classes - 1 (the index's facts), else BadSampleError naming the sample: the loss would fail on it mid-epoch."""
    image_key = next((k for k in IMAGE_KEYS if k in sample), None)
    if image_key is None or "cls" not in sample:
        files = sorted(k for k in sample if not k.startswith("__"))
        raise BadSampleError(f"shard {url}: sample {sample.get('__key__')} has {files}; each needs an image "
                             f"({', '.join(IMAGE_KEYS[:3])}, ...) and a .cls file")
    try:
        label = int(sample["cls"])
    except ValueError:  # not a number, or one of more digits than Python converts
        raise BadSampleError(f"shard {redact_all(url)}: sample {str(sample.get('__key__'))[:200]}.cls holds "
                             f"{bytes(sample['cls'][:40])!r}, not a class number; rewrite the shard") from None
    if num_classes is not None and not 0 <= label < num_classes:
        raise BadSampleError(f"shard {redact_all(url)}: sample {str(sample.get('__key__'))[:200]} has class "
                             f"{label}, outside 0 to {num_classes - 1} (the index's facts say num_classes "
                             f"{num_classes}); rewrite the shard or its index with `hvd-train shard`")
    return sample[image_key], label, image_key


def decode(sample, url, channels, num_classes=None):
    """(PIL image, class) from one tar sample."""
    from PIL import Image

    data, label, image_key = encoded(sample, url, num_classes)
    try:
        with Image.open(io.BytesIO(data)) as image:
            return as_mode(image, "L" if channels == 1 else "RGB"), label
    except UNREADABLE_IMAGE as e:
        raise BadSampleError(f"shard {url}: sample {sample['__key__']}.{image_key} does not decode ({e}); rewrite "
                             f"the shard") from None
