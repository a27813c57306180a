class DataError(ValueError):
    """A data set is missing or unusable; the message says where it was looked for and how to fix it."""


class BadSampleError(RuntimeError):
    """One file of a data set cannot be read. Raised on the rank that met it, mid-epoch; the message names it."""
