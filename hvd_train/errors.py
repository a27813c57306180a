"""The errors a user can fix and how the app says them: one line each, an exit code, and no credential in any text.

ConfigError, CheckpointError and NonFiniteLossError are raised on every rank at the same point; hvd_train/app.py
(guarded) reports each once, in a line written by say(), and ends the run with its EXIT_ code. The data's errors live
here too, below every room that reads data: DataError (a data set missing or unusable), BadSampleError (one file,
met mid-epoch by one rank) and UNREADABLE_IMAGE, how Pillow says a file is not an image it will decode.

Credentials in URIs never reach a file, a log or a tracker. A user may write `--mlflow-uri https://user:secret@host`
or a shard URL with `?token=...`; what the run stores (config.json, checkpoints, summary.json, MLflow's params,
W&B's config) and prints holds the URI without its user info and without query values that look like secrets:
settings pass through redact_values, messages through say() and the filter on the "hvd_train" logger. MLflow gets
the credentials through its own environment variables (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, or
MLFLOW_TRACKING_TOKEN), the way its documentation asks for them (hvd_train/run/tracking.py).
"""
import logging
import re
import sys
from typing import Any, Optional
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

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


def say(text: str) -> None:
    """Write text and its newline to stderr in one write: mpirun and horovodrun tag each chunk a rank writes
    ([1,0]<stderr>:), and print()'s separate newline would end the line with a stray tag."""
    sys.stderr.write(f"{redact_text(text)}\n")  # the one redactor: no credential of a URI reaches a log
    sys.stderr.flush()


SECRET_QUERY_KEYS = re.compile(r"token|secret|passw|pwd|key|sig|credential|auth|session", re.IGNORECASE)
HIDDEN = "REDACTED"
# A URI anywhere in a text: a shard location, a `pipe:curl ... https://user:pw@host/x?token=...` command, a message.
URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
# A credential given to a command without a URI: curl's -u/--user and an Authorization header.
CREDENTIAL_IN_TEXT = re.compile(r"(?i)(\s(?:-u|--user)[\s=]+|authorization:\s*(?:bearer|basic|token)?\s*)([^\s'\"]+)")


def split_credentials(uri: str) -> tuple[str, Optional[str], Optional[str]]:
    """(the URI without user info, user, password); user and password are None where the URI has none."""
    if not isinstance(uri, str) or "://" not in uri:
        return uri, None, None
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri, None, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=hostport)), user or None, password or None


def redact(uri: str) -> str:
    """`uri` as it may be stored or shown: no user info, secret-looking query values replaced."""
    clean, _, _ = split_credentials(uri)
    if not isinstance(clean, str) or "://" not in clean or "?" not in clean:
        return clean
    parts = urlsplit(clean)
    query = [(k, HIDDEN if SECRET_QUERY_KEYS.search(k) else v) for k, v in parse_qsl(parts.query,
                                                                                     keep_blank_values=True)]
    return urlunsplit(parts._replace(query=urlencode(query, safe="{}.:/,")))


def redact_argument(word: str) -> str:
    """A command-line word as it may be shown: as redact_text shows it (the URIs in it, a pipe: command's
    credentials, the `--name=value` form of a flag)."""
    return redact_text(word)


def redact_all(location: str) -> str:
    """A shard location, patterns joined by '::', each redacted."""
    if not isinstance(location, str):
        return location
    return "::".join(redact(part) for part in location.split("::"))


def redact_text(text: str) -> str:
    """`text` as it may be stored, logged or shown: every URI in it redacted (user info, secret-looking query
    values), and the credentials of a command line (curl's -u, an Authorization header) hidden. The one redactor:
    config.json, checkpoints and trackers get the settings through redact_values, messages through say() and the
    app's logger."""
    if not isinstance(text, str) or ("://" not in text and not CREDENTIAL_IN_TEXT.search(text)):
        return text
    text = URI_IN_TEXT.sub(lambda m: _redacted(m.group(0)), text)
    return CREDENTIAL_IN_TEXT.sub(lambda m: m.group(1) + HIDDEN, text)


def _redacted(uri: str) -> str:
    try:
        return redact(uri)
    except ValueError:  # a URI urlsplit cannot read (a stray "[" in a stack dump): none of it is shown
        return HIDDEN


def redact_values(value: Any) -> Any:
    """A structure of settings (dicts, lists, tuples) with every string in it redacted as redact_text does."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_values(v) for v in value)
    return value


class Redacting(logging.Filter):
    """A logger's records with their text redacted (redact_text): what the app logs names shard and index URLs."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean is not message:
            record.msg, record.args = clean, ()
        return True


logging.getLogger("hvd_train").addFilter(Redacting())


try:  # Pillow is there wherever images are read; the rest of the app imports this module without it too
    from PIL.Image import DecompressionBombError
except ImportError:  # pragma: no cover - an environment without Pillow reads no image
    class DecompressionBombError(Exception):  # type: ignore[no-redef]
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

    def __init__(self, message: str) -> None:
        original = re.search(r"BadSampleError: (.*)\s*\Z", message) if message.startswith("Caught ") else None
        super().__init__(original.group(1) if original else message)
