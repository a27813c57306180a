"""scikit-learn's bundled handwritten digits: 1,797 grey 8x8 images of 0-9, shipped with the package (no download)."""
import torch

from data.arrays import ImageTensorDataset


def load_digits_dataset(image_size=0):
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # Pixels are counts 0..16; scaled to 0..1, with the channel axis the conv layers expect.
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1)
    return ImageTensorDataset(images, torch.tensor(bunch.target), image_size=image_size, scale=16.0)
