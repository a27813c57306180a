"""Any tree of images in class folders, as torchvision's ImageFolder reads it: <data_dir>/train/<class>/*.jpg and
<data_dir>/val/<class>/*.jpg (ImageNet's layout); without train/ and val/, <data_dir>/<class>/*.jpg is split into
training and validation by data.val_fraction. Each file goes through the photo pipeline of data/images.py.

A module of its own because it subclasses torchvision's ImageFolder: it is imported where an image folder is read
(the imagefolder data set, tar shards of photos, predict), so the app trains without torchvision installed.
"""
import collections
import logging
import os
from typing import TYPE_CHECKING, Optional, Sequence

from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

from hvd_train.data.download import contents
from hvd_train.data.images import (MEAN, PhotoTransform, as_mode, check_resize, read_image_file, resized_shape,
                                   val_side)
from hvd_train.errors import UNREADABLE_IMAGE, BadSampleError, DataError

if TYPE_CHECKING:
    from PIL import Image

    from hvd_train.data.augment import Augmentation

log = logging.getLogger("hvd_train")


def transforms(image_size: int, train: bool, augment: "Optional[Augmentation]" = None) -> PhotoTransform:
    """A file's path (or its bytes) -> uint8 (3, size, size) (data/images.py). Training: RandomResizedCrop and flip,
    then timm's policy or colour jitter where --aa or --color-jitter ask for them (augment: a
    data.augment.Augmentation; off: the evaluation transform). Evaluation: resize, centre crop. Normalisation and
    random erasing happen on the device (hvd_train/trainer.py)."""

    train = train and (augment is None or augment.enabled)
    policy = augment.pil_policy(image_size, MEAN) if train and augment is not None else None
    return PhotoTransform(image_size, train, policy)


def path_of(path: str) -> str:
    """ImageFolder's loader: the path itself, for the transform to read (it decodes only what its crop needs)."""
    return path


