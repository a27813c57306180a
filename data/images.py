"""Image files and how they become a model's tensors: bounded reads, photos, recorded preprocessing.

Every image file is read by read_image_file(), which bounds what a file handed over can make the reader do: it
opens without blocking (a FIFO never hangs), reads regular files only (a link to /dev/zero, a FIFO, a socket are
refused) and refuses a file of more than max_bytes() bytes before reading any (a sparse 20 GB ".png").
check_resize() refuses, from the header, a resize for the model past max_pixels() (a 20000 x 1 PNG whose shorter
side is scaled to 256). as_mode() is the one conversion to the model's channels that every reader uses (image
folders, tar shards, predict): Pillow converts 16-bit grey images (I;16: masks, medical and scientific images) to
8 bits by clipping, every value above 255 white; here they are scaled (value / 257), as Pillow does for 16-bit
colour, and so are 32-bit integer images whose values fit 16 bits. Other 32-bit and floating-point images have no
known range and are refused by name.

Photos (image folders and their tar shards) become uint8 tensors by one arithmetic on either side of the loader:
decode=cpu  a loader worker decodes each image, cuts its crop out, resizes and flips it, and hands a uint8
            (3, size, size) tensor on: four times fewer bytes than float32, and no per-pixel float work on the CPU
            (normalisation happens on the device: hvd_train/trainer.py);
decode=gpu  a loader worker only reads the file's bytes and header and draws the crop; the training process
            decodes the whole batch with nvjpeg and crops, resizes and flips it there (crop_batch()).
Both draw the same crop for a sample, from the generators its (seed, epoch, index) seeded (data/augment.py):
training's RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3, as torchvision draws it), then a flip with probability
1/2; validation's resize of the shorter side to size * 256/224 and the centre size x size, never random. Why not
torchvision's PIL pipeline: on a 500 x 375 JPEG Pillow's antialiased resize of the crop costs as much as the decode,
and ToTensor + Normalize a third of that again, while libjpeg-turbo (torchvision.io) decodes as fast as Pillow and
torch's uint8 antialiased resize is several times faster; where a crop needs at most half of the image's
resolution, Pillow's JPEG draft mode decodes at 1/2, 1/4 or 1/8 of the size, which saves most of the decode.

Image folders (class folders as torchvision's ImageFolder reads them) are data/folders.py's.

A Preprocessing records how an image file becomes the tensor a model was validated on. A checkpoint and every
export carry it, so `hvd-train predict` (and a user's own inference code) feed a model what its validation set fed
it. Two ways of sizing exist, as in the data sets that ship:
  stretch      arrays (CIFAR, MNIST, STL-10, the digits): pixels / 255, resized to size x size (bilinear,
               antialiased) where the size differs, then (x - mean) / std per channel;
  center_crop  photos (image folders, their shards): the shorter side resized to size * 256 / 224, the centre
               size x size cut out, pixels / 255, then (x - mean) / std (ImageNet's mean and std).
"""
import io
import logging
import math
import os
import stat
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union, cast

import torch
from torch.utils.data import Subset

from hvd_train.data.arrays import ImageTensorDataset
from hvd_train.errors import UNREADABLE_IMAGE, BadSampleError

if TYPE_CHECKING:
    from PIL import Image
    from torch.utils.data import Dataset

SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
# The most pixels an image may have: its header is read before its pixels, so a small file that would decode to
# gigabytes (a PNG of zeros compresses a thousandfold) is refused unread. 8192 x 8192 by default, well past the
# photos and scans models train on; the environment variable raises it for every reader, loader workers included.
MAX_PIXELS_VARIABLE = "HVD_MAX_IMAGE_PIXELS"
MAX_PIXELS = 8192 * 8192
ROWS_AT_ONCE = 2**22  # pixels a 16-bit image is scaled by at a time: the wide temporary stays a few MB
# The most bytes an image file may have: its size is checked on the opened file before any byte is read. 256 MiB,
# far past any photo or scan (an 8192 x 8192 RGB PNG stored uncompressed is 192 MiB); the variable raises it.
MAX_BYTES_VARIABLE = "HVD_MAX_IMAGE_BYTES"
MAX_BYTES = 256 * 2**20
KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


