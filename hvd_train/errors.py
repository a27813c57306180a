"""The errors a user can fix, each raised on every rank at the same point; train_hvd.cli reports them once."""
import sys

from hvd_train.uris import redact_text


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the reason and the fix."""


class CheckpointError(ValueError):
    """A checkpoint or run directory is missing, unreadable or does not fit this run; the message names the file."""


class NonFiniteLossError(RuntimeError):
    """A loss was NaN or infinite on at least one rank; raised on every rank at the same step."""


def say(text):
    """Write text and its newline to stderr in one write: mpirun and horovodrun tag each chunk a rank writes
    ([1,0]<stderr>:), and print()'s separate newline would end the line with a stray tag."""
    sys.stderr.write(f"{redact_text(text)}\n")  # the one redactor: no credential of a URI reaches a log
    sys.stderr.flush()
