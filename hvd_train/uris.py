"""Credentials in URIs never reach a file, a log or a tracker.

A user may write `--mlflow-uri https://user:secret@host` or a shard URL with `?token=...`. What the run stores
(config.json, checkpoints, summary.json, MLflow's params, W&B's config) and prints holds the URI without its user
info and without query values that look like secrets. MLflow gets the credentials through its own environment
variables (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN), the way its documentation
asks for them.
"""
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

SECRET_QUERY_KEYS = re.compile(r"token|secret|passw|pwd|key|sig|credential|auth|session", re.IGNORECASE)
HIDDEN = "REDACTED"


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
    """A command-line word as it may be shown: the URIs in it redacted, in a flag's `--name=value` form too, and
    in a '::' list of shard patterns."""
    flag, sep, value = word.partition("=") if word.startswith("-") else ("", "", word)
    return flag + sep + redact_all(value) if "://" in value else word


def redact_all(location):
    """A shard location, patterns joined by '::', each redacted."""
    if not isinstance(location, str):
        return location
    return "::".join(redact(part) for part in location.split("::"))