class UnsupportedImage(ValueError):
    """An image too large to decode here, or whose pixel values cannot be brought to 8 bits without a range to
    scale them by."""


def max_pixels() -> int:
    value = os.environ.get(MAX_PIXELS_VARIABLE, "")
    if not value:
        return MAX_PIXELS
    if not value.isdigit() or int(value) < 1:
        raise UnsupportedImage(f"{MAX_PIXELS_VARIABLE}={value!r}: give a whole number of pixels, e.g. "
                               f"{MAX_PIXELS * 4}")
    return int(value)


def max_bytes() -> int:
    value = os.environ.get(MAX_BYTES_VARIABLE, "")
    if not value:
        return MAX_BYTES
    if not value.isdigit() or int(value) < 1:
        raise UnsupportedImage(f"{MAX_BYTES_VARIABLE}={value!r}: give a whole number of bytes, e.g. {MAX_BYTES * 4}")
    return int(value)


def kind_of(mode: int) -> str:
    """What a file that is not a regular one is, in words, from its st_mode."""
    return next((name for test, name in KINDS if test(mode)), "not a regular file")


def read_image_file(path: str) -> bytes:
    """The bytes of the image file at `path`, read within bounds: anything but a regular file is refused (a link
    is followed once, by the open, and what it opened is checked), and so is a file of more than max_bytes()
    bytes, before a byte of it is read; at most its size is read. Raises OSError or UnsupportedImage (a
    ValueError), both among hvd_train/errors.py's UNREADABLE_IMAGE, with the reason in words."""
    bound = max_bytes()
    # Refused unopened where it is plainly no file (opening some devices does something); the descriptor's own
    # fstat below is what decides, as the path may be swapped between the two.
    facts = os.stat(path)
    if not stat.S_ISREG(facts.st_mode):
        raise UnsupportedImage(f"{kind_of(facts.st_mode)}, not a regular file; images are read from files only")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)  # O_NONBLOCK: a FIFO swapped in opens at once, rather than waiting for a writer
    try:
        facts = os.fstat(fd)
        if not stat.S_ISREG(facts.st_mode):
            raise UnsupportedImage(f"{kind_of(facts.st_mode)}, not a regular file; images are read from files only")
        if facts.st_size > bound:
            raise UnsupportedImage(f"{facts.st_size:,} bytes, more than the {bound:,} an image file may have here; "
                                   f"set {MAX_BYTES_VARIABLE} to raise the bound")
        parts, left = [], facts.st_size
        while left > 0:  # one read, unless the file system hands the file over in parts
            part = os.read(fd, left)
            if not part:
                break
            parts.append(part)
            left -= len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)
    finally:
        os.close(fd)


def check_resize(width: int, height: int, new_width: int, new_height: int) -> None:
    """Refuses (UnsupportedImage) resizing a width x height image to new_width x new_height pixels where those are
    more than max_pixels(): an image inside the bound can be resized past it (a 20000 x 1 image whose shorter side
    becomes 256 is 5,120,000 x 256), so the resize's own shape is checked, from the header, before decoding."""
    bound = max_pixels()
    if new_width * new_height > bound:
        raise UnsupportedImage(f"{width} x {height} pixels, which the resize for the model makes {new_width:,} x "
                               f"{new_height:,}, more than the {bound:,} pixels an image may have here; set "
                               f"{MAX_PIXELS_VARIABLE} to raise the bound")


