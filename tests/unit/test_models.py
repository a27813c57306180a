"""The models that ship: the VAE's loss terms, shapes for any channels, classes and size, clear refusals."""
import pytest
import torch

from hvd_train.tasks import builtin_task
from hvd_train.models import build_model, model_names, model_task


def test_vae_loss_has_reconstruction_and_kl_terms():
    model = build_model("vae", 1, 10, 8)
    images = torch.rand(5, 1, 8, 8)
    task = builtin_task("vae")
    loss, sums = task.step(model, (images, torch.zeros(5).long()))
    assert sums["loss"].item() == pytest.approx(sums["recon"].item() + sums["kl"].item(), rel=1e-6)
    assert loss.item() == pytest.approx(sums["loss"].item() / 5, rel=1e-6) and sums["kl"].item() >= 0
    assert set(sums) == set(task.keys) == {"count", "loss", "recon", "kl"}
    assert model_task("vae") == "vae" and model_task("resnet50") == "classification"


@pytest.mark.parametrize("name,channels,size", [("small_cnn", 1, 8), ("resnet18", 1, 28), ("resnet18", 3, 32),
                                                ("mobilenet_v3_small", 3, 64), ("vae", 1, 28)])
def test_models_adapt_to_channels_classes_and_size(name, channels, size):
    model = build_model(name, channels, 7, size).eval()
    out = model(torch.randn(2, channels, size, size))
    assert (out[0] if isinstance(out, tuple) else out).shape == ((2, channels, size, size) if name == "vae"
                                                                 else (2, 7))


def test_small_images_get_the_small_image_resnet_stem():
    model = build_model("resnet18", 3, 10, 32)
    assert model.conv1.stride == (1, 1) and isinstance(model.maxpool, torch.nn.Identity)
    assert build_model("resnet18", 3, 10, 224).conv1.stride == (2, 2)


def test_unknown_models_and_too_small_images_are_refused_clearly():
    assert "resnet50" in model_names() and "small_cnn" in model_names()
    with pytest.raises(ValueError, match="unknown model 'vgg9000'"):
        build_model("vgg9000", 1, 10, 8)
    with pytest.raises(ValueError, match="cannot take 3x16x16 images"):
        build_model("alexnet", 3, 10, 16)
