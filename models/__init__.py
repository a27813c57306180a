"""Model registry: pure nn.Modules built by name. Nothing here knows about Horovod or distribution.

Every model that ships is a factory called with keyword arguments, the data set's facts (in_channels, num_classes,
image_size) and the user's extra ones (--model-args): the same way the app calls a user's own factory
(hvd_train/registry.py). Each has a task: "classification" (logits, cross-entropy, top-1/top-5) or "vae".
"""
import functools
from typing import Any, Callable, Optional

import torch

from hvd_train.models.small_cnn import SmallCNN
from hvd_train.models.timm_models import build_timm, timm_names
from hvd_train.models.torchvision_models import build_torchvision, probe, torchvision_names
from hvd_train.models.vae import VAE


def _small_cnn(in_channels: int, num_classes: int, image_size: int, width: int = 32) -> SmallCNN:
    return SmallCNN(in_channels, num_classes, width)


def _vae(in_channels: int, num_classes: int, image_size: int, hidden: int = 400, latent: int = 20) -> VAE:
    return VAE(in_channels * image_size * image_size, hidden=hidden, latent=latent)


MODELS: dict[str, Callable[..., torch.nn.Module]] = {
    "small_cnn": _small_cnn, "vae": _vae}  # name -> factory; torchvision's and timm's are found by name
MODEL_TASKS = {"vae": "vae"}  # the task of a model that is not a classifier
TIMM_PREFIX = "timm/"
CHOICES = "choose small_cnn, vae, a torchvision classification model (resnet18, resnet50, mobilenet_v3_small, ...) " \
          "or timm/NAME for any of timm's models (timm/resnet50d, timm/vit_tiny_patch16_224, ...)"


def model_names() -> list[str]:
    return sorted(MODELS) + torchvision_names()


def model_task(name: str) -> str:
    """The task a model that ships is trained for (a user's model: classification unless --task says otherwise)."""
    return MODEL_TASKS.get(name, "classification")


def find_model(name: str) -> Optional[Callable[..., torch.nn.Module]]:
    """The factory of a model that ships with this name, or None. Naming a small model needs no torchvision."""
    if name in MODELS:
        return MODELS[name]
    if name.startswith(TIMM_PREFIX):
        timm_name = name[len(TIMM_PREFIX):]
        return functools.partial(build_timm, timm_name) if timm_name in timm_names() else None
    if name in torchvision_names():
        return functools.partial(build_torchvision, name)
    return None


def build_model(name: str, in_channels: int, num_classes: int, image_size: int, **args: Any) -> torch.nn.Module:
    """Build model `name` that ships for images of in_channels x image_size x image_size and num_classes classes."""
    factory = find_model(name)
    if factory is None:
        raise ValueError(f"unknown model {name!r}; {CHOICES} (--model)")
    return checked(name, factory(in_channels=in_channels, num_classes=num_classes, image_size=image_size, **args),
                   in_channels, image_size)


def checked(name: str, model: torch.nn.Module, in_channels: int, image_size: int) -> torch.nn.Module:
    """`model`, after one tiny batch went through it: one that cannot take this image size fails here."""
    try:
        probe(model, in_channels, image_size)
    except RuntimeError as e:
        raise ValueError(f"model {name!r} cannot take {in_channels}x{image_size}x{image_size} images ({e}); "
                         f"choose a larger --image-size") from None
    return model


def to_channels_last(model: torch.nn.Module) -> torch.nn.Module:
    """Lay out the model's convolution weights channels-last (NHWC), and each input batch too, whichever loop feeds it.

    On GPUs, cuDNN's tensor-core convolutions (bf16, fp16) work in NHWC: with NCHW tensors every convolution pays for
    a transpose. Weights are converted here once; inputs in a forward pre-hook (the modules and their state_dict keys
    stay as they are). A model without 4-D weights (the VAE) has nothing to convert: ValueError.
    """
    if not any(p.dim() == 4 for p in model.parameters()):
        raise ValueError("the model has no convolution (4-D) weights, so channels-last memory format does not apply")
    model.to(memory_format=torch.channels_last)
    model.register_forward_pre_hook(_channels_last_input)
    return model


def _channels_last_input(module: torch.nn.Module, args: tuple[Any, ...]) -> Optional[tuple[Any, ...]]:
    images = args[0]
    if images.dim() == 4 and not images.is_contiguous(memory_format=torch.channels_last):
        return (images.contiguous(memory_format=torch.channels_last), *args[1:])
    return None


def is_channels_last(model: torch.nn.Module) -> bool:
    """Whether every convolution weight of the model is laid out channels-last (and there is at least one)."""
    weights = [p for p in model.parameters() if p.dim() == 4]
    return bool(weights) and all(p.is_contiguous(memory_format=torch.channels_last) for p in weights)
