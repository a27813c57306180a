import re

try:  # Pillow is there wherever images are read; the rest of the app imports this module without it too
    from PIL.Image import DecompressionBombError
except ImportError:  # pragma: no cover - an environment without Pillow reads no image
    class DecompressionBombError(Exception):
        pass

# How Pillow says a file is not an image it will decode: a broken file (OSError, SyntaxError, ValueError), or one
# whose pixel count is over Pillow's limit (Image.MAX_IMAGE_PIXELS, about 179 million: a "decompression bomb").
UNREADABLE_IMAGE = (OSError, SyntaxError, ValueError, DecompressionBombError)


class DataError(ValueError):
    """A data set is missing or unusable; the message says where it was looked for and how to fix it."""


class BadSampleError(RuntimeError):
    """One file of a data set cannot be read. Raised on the rank that met it, mid-epoch; the message names it.

    A DataLoader worker's error reaches the training process rebuilt as BadSampleError("Caught BadSampleError in
    DataLoader worker process 0. Original Traceback ...: <message>"); the message alone is kept, so the user reads
    the file and the fix rather than a traceback of the worker.
    """

    def __init__(self, message):
        original = re.search(r"BadSampleError: (.*)\s*\Z", message) if message.startswith("Caught ") else None
        super().__init__(original.group(1) if original else message)
