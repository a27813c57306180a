"""scikit-learn's bundled handwritten digits: 1,797 grey 8x8 images of 0-9, shipped with the package (no download)."""
import torch
from torch.utils.data import TensorDataset


def load_digits_dataset():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # Pixels are counts 0..16; scale to 0..1 and add the channel axis the conv layers expect.
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.long)
    return TensorDataset(images, labels)