def as_mode(image: "Image.Image", mode: str) -> "Image.Image":
    """`image` converted to `mode` ("L" or "RGB"), 16-bit values scaled rather than clipped; an image of more
    than max_pixels() pixels is refused before it is decoded."""
    import numpy as np
    from PIL import Image

    bound = max_pixels()
    if image.width * image.height > bound:
        raise UnsupportedImage(f"{image.width} x {image.height} pixels, more than the {bound:,} an image may have "
                               f"here; set {MAX_PIXELS_VARIABLE} to raise the bound")
    if image.mode in SIXTEEN_BIT or image.mode == "I":
        values = np.asarray(image)  # uint16 (of either byte order) or int32: no wider copy of the whole image
        if image.mode == "I" and values.size and (values.min() < 0 or values.max() > 65535):
            raise UnsupportedImage(f"a 32-bit integer image with values from {values.min()} to {values.max()}, "
                                   f"outside 16 bits; save it as an 8- or 16-bit PNG")
        scaled = np.empty(values.shape, dtype=np.uint8)
        rows = max(1, ROWS_AT_ONCE // max(1, values.shape[1]))
        for start in range(0, values.shape[0], rows):
            block = values[start:start + rows].astype(np.uint32)
            scaled[start:start + rows] = (block * 255 + 32767) // 65535
        image = Image.fromarray(scaled, "L")
    elif image.mode == "F":
        raise UnsupportedImage("a floating-point image (mode F), whose value range is unknown; save it as an 8- or "
                               "16-bit PNG")
    return image.convert(mode)


SCALE, RATIO = (0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0)  # RandomResizedCrop's defaults, as timm's and torchvision's
JPEG_MAGIC = b"\xff\xd8\xff"


def val_side(size: int) -> int:
    """The shorter side validation resizes an image to before its centre crop (ImageNet's 256 for 224)."""
    return int(round(size * 256 / 224))


def resized_shape(width: int, height: int, side: int) -> tuple[int, int]:
    """(width, height) of an image whose shorter side is resized to `side`, as torchvision's Resize(side)."""
    if width <= height:
        return side, int(side * height / width)
    return int(side * width / height), side


def train_crop(width: int, height: int) -> tuple[tuple[int, int, int, int], bool]:
    """(box, flip): RandomResizedCrop's box (left, top, right, bottom) in the image's pixels and the flip, drawn from
    torch's generator in torchvision's order (its crop, then RandomHorizontalFlip)."""
    from torchvision.transforms import RandomResizedCrop

    # get_params reads only the shape: a tensor of that shape that holds one value
    top, left, h, w = RandomResizedCrop.get_params(torch.empty(1, 1, 1).expand(1, height, width), SCALE, RATIO)
    flip = bool(torch.rand(1) < 0.5)
    return (left, top, left + w, top + h), flip


def center_offsets(width: int, height: int, size: int) -> tuple[int, int, int, int]:
    """(new width, new height, left, top): the shape validation resizes a width x height image to, and where its
    centre size x size starts in it (torchvision's Resize(val_side(size)) then CenterCrop(size))."""
    new_w, new_h = resized_shape(width, height, val_side(size))
    return new_w, new_h, int(round((new_w - size) / 2.0)), int(round((new_h - size) / 2.0))


def val_crop(width: int, height: int, size: int) -> tuple[float, float, float, float]:
    """Validation's box in the image's pixels: the centre size x size of the image resized to val_side(size)."""
    new_w, new_h, left, top = center_offsets(width, height, size)
    sx, sy = width / new_w, height / new_h
    return (left * sx, top * sy, (left + size) * sx, (top + size) * sy)


def header(data: bytes) -> tuple[int, int, bool]:
    """(width, height, is_jpeg) of an encoded image from its header alone; an image over the pixel bound is refused
    before anything is decoded."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        width, height, fmt = image.width, image.height, image.format
    if width * height > max_pixels():
        raise UnsupportedImage(f"{width} x {height} pixels, more than the {max_pixels():,} an image may have here; "
                               f"set HVD_MAX_IMAGE_PIXELS to raise the bound")
    return width, height, fmt == "JPEG" and data[:3] == JPEG_MAGIC


def decode(data: bytes, need: float, facts: Optional[tuple[int, int, bool]] = None) -> tuple[torch.Tensor, float]:
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


def resized_crop(image: torch.Tensor, box: Sequence[float], size: int, flip: bool = False,
                 dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The `box` (left, top, right, bottom, in `image`'s pixels, rounded to whole ones) of an image resized to
    size x size (bilinear, antialiased) and mirrored where `flip` says: in the image's uint8 (the workers), or in
    `dtype` where given (the device's float; only the box is converted)."""
    from torchvision.transforms.v2 import functional as F

    left, top, right, bottom = (int(round(v)) for v in box)
    part = image[:, top:max(bottom, top + 1), left:max(right, left + 1)]
    out = F.resize(part if dtype is None else part.to(dtype), [size, size], antialias=True)
    return out.flip(-1) if flip else out


def center_crop(image: torch.Tensor, width: int, height: int, size: int,
                dtype: Optional[torch.dtype] = None) -> torch.Tensor:
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

    def __init__(self, size: int, train: bool, policy: Optional[Callable[["Image.Image"], "Image.Image"]] = None,
                 encoded: bool = False) -> None:
        self.size, self.train, self.policy, self.encoded = size, train, policy, encoded

    def on_device(self) -> "PhotoTransform":
        """This transform, leaving the decode, crop and flip to the device."""
        return PhotoTransform(self.size, self.train, self.policy, encoded=True)

    def __call__(self, source: Union[str, bytes]) -> Union[torch.Tensor, "Encoded"]:
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

    def from_bytes(self, data: bytes) -> Union[torch.Tensor, "Encoded"]:
        """The transform of an encoded image; one that does not decode raises one of UNREADABLE_IMAGE."""
        width, height, jpeg = header(data)
        # What the resize makes of the image, from the header: the crop at size x size, or for validation the
        # whole image with its shorter side at val_side() (a 20000 x 1 image would be 5,120,000 x 256).
        check_resize(width, height, *((self.size, self.size) if self.train else
                                      resized_shape(width, height, val_side(self.size))))
        box: tuple[float, float, float, float]  # train_crop's whole pixels or val_crop's fractions
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

    def _encoded(self, data: bytes, jpeg: bool, box: Sequence[float], flip: bool) -> "Encoded":
        # A JPEG goes as its bytes, for nvjpeg; any other format (PNG in a JPEG folder) is decoded here.
        image = torch.frombuffer(bytearray(data), dtype=torch.uint8) if jpeg else decode(data, 1.0)[0]
        return Encoded(image, torch.tensor(box, dtype=torch.float64), flip, self.size, self.train)

    def _policy(self, out: torch.Tensor) -> torch.Tensor:
        if self.policy is None:
            return out
        from torchvision.transforms.functional import pil_to_tensor, to_pil_image

        return pil_to_tensor(self.policy(to_pil_image(out)))


class Encoded:
    """One photo as a loader worker hands it on for the device: its JPEG bytes (1-d uint8) or its decoded pixels
    (3-d uint8), the crop's box in the file's pixels, the flip, the side of the square it becomes and whether it
    is a training sample (validation's crop is the centre of the image resized whole)."""

    def __init__(self, image: torch.Tensor, box: torch.Tensor, flip: bool, size: int, train: bool) -> None:
        self.image, self.box, self.flip, self.size, self.train = image, box, flip, size, train


class EncodedBatch:
    """A batch of Encoded photos, for crop_batch(): collated by collate_encoded(). Its JPEGs' bytes travel as one
    flat uint8 tensor with their lengths: a loader worker hands each tensor of a batch over in a shared-memory
    segment of its own, which the training process maps, so one segment a batch instead of one a photo (128 of
    them cost the training process about 40 ms a batch of 128 here). Photos the worker decoded (not JPEGs) travel
    as they are."""

    def __init__(self, images: Sequence[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor, size: int,
                 train: bool) -> None:
        self.boxes, self.flips, self.size, self.train = boxes, flips, size, train
        jpegs = [image for image in images if image.dim() == 1]
        self.jpegs = torch.cat(jpegs) if jpegs else torch.empty(0, dtype=torch.uint8)
        self.lengths = torch.tensor([image.numel() if image.dim() == 1 else 0 for image in images])
        self.decoded = {i: image for i, image in enumerate(images) if image.dim() != 1}

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def images(self) -> list[torch.Tensor]:
        """Each photo: its JPEG's bytes (a 1-d view of the flat tensor) or its pixels (uint8 (3, H, W))."""
        lengths = self.lengths.tolist()
        parts = iter(torch.split(self.jpegs, [n for n in lengths if n]))
        return [next(parts) if n else self.decoded[i] for i, n in enumerate(lengths)]


def collate_encoded(samples: Sequence[tuple[Encoded, Union[int, torch.Tensor]]]) -> tuple[EncodedBatch, torch.Tensor]:
    """[(Encoded, label), ...] -> (EncodedBatch, labels)."""
    photos = [photo for photo, _ in samples]
    return (EncodedBatch([p.image for p in photos], torch.stack([p.box for p in photos]),
                         torch.tensor([p.flip for p in photos]), photos[0].size, photos[0].train),
            torch.tensor([int(label) for _, label in samples]))


def on_device(dataset: "Dataset") -> "Optional[Dataset]":
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


def decode_batch(batch: EncodedBatch, device: torch.device) -> list[torch.Tensor]:
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


def crop_batch(batch: EncodedBatch, images: Sequence[torch.Tensor]) -> torch.Tensor:
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


log = logging.getLogger("hvd_train")

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, the usual choice for photographs


RESIZES = ("stretch", "center_crop")
CLASS_NAMES = {
    "digits": tuple(str(i) for i in range(10)),
    "mnist": tuple(str(i) for i in range(10)),
    "fashion_mnist": ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                      "Ankle boot"),
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
    "stl10": ("airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck"),
}


MAX_SIDE = 8192  # the largest image side a preprocessing record read from a file may ask for


@dataclass(frozen=True)
class Preprocessing:
    channels: int        # 1: the image is converted to grey ("L"); 3: to RGB
    image_size: int      # the model's input is channels x image_size x image_size
    mean: tuple          # per channel, subtracted after scaling pixels to 0..1
    std: tuple           # per channel, divided by after the mean
    resize: str = "stretch"  # RESIZES

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_dict(cls, d: object) -> "Preprocessing":
        if not isinstance(d, dict) or d.get("resize", "stretch") not in RESIZES:
            raise ValueError(f"not a preprocessing record: {d!r}; expected channels, image_size, mean, std and "
                             f"resize (one of {', '.join(RESIZES)})")
        made = cls(int(d["channels"]), int(d["image_size"]), tuple(map(float, d["mean"])),
                   tuple(map(float, d["std"])), d.get("resize", "stretch"))
        # Read from a file: every image is resized to image_size, so it is bounded like any image side.
        if made.channels not in (1, 3) or not 1 <= made.image_size <= MAX_SIDE or \
                len(made.mean) != made.channels or len(made.std) != made.channels:
            raise ValueError(f"not a preprocessing record: channels {made.channels} (1 or 3), image_size "
                             f"{made.image_size} (1 to {MAX_SIDE}), {len(made.mean)} means and {len(made.std)} "
                             f"stds (one per channel)")
        return made

    def transform(self) -> Callable[["Image.Image"], torch.Tensor]:
        """PIL image -> float tensor (channels, image_size, image_size), as validation prepared its samples."""
        from torchvision import transforms as T

        size = self.image_size
        if self.resize == "center_crop":
            steps = [T.Resize(int(round(size * 256 / 224))), T.CenterCrop(size), T.ToTensor()]
        else:
            steps = [T.ToTensor(), T.Resize((size, size), antialias=True)]
        return T.Compose([self.check_size] + steps + [T.Normalize(self.mean, self.std)])

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) that transform() resizes a width x height image to: image_size square (stretch), or
        the shorter side at image_size * 256 / 224 (center_crop, before its centre is cut out)."""
        if self.resize == "center_crop":
            return resized_shape(width, height, val_side(self.image_size))
        return self.image_size, self.image_size

    def check_size(self, image: "Image.Image") -> "Image.Image":
        """A PIL image, unchanged, where its resize stays within the pixel bound; else UnsupportedImage (a very
        thin image resized by its shorter side would be billions of pixels). Reads only its header."""
        check_resize(image.width, image.height, *self.resized(image.width, image.height))
        return image

    def load(self, path: str) -> torch.Tensor:
        """The image file at `path`, ready for the model (without the batch axis). A photo (center_crop, 3 channels)
        goes through validation's own code (Preprocessing below), so predict sees what validation saw."""
        from PIL import Image

        data = read_image_file(path)  # a regular file of a bounded size, or refused unread (read_image_file)
        if self.resize == "center_crop" and self.channels == 3:
            # encoded=False: the transform gives the uint8 tensor, never an Encoded
            pixels = cast(torch.Tensor, PhotoTransform(self.image_size, train=False).from_bytes(data)).float() / 255.0
            return (pixels - torch.tensor(self.mean).view(-1, 1, 1)) / torch.tensor(self.std).view(-1, 1, 1)
        with Image.open(io.BytesIO(data)) as image:
            self.check_size(image)  # from the header, before a pixel is decoded
            return self.transform()(as_mode(image, "L" if self.channels == 1 else "RGB"))


