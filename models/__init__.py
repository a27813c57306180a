"""Model registry: pure nn.Modules built by name. Nothing here knows about Horovod or distribution.

Each model has a task: "classification" (logits, cross-entropy, top-1/top-5) or "vae" (reconstruction + KL).
"""
import torch

from models.small_cnn import SmallCNN
from models.torchvision_models import build_torchvision, probe, torchvision_names
from models.vae import VAE

# name -> (factory(in_channels, num_classes, image_size), task)
MODELS = {
    "small_cnn": (lambda in_channels, num_classes, image_size: SmallCNN(in_channels, num_classes), "classification"),
    "vae": (lambda in_channels, num_classes, image_size: VAE(in_channels * image_size * image_size), "vae"),
}


def model_names():
    return sorted(MODELS) + torchvision_names()


def model_task(name):
    return MODELS[name][1] if name in MODELS else "classification"


def build_model(name, in_channels, num_classes, image_size):
    """Build `name` for images of in_channels x image_size x image_size and num_classes classes."""
    if name in MODELS:
        model = MODELS[name][0](in_channels, num_classes, image_size)
    elif name in torchvision_names():
        model = build_torchvision(name, in_channels, num_classes, image_size)
    else:
        raise ValueError(f"unknown model {name!r}; choose small_cnn, vae or a torchvision model such as resnet18, "
                         f"resnet50, mobilenet_v3_small (--model)")
    try:
        probe(model, in_channels, image_size)
    except RuntimeError as e:
        raise ValueError(f"model {name!r} cannot take {in_channels}x{image_size}x{image_size} images ({e}); "
                         f"choose a larger --image-size") from None
    return model


def to_channels_last(model):
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


def _channels_last_input(module, args):
    images = args[0]
    if images.dim() == 4 and not images.is_contiguous(memory_format=torch.channels_last):
        return (images.contiguous(memory_format=torch.channels_last), *args[1:])
    return None


def is_channels_last(model):
    """Whether every convolution weight of the model is laid out channels-last (and there is at least one)."""
    weights = [p for p in model.parameters() if p.dim() == 4]
    return bool(weights) and all(p.is_contiguous(memory_format=torch.channels_last) for p in weights)
