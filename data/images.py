"""An image file's pixels as the model's channels, whatever its bit depth: the one conversion every reader uses
(image folders, tar shards, predict).

Pillow converts 16-bit grey images (mode I;16, common for masks, medical and scientific images) to 8 bits by
clipping, so every value above 255 turns white. Here they are scaled (value / 257, so 65535 becomes 255), as Pillow
already does for 16-bit colour. 32-bit integer images whose values fit 16 bits are scaled the same way; other
32-bit and floating-point images have no known range and are refused by name.
"""
SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")


class UnsupportedImage(ValueError):
    """An image whose pixel values cannot be brought to 8 bits without a range to scale them by."""


def as_mode(image, mode):
    """`image` converted to `mode` ("L" or "RGB"), 16-bit values scaled rather than clipped."""
    import numpy as np
    from PIL import Image

    if image.mode in SIXTEEN_BIT or image.mode == "I":
        values = np.asarray(image, dtype=np.int64)
        if values.size and (values.min() < 0 or values.max() > 65535):
            raise UnsupportedImage(f"a 32-bit integer image with values from {values.min()} to {values.max()}, "
                                   f"outside 16 bits; save it as an 8- or 16-bit PNG")
        image = Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8), "L")
    elif image.mode == "F":
        raise UnsupportedImage("a floating-point image (mode F), whose value range is unknown; save it as an 8- or "
                               "16-bit PNG")
    return image.convert(mode)
