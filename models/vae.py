"""A variational autoencoder for small grey images (Kingma and Welling 2014), as in PyTorch's VAE example."""
import torch
from torch import nn


class VAE(nn.Module):
    """Encodes a flattened image to a Gaussian over `latent` dimensions and decodes a sample back to pixels.

    forward() returns (reconstruction in [0, 1], mu, logvar); the loss (reconstruction + KL) is the task's business.
    """

    def __init__(self, in_features: int, hidden: int = 400, latent: int = 20) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(inplace=True))
        self.mu = nn.Linear(hidden, latent)
        self.logvar = nn.Linear(hidden, latent)
        self.decoder = nn.Sequential(nn.Linear(latent, hidden), nn.ReLU(inplace=True),
                                     nn.Linear(hidden, in_features), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.encoder(x)
        mu, logvar = self.mu(h), self.logvar(h)
        # Reparameterization: sample with noise from outside the graph so gradients reach mu and logvar.
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar) if self.training else mu
        return self.decoder(z).view_as(x), mu, logvar
