"""Credentials in URIs never reach a file, a log or a tracker.

A user may write `--mlflow-uri https://user:secret@host` or a shard URL with `?token=...`. What the run stores
(config.json, checkpoints, summary.json, MLflow's params, W&B's config) and prints holds the URI without its user
info and without query values that look like secrets. MLflow gets the credentials through its own environment
variables (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN), the way its documentation
asks for them.
"""
import logging
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

SECRET_QUERY_KEYS = re.compile(r"token|secret|passw|pwd|key|sig|credential|auth|session", re.IGNORECASE)
HIDDEN = "REDACTED"
# A URI anywhere in a text: a shard location, a `pipe:curl ... https://user:pw@host/x?token=...` command, a message.
URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
# A credential given to a command without a URI: curl's -u/--user and an Authorization header.
CREDENTIAL_IN_TEXT = re.compile(r"(?i)(\s(?:-u|--user)[\s=]+|authorization:\s*(?:bearer|basic|token)?\s*)([^\s'\"]+)")


def split_credentials(uri):
    """(the URI without user info, user, password); user and password are None where the URI has none."""
    if not isinstance(uri, str) or "://" not in uri:
        return uri, None, None
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri, None, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=hostport)), user or None, password or None


def redact(uri):
    """`uri` as it may be stored or shown: no user info, secret-looking query values replaced."""
    clean, _, _ = split_credentials(uri)
    if not isinstance(clean, str) or "://" not in clean or "?" not in clean:
        return clean
    parts = urlsplit(clean)
    query = [(k, HIDDEN if SECRET_QUERY_KEYS.search(k) else v) for k, v in parse_qsl(parts.query,
                                                                                     keep_blank_values=True)]
    return urlunsplit(parts._replace(query=urlencode(query, safe="{}.:/,")))


def redact_argument(word):
    """A command-line word as it may be shown: as redact_text shows it (the URIs in it, a pipe: command's
    credentials, the `--name=value` form of a flag)."""
    return redact_text(word)


def redact_all(location):
    """A shard location, patterns joined by '::', each redacted."""
    if not isinstance(location, str):
        return location
    return "::".join(redact(part) for part in location.split("::"))


def redact_text(text):
    """`text` as it may be stored, logged or shown: every URI in it redacted (user info, secret-looking query
    values), and the credentials of a command line (curl's -u, an Authorization header) hidden. The one redactor:
    config.json, checkpoints and trackers get the settings through redact_values, messages through say() and the
    app's logger."""
    if not isinstance(text, str) or ("://" not in text and not CREDENTIAL_IN_TEXT.search(text)):
        return text
    text = URI_IN_TEXT.sub(lambda m: _redacted(m.group(0)), text)
    return CREDENTIAL_IN_TEXT.sub(lambda m: m.group(1) + HIDDEN, text)


def _redacted(uri):
    try:
        return redact(uri)
    except ValueError:  # a URI urlsplit cannot read (a stray "[" in a stack dump): none of it is shown
        return HIDDEN


def redact_values(value):
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

    def filter(self, record):
        message = record.getMessage()
        clean = redact_text(message)
        if clean is not message:
            record.msg, record.args = clean, ()
        return True


logging.getLogger("hvd_train").addFilter(Redacting())
