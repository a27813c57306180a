"""A data set over in-memory image tensors, with the resizing and normalization every array format needs."""
import copy

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset


class ImageTensorDataset(Dataset):
    """uint8 or float images (N, C, H, W) and integer labels; returns float images, resized and normalized.

    Keeping uint8 in memory (CIFAR-10: 150 MB instead of 600 MB) and converting per sample costs little.
    augmented() gives a view of the same tensors whose samples are augmented (data/augment.py), for training.
    """

    def __init__(self, images, labels, image_size=0, mean=None, std=None, scale=255.0):
        self.images, self.labels = images, labels.long()
        self.image_size, self.scale = image_size, scale
        channels = images.shape[1]
        self.mean = torch.tensor(mean if mean is not None else [0.0] * channels).view(-1, 1, 1)
        self.std = torch.tensor(std if std is not None else [1.0] * channels).view(-1, 1, 1)
        self.augment = self.erase = None  # on [0, 1] images; on normalized ones

    def augmented(self, augmentation, kind):
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

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index].float() / self.scale
        if self.image_size and image.shape[-1] != self.image_size:
            image = F.interpolate(image.unsqueeze(0), size=(self.image_size, self.image_size), mode="bilinear",
                                  align_corners=False, antialias=True).squeeze(0)
        if self.augment is not None:
            image = self.augment(image)
        image = (image - self.mean) / self.std
        if self.erase is not None:
            image = self.erase(image)
        return image, self.labels[index]
