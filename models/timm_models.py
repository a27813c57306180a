"""Any of timm's models by name (timm/NAME): the field's model zoo, built untrained (weights come from a local file
with --init-from, never from a download)."""
import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


@functools.lru_cache(maxsize=1)
def timm_names() -> frozenset[str]:
    import timm

    return frozenset(timm.list_models())


def build_timm(name: str, in_channels: int, num_classes: int, image_size: int, **kwargs: Any) -> "nn.Module":
    """timm's model `name` for in_channels-channel images and num_classes classes; kwargs go to timm.create_model
    (drop_rate, drop_path_rate, ...). Models with a fixed input size (ViTs) are built for image_size."""
    import timm

    if "img_size" not in kwargs and _takes_img_size(name):
        kwargs["img_size"] = image_size
    return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_channels, **kwargs)


def _takes_img_size(name: str) -> bool:
    """Whether timm's model `name` is built for one input size (its default config has no flexible size)."""
    import timm

    cfg = timm.get_pretrained_cfg(name)
    return cfg is not None and bool(getattr(cfg, "fixed_input_size", False))
