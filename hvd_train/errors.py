"""The errors a user can fix, each raised on every rank at the same point; train_hvd.cli reports them once."""
import sys

from hvd_train.uris import redact_text

# How a training run ends (docs/reliability.md has every code in one table; the watchdog's 4 and an interruption's
# 75 and 128 + N are spelled in guards/). Bad data met mid-run has an odd code of its own: MPICH's mpirun exits with
# the bitwise OR of its ranks' codes, and the ranks that only saw their peer go exit 1 (5 | 1 is still 5; a 2 would
# have read 3, a diverged run's).
EXIT_DONE = 0      # trained (or measured) to the end
EXIT_FAILED = 1    # a fault or a bug (a traceback), a rank that stopped because another failed, ranks that disagree
EXIT_REFUSED = 2   # a setting, a plug-in, a checkpoint, the output directory or the data set refused (one line)
EXIT_DIVERGED = 3  # the loss became NaN or infinite, or training diverged (NonFiniteLossError)
EXIT_BAD_DATA = 5  # a file of the data set could not be read mid-run (BadSampleError; --data.skip_bad_files)


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
