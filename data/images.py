"""An image file's pixels as the model's channels, whatever its bit depth: the one conversion every reader uses
(image folders, tar shards, predict).

Pillow converts 16-bit grey images (mode I;16, common for masks, medical and scientific images) to 8 bits by
clipping, so every value above 255 turns white. Here they are scaled (value / 257, so 65535 becomes 255), as Pillow
already does for 16-bit colour. 32-bit integer images whose values fit 16 bits are scaled the same way; other
32-bit and floating-point images have no known range and are refused by name.

Every image file is read by read_image_file(), which bounds what a file handed over can make the reader do: it
opens without blocking (a FIFO never hangs), reads regular files only (a link to /dev/zero, a FIFO, a socket are
refused), refuses a file of more than max_bytes() bytes before reading any (a sparse 20 GB ".png"), and reads at
most that many. check_resize() bounds what the resize for the model makes of an image (a 20000 x 1 PNG whose
shorter side is scaled to 256), from its header.
"""
import os
import stat

SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
# The most pixels an image may have: its header is read before its pixels, so a small file that would decode to
# gigabytes (a PNG of zeros compresses a thousandfold) is refused unread. 8192 x 8192 by default, well past the
# photos and scans models train on; the environment variable raises it for every reader, loader workers included.
MAX_PIXELS_VARIABLE = "HVD_MAX_IMAGE_PIXELS"
MAX_PIXELS = 8192 * 8192
ROWS_AT_ONCE = 2**22  # pixels a 16-bit image is scaled by at a time: the wide temporary stays a few MB
# The most bytes an image file may have: its size is checked on the opened file before any byte is read. 256 MiB,
# far past any photo or scan (an 8192 x 8192 RGB PNG stored uncompressed is 192 MiB); the variable raises it.
MAX_BYTES_VARIABLE = "HVD_MAX_IMAGE_BYTES"
MAX_BYTES = 256 * 2**20
KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


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


def max_bytes():
    value = os.environ.get(MAX_BYTES_VARIABLE, "")
    if not value:
        return MAX_BYTES
    if not value.isdigit() or int(value) < 1:
        raise UnsupportedImage(f"{MAX_BYTES_VARIABLE}={value!r}: give a whole number of bytes, e.g. {MAX_BYTES * 4}")
    return int(value)


def kind_of(mode):
    """What a file that is not a regular one is, in words, from its st_mode."""
    return next((name for test, name in KINDS if test(mode)), "not a regular file")


def read_image_file(path):
    """The bytes of the image file at `path`, read within bounds: anything but a regular file is refused (a link
    is followed once, by the open, and what it opened is checked), and so is a file of more than max_bytes()
    bytes, before a byte of it is read; at most its size is read. Raises OSError or UnsupportedImage (a
    ValueError), both among data/errors.py's UNREADABLE_IMAGE, with the reason in words."""
    bound = max_bytes()
    # Refused unopened where it is plainly no file (opening some devices does something); the descriptor's own
    # fstat below is what decides, as the path may be swapped between the two.
    facts = os.stat(path)
    if not stat.S_ISREG(facts.st_mode):
        raise UnsupportedImage(f"{kind_of(facts.st_mode)}, not a regular file; images are read from files only")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)  # O_NONBLOCK: a FIFO swapped in opens at once, rather than waiting for a writer
    try:
        facts = os.fstat(fd)
        if not stat.S_ISREG(facts.st_mode):
            raise UnsupportedImage(f"{kind_of(facts.st_mode)}, not a regular file; images are read from files only")
        if facts.st_size > bound:
            raise UnsupportedImage(f"{facts.st_size:,} bytes, more than the {bound:,} an image file may have here; "
                                   f"set {MAX_BYTES_VARIABLE} to raise the bound")
        parts, left = [], facts.st_size
        while left > 0:  # one read, unless the file system hands the file over in parts
            part = os.read(fd, left)
            if not part:
                break
            parts.append(part)
            left -= len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)
    finally:
        os.close(fd)


def check_resize(width, height, new_width, new_height):
    """Refuses (UnsupportedImage) resizing a width x height image to new_width x new_height pixels where those are
    more than max_pixels(): an image inside the bound can be resized past it (a 20000 x 1 image whose shorter side
    becomes 256 is 5,120,000 x 256), so the resize's own shape is checked, from the header, before decoding."""
    bound = max_pixels()
    if new_width * new_height > bound:
        raise UnsupportedImage(f"{width} x {height} pixels, which the resize for the model makes {new_width:,} x "
                               f"{new_height:,}, more than the {bound:,} pixels an image may have here; set "
                               f"{MAX_PIXELS_VARIABLE} to raise the bound")


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
