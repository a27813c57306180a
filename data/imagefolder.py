"""Any tree of images in class folders, as torchvision's ImageFolder reads it.

<data_dir>/train/<class>/*.jpg and <data_dir>/val/<class>/*.jpg (ImageNet's layout); without train/ and val/,
<data_dir>/<class>/*.jpg is split into training and validation by data.val_fraction.
"""
import logging
import os

from data.errors import BadSampleError, DataError

log = logging.getLogger("hvd_train")

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, the usual choice for photographs


def transforms(image_size, train):
    from torchvision import transforms as T

    if train:
        steps = [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()]
    else:
        steps = [T.Resize(int(round(image_size * 256 / 224))), T.CenterCrop(image_size)]
    return T.Compose(steps + [T.ToTensor(), T.Normalize(MEAN, STD)])


def read_image(path):
    """Open an image as RGB; a file that does not decode is named, with the way out."""
    from PIL import Image

    try:
        with open(path, "rb") as f, Image.open(f) as image:
            return image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:  # PIL signals broken files with all three
        raise BadSampleError(f"{path}: cannot read this image ({e}); fix or remove the file, or pass "
                             f"--data.skip_bad_files to leave out every file that does not decode") from None


def decodes(path):
    """Whether the file is an image that decodes completely (a full decode: truncated files fail too)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

    if not has_file_allowed_extension(path, IMG_EXTENSIONS):
        return False
    try:
        read_image(path)
        return True
    except BadSampleError:
        return False


def load(data_dir, image_size, skip_bad_files=False):
    """(train, val, presplit): train/ and val/ trees when present (presplit=True), else the whole tree twice, with
    training and evaluation transforms, for the caller to split by index. With skip_bad_files every image is
    decoded once here and those that fail are left out (and counted in the log)."""
    from torchvision.datasets import ImageFolder

    if not os.path.isdir(data_dir):
        raise DataError(f"image folder not found: {data_dir} does not exist (--data-dir)")
    train_dir, val_dir = os.path.join(data_dir, "train"), os.path.join(data_dir, "val")
    presplit = os.path.isdir(train_dir) and os.path.isdir(val_dir)
    if not presplit:
        train_dir = val_dir = data_dir
    bad = []

    def keep(path):
        ok = decodes(path)
        if not ok and path not in bad:
            bad.append(path)
        return ok

    options = dict(loader=read_image, is_valid_file=keep if skip_bad_files else None)
    try:
        train = ImageFolder(train_dir, transform=transforms(image_size, True), **options)
        val = ImageFolder(val_dir, transform=transforms(image_size, False), **options)
    except (FileNotFoundError, RuntimeError) as e:
        raise DataError(f"image folder {data_dir}: {e}") from None
    if bad:
        log.info("left out %d image(s) that do not decode (--data.skip_bad_files), e.g. %s", len(bad), bad[0])
    if train.classes != val.classes:
        raise DataError(f"{train_dir} and {val_dir} have different class folders")
    return train, val, presplit
