"""How an image file becomes the tensor a model was validated on, recorded with its weights.

A checkpoint and every export carry this record, so `hvd-train predict` (and a user's own inference code) feed a
model what its validation set fed it: the channels, the size and how the image is brought to it, the value scale
and the normalisation. Two ways of sizing exist, as in the data sets that ship:
  stretch      arrays (CIFAR, MNIST, STL-10, the digits): pixels / 255, resized to size x size (bilinear,
               antialiased) where the size differs, then (x - mean) / std per channel;
  center_crop  photos (image folders, their shards): the shorter side resized to size * 256 / 224, the centre
               size x size cut out, pixels / 255, then (x - mean) / std (ImageNet's mean and std).
"""
from dataclasses import asdict, dataclass
from typing import Optional

from torch.utils.data import Subset

from hvd_train.data.images import as_mode, check_resize, read_image_file
from hvd_train.data.arrays import ImageTensorDataset

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

    def to_dict(self):
        return {**asdict(self), "mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_dict(cls, d):
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

    def transform(self):
        """PIL image -> float tensor (channels, image_size, image_size), as validation prepared its samples."""
        from torchvision import transforms as T

        size = self.image_size
        if self.resize == "center_crop":
            steps = [T.Resize(int(round(size * 256 / 224))), T.CenterCrop(size), T.ToTensor()]
        else:
            steps = [T.ToTensor(), T.Resize((size, size), antialias=True)]
        return T.Compose([self.check_size] + steps + [T.Normalize(self.mean, self.std)])

    def resized(self, width, height):
        """(width, height) that transform() resizes a width x height image to: image_size square (stretch), or
        the shorter side at image_size * 256 / 224 (center_crop, before its centre is cut out)."""
        if self.resize == "center_crop":
            from hvd_train.data.photos import resized_shape, val_side

            return resized_shape(width, height, val_side(self.image_size))
        return self.image_size, self.image_size

    def check_size(self, image):
        """A PIL image, unchanged, where its resize stays within the pixel bound; else UnsupportedImage (a very
        thin image resized by its shorter side would be billions of pixels). Reads only its header."""
        check_resize(image.width, image.height, *self.resized(image.width, image.height))
        return image

    def load(self, path):
        """The image file at `path`, ready for the model (without the batch axis). A photo (center_crop, 3 channels)
        goes through validation's own code (data/photos.py), so predict sees what validation saw."""
        import io

        import torch
        from PIL import Image

        data = read_image_file(path)  # a regular file of a bounded size, or refused unread (data/images.py)
        if self.resize == "center_crop" and self.channels == 3:
            from hvd_train.data.photos import PhotoTransform

            pixels = PhotoTransform(self.image_size, train=False).from_bytes(data).float() / 255.0
            return (pixels - torch.tensor(self.mean).view(-1, 1, 1)) / torch.tensor(self.std).view(-1, 1, 1)
        with Image.open(io.BytesIO(data)) as image:
            self.check_size(image)  # from the header, before a pixel is decoded
            return self.transform()(as_mode(image, "L" if self.channels == 1 else "RGB"))


def describe(val_set, image_size) -> Optional[Preprocessing]:
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
        from hvd_train.data.imagefolder import MEAN, STD

        return Preprocessing(3, image_size, MEAN, STD, "center_crop")
    return None


def class_names(dataset_name, val_set, user_facts=None):
    """The classes' names in label order, where the data set knows them (else None: labels are shown as numbers)."""
    if user_facts and user_facts.get("classes"):
        return [str(c) for c in user_facts["classes"]]
    base = val_set.dataset if isinstance(val_set, Subset) else val_set
    named = getattr(base, "classes", None) or (getattr(base, "facts", None) or {}).get("classes")
    if named:
        return [str(c) for c in named]
    source = (getattr(base, "facts", None) or {}).get("source", dataset_name)
    return list(CLASS_NAMES[source]) if source in CLASS_NAMES else None


def of_builtin(dataset_name, image_size):
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
        from hvd_train.data.imagefolder import MEAN, STD

        return Preprocessing(3, size, MEAN, STD, "center_crop")
    return known.get(dataset_name)
