"""Any torchvision classification model by name, adapted to the data set's channels, classes and image size."""
from typing import Any

import torch
from torch import nn


def torchvision_names() -> list[str]:
    import torchvision.models as tvm
    from torchvision.models import list_models

    return sorted(list_models(module=tvm))


class _RepeatChannels(nn.Module):
    """Grey images into models built for RGB: repeat the single channel three times (no new parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(-1, 3, -1, -1)


def build_torchvision(name: str, in_channels: int, num_classes: int, image_size: int, **kwargs: Any) -> nn.Module:
    """torchvision's model `name`, untrained, for num_classes classes; kwargs go to its constructor."""
    from torchvision.models import get_model

    model = get_model(name, weights=None, num_classes=num_classes, **kwargs)
    # ResNets downsample 32x before the pooling head; on images under 64 px (CIFAR, MNIST, digits) that leaves
    # nothing to learn from, so use the small-image stem: a 3x3 stride-1 first conv and no max-pool.
    if image_size and image_size < 64 and hasattr(model, "conv1") and hasattr(model, "maxpool"):
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    if in_channels == 1:
        model = nn.Sequential(_RepeatChannels(), model)
    elif in_channels != 3:
        raise ValueError(f"torchvision models take 1 or 3 input channels, the data has {in_channels}")
    return model


def probe(model: nn.Module, in_channels: int, image_size: int) -> None:
    """Run one tiny batch through the model; a model that cannot take this image size fails here, not mid-epoch."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, in_channels, image_size, image_size))
    finally:
        model.train(was_training)
