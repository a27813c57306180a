class DataError(ValueError):
    """A data set is missing or unusable; the message says where it was looked for and how to fix it."""
