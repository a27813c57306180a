"""Photos (image folders and their tar shards) as uint8 tensors, by one arithmetic on either side of the loader.

decode=cpu  a loader worker decodes each image, cuts its crop out, resizes it and flips it, and hands a uint8
            (3, size, size) tensor on: four times fewer bytes than float32, and no per-pixel float work on the CPU
            (normalisation happens on the device: hvd_train/feed.py).
decode=gpu  a loader worker only reads the file's bytes and its header, and draws the crop; the training process
            decodes the whole batch with nvjpeg and crops, resizes and flips it there (crop_batch()).

Both draw the same crop for a sample, from the generators its (seed, epoch, index) seeded (data/augment.py):
training's RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3, as torchvision draws it) then a flip with probability
1/2; validation's resize of the shorter side to size * 256/224 and the centre size x size, never random.

Why not torchvision's PIL pipeline: on a 500 x 375 JPEG Pillow's antialiased resize of the crop costs as much as the
decode, and ToTensor + Normalize a third of that again. libjpeg-turbo through torchvision.io decodes as fast as
Pillow, torch's uint8 antialiased resize is several times faster than Pillow's, and the float work moves to the
device. Where a crop needs at most half of the image's resolution (large photos), Pillow's JPEG draft mode decodes
at 1/2, 1/4 or 1/8 of the size inside libjpeg, which is most of the decode saved; what the crop covers stays the
same (its box is scaled with the image).
"""
import io
import math

import torch

from hvd_train.data.errors import UNREADABLE_IMAGE, BadSampleError
from hvd_train.data.images import as_mode, check_resize, max_pixels, read_image_file, UnsupportedImage

SCALE, RATIO = (0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0)  # RandomResizedCrop's defaults, as timm's and torchvision's
JPEG_MAGIC = b"\xff\xd8\xff"


def val_side(size):
    """The shorter side validation resizes an image to before its centre crop (ImageNet's 256 for 224)."""
    return int(round(size * 256 / 224))


def resized_shape(width, height, side):
    """(width, height) of an image whose shorter side is resized to `side`, as torchvision's Resize(side)."""
    if width <= height:
        return side, int(side * height / width)
    return int(side * width / height), side


def train_crop(width, height):
    """(box, flip): RandomResizedCrop's box (left, top, right, bottom) in the image's pixels and the flip, drawn from
    torch's generator in torchvision's order (its crop, then RandomHorizontalFlip)."""
    from torchvision.transforms import RandomResizedCrop

    # get_params reads only the shape: a tensor of that shape that holds one value
    top, left, h, w = RandomResizedCrop.get_params(torch.empty(1, 1, 1).expand(1, height, width), SCALE, RATIO)
    flip = bool(torch.rand(1) < 0.5)
    return (left, top, left + w, top + h), flip


def center_offsets(width, height, size):
    """(new width, new height, left, top): the shape validation resizes a width x height image to, and where its
    centre size x size starts in it (torchvision's Resize(val_side(size)) then CenterCrop(size))."""
    new_w, new_h = resized_shape(width, height, val_side(size))
    return new_w, new_h, int(round((new_w - size) / 2.0)), int(round((new_h - size) / 2.0))


def val_crop(width, height, size):
    """Validation's box in the image's pixels: the centre size x size of the image resized to val_side(size)."""
    new_w, new_h, left, top = center_offsets(width, height, size)
    sx, sy = width / new_w, height / new_h
    return (left * sx, top * sy, (left + size) * sx, (top + size) * sy)


