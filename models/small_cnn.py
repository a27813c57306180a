"""A small convolutional classifier for digit-sized images (8x8 digits up to 28x28 MNIST)."""
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    import torch


class SmallCNN(nn.Module):
    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            # Pooling to a fixed 4x4 grid makes the head independent of the input size.
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(0.25),
            nn.Linear(2 * width * 16, 128),
            nn.ReLU(inplace=True),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: "torch.Tensor") -> "torch.Tensor":
        return self.head(self.features(x))
