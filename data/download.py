"""--download: fetch a data set's files over HTTPS, check each against its published MD5 checksum, and unpack
archives without letting them write outside --data-dir; where that fails (no network, a proxy, a bad checksum, a
tampered archive), one DataError that names the URL, the cause and where to put the files by hand."""
import contextlib
import io
import os
import shutil
import socket
import tarfile

from hvd_train.data.errors import DataError

TIMEOUT_S = 60  # per connection attempt: a firewall that drops packets must not hang the job


def fetch(title, urls, into, by_hand, md5, filename=None, extract=True):
    """Download the first of `urls` that works into directory `into`, check it against `md5` (the checksum its
    publisher gives), and unpack it there when it is a tar archive and `extract`. by_hand: how to place the files
    without --download, for the message."""
    from torchvision.datasets.utils import check_integrity, download_url

    failures = []
    created = outermost_missing(into)
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(TIMEOUT_S)
    try:
        for url in urls:
            name = filename or os.path.basename(url)
            path = os.path.join(into, name)
            try:
                # torchvision prints a line per attempt and mirror; the outcome is said once, here or by the caller.
                with contextlib.redirect_stdout(io.StringIO()):
                    download_url(url, into, filename=name, md5=md5)
                if not check_integrity(path, md5):  # torchvision checks too; this one is the app's promise
                    raise ValueError(f"its MD5 checksum is not the published {md5}")
                if extract and tarfile.is_tarfile(path):
                    unpack(path, into)
                return
            except (OSError, RuntimeError, ValueError, DataError) as e:  # URLError and HTTPError are OSErrors
                failures.append((url, getattr(e, "reason", None) or e))
                if os.path.exists(path) and not check_integrity(path, md5):
                    os.remove(path)  # a damaged or tampered file must not be taken for the data set next time
    finally:
        socket.setdefaulttimeout(previous)
    if created:  # folders this call made hold nothing of the user's: a failed download leaves none behind
        shutil.rmtree(created, ignore_errors=True)
    url, reason = failures[0]
    mirrors = f" (and {len(failures) - 1} mirror(s))" if len(failures) > 1 else ""
    raise DataError(f"--download {title}: cannot fetch {url}{mirrors}: {reason}. Without network here, {by_hand}, "
                    f"then run without --download")


DATA_FILTER = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


def unpack(archive, into):
    """Extract the tar `archive` into `into`. Only plain files and folders whose paths stay inside `into` are
    accepted: an absolute path, a `..`, a link or a device in the archive refuses it whole, before anything is
    written (Python's "data" filter then applies as well, where this Python has it: 3.11.4 and later, and Debian's
    3.11.2 does not)."""
    root = os.path.realpath(into)
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        for member in members:
            target = os.path.realpath(os.path.join(root, member.name))
            if not (member.isfile() or member.isdir()) or os.path.isabs(member.name) or \
                    os.path.commonpath([root, target]) != root:
                raise DataError(f"{archive}: refusing to unpack it: its member {member.name!r} is "
                                f"{'a link or device' if not (member.isfile() or member.isdir()) else 'outside'} "
                                f"the target folder {into}; the archive is not the published one")
        tar.extractall(root, members=members, **DATA_FILTER)


def outermost_missing(path):
    """The outermost folder on the way to `path` that does not exist yet (None where `path` exists)."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path):
        path, missing = os.path.dirname(path), path
    return missing