def header(data):
    """(width, height, is_jpeg) of an encoded image from its header alone; an image over the pixel bound is refused
    before anything is decoded (data/images.py)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        width, height, fmt = image.width, image.height, image.format
    if width * height > max_pixels():
        raise UnsupportedImage(f"{width} x {height} pixels, more than the {max_pixels():,} an image may have here; "
                               f"set HVD_MAX_IMAGE_PIXELS to raise the bound")
    return width, height, fmt == "JPEG" and data[:3] == JPEG_MAGIC


def decode(data, need, facts=None):
    """(uint8 RGB tensor (3, H, W), its scale against the file's pixels): `need` is the fewest output pixels a crop
    takes per pixel of the file (below 1/2, a JPEG is decoded reduced, in draft mode). facts: header(data), where
    read already."""
    import numpy as np
    from PIL import Image

    width, height, jpeg = facts or header(data)
    if jpeg and need <= 0.5:
        with Image.open(io.BytesIO(data)) as image:
            image.draft("RGB", (math.ceil(width * need), math.ceil(height * need)))
            image = as_mode(image, "RGB")
        return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1), image.width / width
    if jpeg:
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB), 1.0
        except RuntimeError:
            pass  # Pillow decodes it, or says what is wrong with it
    with Image.open(io.BytesIO(data)) as image:
        image = as_mode(image, "RGB")
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1), 1.0


def resized_crop(image, box, size, flip=False, dtype=None):
    """The `box` (left, top, right, bottom, in `image`'s pixels, rounded to whole ones) of an image resized to
    size x size (bilinear, antialiased) and mirrored where `flip` says: in the image's uint8 (the workers), or in
    `dtype` where given (the device's float; only the box is converted)."""
    from torchvision.transforms.v2 import functional as F

    left, top, right, bottom = (int(round(v)) for v in box)
    part = image[:, top:max(bottom, top + 1), left:max(right, left + 1)]
    out = F.resize(part if dtype is None else part.to(dtype), [size, size], antialias=True)
    return out.flip(-1) if flip else out


def center_crop(image, width, height, size, dtype=None):
    """Validation's crop of an image decoded from a width x height file (at any draft scale): resized whole to the
    shape torchvision's Resize(val_side(size)) gives the file, then its centre size x size, as CenterCrop; in the
    image's uint8, or in `dtype` where given."""
    from torchvision.transforms.v2 import functional as F

    new_w, new_h, left, top = center_offsets(width, height, size)
    resized = F.resize(image if dtype is None else image.to(dtype), [new_h, new_w], antialias=True)
    return resized[:, top:top + size, left:left + size].contiguous()


class PhotoTransform:
    """An encoded photo (a file's path or its bytes) -> uint8 (3, size, size), or with encoded=True the bytes, the
    crop and the flip for crop_batch() to finish on the device. train: random crop and flip, then `policy` (a PIL
    transform: timm's AutoAugment/RandAugment/AugMix, colour jitter) where one is given."""

    def __init__(self, size, train, policy=None, encoded=False):
        self.size, self.train, self.policy, self.encoded = size, train, policy, encoded

    def on_device(self):
        """This transform, leaving the decode, crop and flip to the device."""
        return PhotoTransform(self.size, self.train, self.policy, encoded=True)

    def __call__(self, source):
        if isinstance(source, str):
            try:
                data = read_image_file(source)  # a regular file of a bounded size, or refused unread
            except OSError as e:
                raise BadSampleError(f"{source}: cannot read this image ({e})") from None
            except UNREADABLE_IMAGE as e:  # not a regular file, or one over the byte bound
                raise BadSampleError(f"{source}: cannot read this image ({e}); fix or remove the file, or pass "
                                     f"--data.skip_bad_files to leave out every file that does not decode") from None
            try:
                return self.from_bytes(data)
            except UNREADABLE_IMAGE as e:  # a broken file, or one over the pixel bound
                raise BadSampleError(f"{source}: cannot read this image ({e}); fix or remove the file, or pass "
                                     f"--data.skip_bad_files to leave out every file that does not decode") from None
        return self.from_bytes(source)

    def from_bytes(self, data):
        """The transform of an encoded image; one that does not decode raises one of UNREADABLE_IMAGE."""
        width, height, jpeg = header(data)
        # What the resize makes of the image, from the header: the crop at size x size, or for validation the
        # whole image with its shorter side at val_side() (a 20000 x 1 image would be 5,120,000 x 256).
        check_resize(width, height, *((self.size, self.size) if self.train else
                                      resized_shape(width, height, val_side(self.size))))
        if self.train:
            box, flip = train_crop(width, height)
        else:
            box, flip = val_crop(width, height, self.size), False
        if self.encoded:
            return self._encoded(data, jpeg, box, flip)
        need = self.size / max(1.0, min(box[2] - box[0], box[3] - box[1]))
        image, scale = decode(data, need, (width, height, jpeg))
        if self.train:
            out = resized_crop(image, [v * scale for v in box], self.size, flip)
        else:
            out = center_crop(image, width, height, self.size)
        return self._policy(out)

    def _encoded(self, data, jpeg, box, flip):
        # A JPEG goes as its bytes, for nvjpeg; any other format (PNG in a JPEG folder) is decoded here.
        image = torch.frombuffer(bytearray(data), dtype=torch.uint8) if jpeg else decode(data, 1.0)[0]
        return Encoded(image, torch.tensor(box, dtype=torch.float64), flip, self.size, self.train)

    def _policy(self, out):
        if self.policy is None:
            return out
        from torchvision.transforms.functional import pil_to_tensor, to_pil_image

        return pil_to_tensor(self.policy(to_pil_image(out)))


class Encoded:
    """One photo as a loader worker hands it on for the device: its JPEG bytes (1-d uint8) or its decoded pixels
    (3-d uint8), the crop's box in the file's pixels, the flip, the side of the square it becomes and whether it
    is a training sample (validation's crop is the centre of the image resized whole)."""

    def __init__(self, image, box, flip, size, train):
        self.image, self.box, self.flip, self.size, self.train = image, box, flip, size, train


class EncodedBatch:
    """A batch of Encoded photos, for crop_batch(): collated by collate_encoded(). Its JPEGs' bytes travel as one
    flat uint8 tensor with their lengths: a loader worker hands each tensor of a batch over in a shared-memory
    segment of its own, which the training process maps, so one segment a batch instead of one a photo (128 of
    them cost the training process about 40 ms a batch of 128 here). Photos the worker decoded (not JPEGs) travel
    as they are."""

    def __init__(self, images, boxes, flips, size, train):
        self.boxes, self.flips, self.size, self.train = boxes, flips, size, train
        jpegs = [image for image in images if image.dim() == 1]
        self.jpegs = torch.cat(jpegs) if jpegs else torch.empty(0, dtype=torch.uint8)
        self.lengths = torch.tensor([image.numel() if image.dim() == 1 else 0 for image in images])
        self.decoded = {i: image for i, image in enumerate(images) if image.dim() != 1}

    def __len__(self):
        return len(self.lengths)

    @property
    def images(self):
        """Each photo: its JPEG's bytes (a 1-d view of the flat tensor) or its pixels (uint8 (3, H, W))."""
        lengths = self.lengths.tolist()
        parts = iter(torch.split(self.jpegs, [n for n in lengths if n]))
        return [next(parts) if n else self.decoded[i] for i, n in enumerate(lengths)]


def collate_encoded(samples):
    """[(Encoded, label), ...] -> (EncodedBatch, labels)."""
    photos = [photo for photo, _ in samples]
    return (EncodedBatch([p.image for p in photos], torch.stack([p.box for p in photos]),
                         torch.tensor([p.flip for p in photos]), photos[0].size, photos[0].train),
            torch.tensor([int(label) for _, label in samples]))


def on_device(dataset):
    """A view of a data set of photos (an image folder, or a Subset of one) whose samples leave decoding to the
    device; None where its transform is not a PhotoTransform."""
    import copy

    from torch.utils.data import Subset

    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    transform = getattr(base, "transform", None)
    if not isinstance(transform, PhotoTransform):
        return None
    view = copy.copy(base)
    view.transform = transform.on_device()
    return Subset(view, dataset.indices) if isinstance(dataset, Subset) else view


def decode_batch(batch, device):
    """The batch's images decoded on `device` (uint8 (3, H, W) each): its JPEGs in one batched nvjpeg call on a GPU
    (libjpeg-turbo on a CPU), the images a worker decoded already copied over."""
    from torchvision.io import ImageReadMode, decode_jpeg

    decoded = batch.images
    jpegs = [i for i, image in enumerate(decoded) if image.dim() == 1]
    if jpegs:
        out = decode_jpeg([decoded[i] for i in jpegs], mode=ImageReadMode.RGB, device=device)
        for i, image in zip(jpegs, out):
            decoded[i] = image
    return [image.to(device, non_blocking=True) for image in decoded]


def crop_batch(batch, images):
    """float32 (N, 3, size, size) in 0..255 from an EncodedBatch whose images are decoded (`images`, uint8
    (3, H, W) each, on any device): training's boxes resized and mirrored as resized_crop() does, validation's
    centre crop as center_crop() does: the same functions, in float on the device."""
    size, out = batch.size, []
    for image, box, flip in zip(images, batch.boxes.tolist(), batch.flips.tolist()):
        if batch.train:
            out.append(resized_crop(image, box, size, flip, torch.float32))
        else:
            out.append(center_crop(image, image.shape[-1], image.shape[-2], size, torch.float32))
    return torch.stack(out).clamp_(0, 255)