def read_image(path: str, image_size: Optional[int] = None) -> "Image.Image":
    """Open an image as RGB; a file that does not decode is named, with the way out. Read by the bounded reader
    (data/images.py: regular files of a bounded size only); with image_size, one whose resize for validation would
    pass the pixel bound is refused too, from its header."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(read_image_file(path))) as image:
            if image_size:
                check_resize(image.width, image.height, *resized_shape(image.width, image.height,
                                                                       val_side(image_size)))
            return as_mode(image, "RGB")
    except UNREADABLE_IMAGE as e:  # a broken file, or one over Pillow's pixel limit
        raise BadSampleError(f"{path}: cannot read this image ({e}); fix or remove the file, or pass "
                             f"--data.skip_bad_files to leave out every file that does not decode") from None


def is_image_file(path: str) -> bool:
    """Whether ImageFolder should read the file: an image extension, and not hidden (macOS leaves .DS_Store and
    ._name.jpg resource forks beside images; editors leave .name.swp)."""
    return not os.path.basename(path).startswith(".") and has_file_allowed_extension(path, IMG_EXTENSIONS)


def decodes(path: str, image_size: Optional[int] = None) -> bool:
    """Whether the file is an image that decodes completely (a full decode: truncated files fail too), and that
    training and validation at image_size can resize within the pixel bound."""
    try:
        read_image(path, image_size)
        return True
    except BadSampleError:
        return False


def load(data_dir: str, image_size: int, skip_bad_files: bool = False, augment: "Optional[Augmentation]" = None
         ) -> tuple["ClassFolders", "ClassFolders", bool]:
    """(train, val, presplit): train/ and val/ trees when present (presplit=True), else the whole tree twice, with
    training and evaluation transforms, for the caller to split by index. Files that are not images by name are
    ignored; with skip_bad_files every image is decoded once here and those that fail are left out (and counted)."""
    if not os.path.isdir(data_dir):
        raise DataError(f"image folder not found: {data_dir} does not exist (--data-dir)")
    train_dir, val_dir = os.path.join(data_dir, "train"), os.path.join(data_dir, "val")
    presplit = os.path.isdir(train_dir) and os.path.isdir(val_dir)
    if not presplit:
        train_dir = val_dir = data_dir
    for root in dict.fromkeys((train_dir, val_dir)):
        check_classes(root)
    if presplit:
        check_same_classes(data_dir, class_folders(train_dir), class_folders(val_dir))
    bad = []

    def keep(path: str) -> bool:
        if not is_image_file(path):
            return False
        if not skip_bad_files or decodes(path, image_size):
            return True
        if path not in bad:
            bad.append(path)
        return False

    try:
        train = ClassFolders(train_dir, transform=transforms(image_size, True, augment), loader=path_of,
                             is_valid_file=keep)
        val = ClassFolders(val_dir, transform=transforms(image_size, False), loader=path_of, is_valid_file=keep)
    except FileNotFoundError as e:  # a class whose every image was left out as undecodable
        raise DataError(f"image folder {data_dir}: {e}; {len(bad)} file(s) do not decode, e.g. {bad[:1]}: fix them "
                        f"or remove those class folders") from None
    if bad:
        log.info("left out %d image(s) that do not decode (--data.skip_bad_files), e.g. %s", len(bad), bad[0])
    check_same_classes(data_dir, train.classes, val.classes)
    warn_lonely_classes(train, presplit)
    return train, val, presplit


def check_same_classes(data_dir: str, train: Sequence[str], val: Sequence[str], shown: int = 10) -> None:
    """train/ and val/ must hold the same class folders (a class is its folder's index in sorted order): else a
    DataError naming the classes only in train/ and those only in val/ (the first `shown` of each)."""
    if list(train) == list(val):
        return

    def named(classes: list[str]) -> str:
        more = f" and {len(classes) - shown} more" if len(classes) > shown else ""
        return (", ".join(classes[:shown]) + more) if classes else "none"

    only_train = sorted(set(train) - set(val))
    only_val = sorted(set(val) - set(train))
    raise DataError(f"image folder {data_dir}: train/ and val/ have different class folders: only in train/: "
                    f"{named(only_train)}; only in val/: {named(only_val)}; give both the same class folders (a "
                    f"class is known by its folder's place in sorted order)")


def warn_lonely_classes(train: "ClassFolders", presplit: bool) -> None:
    """A class with one image cannot be both learnt and validated (the split puts it on one side), which is most
    often a misplaced file or folder: said, as training can still go on."""
    counts = collections.Counter(label for _, label in train.samples)
    lonely = [train.classes[c] for c in range(len(train.classes)) if counts[c] < 2]
    if lonely:
        where = "its training folder" if presplit else "it"
        log.info("warning: image folder: class(es) %s have fewer than 2 images in %s, so they cannot be both trained "
                 "on and validated; check for a misplaced file or folder", ", ".join(lonely[:5]), where)


class ClassFolders(ImageFolder):
    """torchvision's ImageFolder without hidden folders as classes (.ipynb_checkpoints, .snapshot, .Trash)."""

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        classes = class_folders(directory)
        return classes, {name: i for i, name in enumerate(classes)}


def class_folders(root: str) -> list[str]:
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def check_classes(root: str) -> None:
    """One folder per class, each holding at least one image file: else a message that names the folders."""
    classes = class_folders(root)
    if not classes:
        raise DataError(f"image folder {root}: {contents(root)}, but no class folders; ImageFolder reads "
                        f"{root}/<class>/<image> (one folder per class), optionally under train/ and val/")
    empty = [c for c in classes if not any(is_image_file(os.path.join(folder, f))
                                           for folder, _, files in os.walk(os.path.join(root, c)) for f in files)]
    if empty:
        raise DataError(f"image folder {root}: class folder(s) {', '.join(empty)} hold no image files ("
                        f"{', '.join(IMG_EXTENSIONS)}); put images in them or remove them (each folder is a class)")
