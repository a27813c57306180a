"""Model registry: pure nn.Modules, built by name. Nothing here knows about Horovod or distribution."""
from models.small_cnn import SmallCNN

# name -> factory(in_channels, num_classes, image_size)
MODELS = {
    "small_cnn": lambda in_channels, num_classes, image_size: SmallCNN(in_channels, num_classes),
}


def build_model(name, in_channels, num_classes, image_size):
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(sorted(MODELS))} (--model)")
    return MODELS[name](in_channels, num_classes, image_size)