def describe(val_set: object, image_size: int) -> Optional[Preprocessing]:
    """The preprocessing validation applies to the samples of a data set that ships, `val_set` (None where they
    are not images that a file could stand for: synthetic noise)."""
    base = val_set.dataset if isinstance(val_set, Subset) else val_set
    facts = getattr(base, "facts", None)  # tar shards carry their index's facts
    if isinstance(base, ImageTensorDataset):
        return Preprocessing(base.images.shape[1], image_size, tuple(base.mean.flatten().tolist()),
                             tuple(base.std.flatten().tolist()), "stretch")
    if isinstance(facts, dict) and facts.get("transform") == "arrays":  # arrays written as shards
        return Preprocessing(facts["in_channels"], image_size, tuple(facts["mean"]), tuple(facts["std"]), "stretch")
    if hasattr(base, "classes") or (isinstance(facts, dict) and facts.get("transform") == "photos"):
        return Preprocessing(3, image_size, MEAN, STD, "center_crop")
    return None


def class_names(dataset_name: str, val_set: object, user_facts: Optional[Mapping[str, Any]] = None
                ) -> Optional[list[str]]:
    """The classes' names in label order, where the data set knows them (else None: labels are shown as numbers)."""
    if user_facts and user_facts.get("classes"):
        return [str(c) for c in user_facts["classes"]]
    base = val_set.dataset if isinstance(val_set, Subset) else val_set
    named = getattr(base, "classes", None) or (getattr(base, "facts", None) or {}).get("classes")
    if named:
        return [str(c) for c in named]
    source = (getattr(base, "facts", None) or {}).get("source", dataset_name)
    return list(CLASS_NAMES[source]) if source in CLASS_NAMES else None


def of_builtin(dataset_name: str, image_size: int) -> Optional[Preprocessing]:
    """The preprocessing of a data set that ships, from its name alone (checkpoints written before they recorded
    it); None for those whose preprocessing depends on their files (tar shards) or that are not images."""
    from hvd_train.data import cifar, stl10

    size = image_size
    grey = Preprocessing(1, size, (0.0,), (1.0,), "stretch")
    known = {"digits": grey, "mnist": grey, "fashion_mnist": grey,
             "cifar10": Preprocessing(3, size, cifar.CIFAR10.mean, cifar.CIFAR10.std, "stretch"),
             "cifar100": Preprocessing(3, size, cifar.CIFAR100.mean, cifar.CIFAR100.std, "stretch"),
             "stl10": Preprocessing(3, size, stl10.MEAN, stl10.STD, "stretch")}
    if dataset_name == "imagefolder":
        return Preprocessing(3, size, MEAN, STD, "center_crop")
    return known.get(dataset_name)
