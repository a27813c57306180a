"""Random images and labels of any shape, made on the fly: for benchmarks and smoke tests, no files needed."""
import torch
from torch.utils.data import Dataset


class SyntheticDataset(Dataset):
    """Sample i is always the same (seeded by i), so runs are repeatable and nothing is held in memory."""

    def __init__(self, num_samples, channels, image_size, num_classes, seed=0):
        self.num_samples, self.num_classes, self.seed = num_samples, num_classes, seed
        self.shape = (channels, image_size, image_size)

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randn(self.shape, generator=gen)
        label = torch.randint(0, self.num_classes, (), generator=gen)
        return image, label
