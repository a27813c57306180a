"""--download: fetch a data set's files with torchvision's downloader; where that fails (no network, a proxy, a bad
checksum), one DataError that names the URL, the error and where to put the files by hand."""
import contextlib
import io
import os
import shutil
import socket

from data.errors import DataError

TIMEOUT_S = 60  # per connection attempt: a firewall that drops packets must not hang the job


def fetch(title, urls, into, by_hand, filename=None, md5=None):
    """Download and extract the first of `urls` that works into directory `into`. by_hand: how to place the files
    without --download, for the message."""
    from torchvision.datasets.utils import download_and_extract_archive

    failures = []
    created = outermost_missing(into)
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(TIMEOUT_S)
    try:
        for url in urls:
            try:
                # torchvision prints a line per attempt and mirror; the outcome is said once, here or by the caller.
                with contextlib.redirect_stdout(io.StringIO()):
                    download_and_extract_archive(url, download_root=into, filename=filename, md5=md5)
                return
            except (OSError, RuntimeError, ValueError) as e:  # URLError and HTTPError are OSErrors
                failures.append((url, getattr(e, "reason", None) or e))
    finally:
        socket.setdefaulttimeout(previous)
    if created:  # folders this call made hold nothing of the user's: a failed download leaves none behind
        shutil.rmtree(created, ignore_errors=True)
    url, reason = failures[0]
    mirrors = f" (and {len(failures) - 1} mirror(s))" if len(failures) > 1 else ""
    raise DataError(f"--download {title}: cannot fetch {url}{mirrors}: {reason}. Without network here, {by_hand}, "
                    f"then run without --download")


def outermost_missing(path):
    """The outermost folder on the way to `path` that does not exist yet (None where `path` exists)."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path):
        path, missing = os.path.dirname(path), path
    return missing
