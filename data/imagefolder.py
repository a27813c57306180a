"""Any tree of images in class folders, as torchvision's ImageFolder reads it.

<data_dir>/train/<class>/*.jpg and <data_dir>/val/<class>/*.jpg (ImageNet's layout); without train/ and val/,
<data_dir>/<class>/*.jpg is split into training and validation by data.val_fraction.
"""
import os

from data.errors import DataError

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, the usual choice for photographs


def transforms(image_size, train):
    from torchvision import transforms as T

    if train:
        steps = [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()]
    else:
        steps = [T.Resize(int(round(image_size * 256 / 224))), T.CenterCrop(image_size)]
    return T.Compose(steps + [T.ToTensor(), T.Normalize(MEAN, STD)])


def load(data_dir, image_size):
    """(train, val, presplit): train/ and val/ trees when present (presplit=True), else the whole tree twice, with
    training and evaluation transforms, for the caller to split by index."""
    from torchvision.datasets import ImageFolder

    if not os.path.isdir(data_dir):
        raise DataError(f"image folder not found: {data_dir} does not exist (--data-dir)")
    train_dir, val_dir = os.path.join(data_dir, "train"), os.path.join(data_dir, "val")
    presplit = os.path.isdir(train_dir) and os.path.isdir(val_dir)
    if not presplit:
        train_dir = val_dir = data_dir
    try:
        train = ImageFolder(train_dir, transform=transforms(image_size, True))
        val = ImageFolder(val_dir, transform=transforms(image_size, False))
    except (FileNotFoundError, RuntimeError) as e:
        raise DataError(f"image folder {data_dir}: {e}") from None
    if train.classes != val.classes:
        raise DataError(f"{train_dir} and {val_dir} have different class folders")
    return train, val, presplit
