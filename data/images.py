"""An image file's pixels as the model's channels, whatever its bit depth: the one conversion every reader uses
(image folders, tar shards, predict).

Pillow converts 16-bit grey images (mode I;16, common for masks, medical and scientific images) to 8 bits by
clipping, so every value above 255 turns white. Here they are scaled (value / 257, so 65535 becomes 255), as Pillow
already does for 16-bit colour. 32-bit integer images whose values fit 16 bits are scaled the same way; other
32-bit and floating-point images have no known range and are refused by name.
"""
import os

SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
# The most pixels an image may have: its header is read before its pixels, so a small file that would decode to
# gigabytes (a PNG of zeros compresses a thousandfold) is refused unread. 8192 x 8192 by default, well past the
# photos and scans models train on; the environment variable raises it for every reader, loader workers included.
MAX_PIXELS_VARIABLE = "HVD_MAX_IMAGE_PIXELS"
MAX_PIXELS = 8192 * 8192
ROWS_AT_ONCE = 2**22  # pixels a 16-bit image is scaled by at a time: the wide temporary stays a few MB


class UnsupportedImage(ValueError):
    """An image too large to decode here, or whose pixel values cannot be brought to 8 bits without a range to
    scale them by."""


def max_pixels():
    value = os.environ.get(MAX_PIXELS_VARIABLE, "")
    if not value:
        return MAX_PIXELS
    if not value.isdigit() or int(value) < 1:
        raise UnsupportedImage(f"{MAX_PIXELS_VARIABLE}={value!r}: give a whole number of pixels, e.g. "
                               f"{MAX_PIXELS * 4}")
    return int(value)


def as_mode(image, mode):
    """`image` converted to `mode` ("L" or "RGB"), 16-bit values scaled rather than clipped; an image of more
    than max_pixels() pixels is refused before it is decoded."""
    import numpy as np
    from PIL import Image

    bound = max_pixels()
    if image.width * image.height > bound:
        raise UnsupportedImage(f"{image.width} x {image.height} pixels, more than the {bound:,} an image may have "
                               f"here; set {MAX_PIXELS_VARIABLE} to raise the bound")
    if image.mode in SIXTEEN_BIT or image.mode == "I":
        values = np.asarray(image)  # uint16 (of either byte order) or int32: no wider copy of the whole image
        if image.mode == "I" and values.size and (values.min() < 0 or values.max() > 65535):
            raise UnsupportedImage(f"a 32-bit integer image with values from {values.min()} to {values.max()}, "
                                   f"outside 16 bits; save it as an 8- or 16-bit PNG")
        scaled = np.empty(values.shape, dtype=np.uint8)
        rows = max(1, ROWS_AT_ONCE // max(1, values.shape[1]))
        for start in range(0, values.shape[0], rows):
            block = values[start:start + rows].astype(np.uint32)
            scaled[start:start + rows] = (block * 255 + 32767) // 65535
        image = Image.fromarray(scaled, "L")
    elif image.mode == "F":
        raise UnsupportedImage("a floating-point image (mode F), whose value range is unknown; save it as an 8- or "
                               "16-bit PNG")
    return image.convert(mode)
