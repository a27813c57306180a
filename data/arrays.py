"""A data set over in-memory image tensors, with the resizing and normalization every array format needs."""
import copy
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from hvd_train.data.augment import Augmentation


class ImageTensorDataset(Dataset):
    """uint8 or float images (N, C, H, W) and integer labels, resized to image_size.

    uint8 images (CIFAR, MNIST, STL-10) stay uint8 through resize and augmentation: the loader hands uint8 batches
    to the device, which normalizes them with this data set's mean and std (hvd_train/trainer.py), a quarter of the
    bytes of float32 and no per-pixel float work in the loader. Float images (the digits: values 0..16) are scaled
    by `scale` and normalized here, as the device cannot tell their range.
    augmented() gives a view of the same tensors whose samples are augmented (data/augment.py), for training.
    """
    augment: Optional[Callable[[torch.Tensor], torch.Tensor]]
    erase: Optional[Callable[[torch.Tensor], torch.Tensor]]

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, image_size: int = 0,
                 mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None,
                 scale: float = 255.0) -> None:
        self.images, self.labels = images, labels.long()
        self.image_size, self.scale = image_size, scale
        channels = images.shape[1]
        self.mean = torch.tensor(mean if mean is not None else [0.0] * channels).view(-1, 1, 1)
        self.std = torch.tensor(std if std is not None else [1.0] * channels).view(-1, 1, 1)
        self.augment = self.erase = None  # on [0, 1] images; on normalized ones

    def augmented(self, augmentation: "Augmentation", kind: str) -> "ImageTensorDataset":
        """This data set with `augmentation` (an Augmentation) of `kind` (natural, digits) applied to every sample;
        itself where augmentation is off."""
        if not augmentation.enabled:
            return self
        view = copy.copy(self)
        size = self.image_size or self.images.shape[-1]
        view.augment = augmentation.tensor_transform(kind, size, self.mean.flatten().tolist(),
                                                     self.std.flatten().tolist())
        view.erase = augmentation.erasing()
        return view

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if image.dtype != torch.uint8:
            image = image.float() / self.scale
        if self.image_size and image.shape[-1] != self.image_size:
            from torchvision.transforms.v2 import functional as TF  # uint8 antialiased resize, as for floats

            image = TF.resize(image, [self.image_size, self.image_size], antialias=True)
        if self.augment is not None:
            image = self.augment(image)
        if image.dtype == torch.uint8:
            return image, self.labels[index]
        image = (image - self.mean) / self.std
        if self.erase is not None:
            image = self.erase(image)
        return image, self.labels[index]
