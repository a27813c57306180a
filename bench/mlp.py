"""A transformer-like MLP for the memory bench (`--model bench.mlp:build`): pre-norm residual blocks of
Linear(d, 4d) -> GELU -> Linear(4d, d) over an image flattened and projected to d, as a transformer's feed-forward
layers hold most of its weights. Width 1024, 4 blocks: 34M parameters, whose AdamW state is 269 MB."""
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class MLP(nn.Module):
    def __init__(self, in_features, num_classes, width=1024, depth=4):
        super().__init__()
        self.embed = nn.Linear(in_features, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, num_classes))

    def forward(self, images):
        return self.head(self.blocks(self.embed(images.flatten(1))))


def build(in_channels, image_size, num_classes, width=1024, depth=4):
    return MLP(in_channels * image_size * image_size, num_classes, width, depth)


def build_wide(in_channels, image_size, num_classes):
    """The slow-link bench's communication-bound model (`--model bench.mlp:build_wide`): width 512, 2 blocks; at
    32 px and 3 channels 5.8M parameters (23 MB of float32 gradients a step) for little compute."""
    return build(in_channels, image_size, num_classes, width=512, depth=2)
