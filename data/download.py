"""A data set's files under --data-dir: fetched by --download, and found in any of the layouts they are published in.

fetch() downloads them over HTTPS, checks each against its published MD5 checksum, and unpacks archives without
letting them write outside --data-dir; where that fails (no network, a proxy, a bad checksum, a tampered archive),
one DataError names the URL, the cause and where to put the files by hand.

locate() finds a data set on disk in any of its published layouts (a Layout each), and says what is there when
none fits.
"""
import contextlib
import io
import os
import shutil
import socket
import tarfile
from dataclasses import dataclass
from typing import Any, Optional, Sequence, cast

from hvd_train.errors import DataError

TIMEOUT_S = 60  # per connection attempt: a firewall that drops packets must not hang the job


def fetch(title: str, urls: Sequence[str], into: str, by_hand: str, md5: str, filename: Optional[str] = None,
          extract: bool = True) -> None:
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


DATA_FILTER: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


def unpack(archive: str, into: str) -> None:
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


def outermost_missing(path: str) -> Optional[str]:
    """The outermost folder on the way to `path` that does not exist yet (None where `path` exists)."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path):
        path, missing = os.path.dirname(path), path
    return missing


SHOWN = 8  # entries of a directory named in a "not found" message


@dataclass(frozen=True)
class Layout:
    """One published layout: files in a folder under --data-dir ("" for --data-dir itself)."""
    folder: str
    files: tuple
    origin: str            # where users get this layout, for the message when nothing fits
    gzip_ok: bool = False  # file.gz counts for file (torchvision leaves MNIST's files gzipped)

    def path(self, data_dir: str, name: str) -> Optional[str]:
        """The file on disk for `name`, or None."""
        plain = os.path.join(data_dir, self.folder, name)
        for candidate in (plain, plain + ".gz") if self.gzip_ok else (plain,):
            if os.path.isfile(candidate):
                return candidate
        return None

    def describe(self) -> str:
        where = f"{self.folder}/" if self.folder else ""
        files = f"{{{','.join(self.files)}}}" if len(self.files) > 1 else self.files[0]
        return f"{where}{files}{' (.gz or not)' if self.gzip_ok else ''} ({self.origin})"


def locate(title: str, data_dir: str, layouts: Sequence[Layout], how_to_get: str) -> dict[str, str]:
    """{file name: path} for the first layout in `layouts` whose files are all under data_dir; else a DataError that
    says what data_dir holds, what is missing where a layout is partly there, and every layout that is accepted."""
    for layout in layouts:
        paths = {name: layout.path(data_dir, name) for name in layout.files}
        if all(paths.values()):
            return cast("dict[str, str]", paths)  # every file found: no None among them
    raise DataError(f"{title} not found in {data_dir}: {contents(data_dir)}{partial(data_dir, layouts)}. Accepted "
                    f"layouts under --data-dir: {'; '.join(layout.describe() for layout in layouts)}. {how_to_get}")


def contents(directory: str) -> str:
    """'it does not exist' or 'it holds a/, b.txt, ...', for messages."""
    if not os.path.isdir(directory):
        return "it does not exist" if not os.path.exists(directory) else "it is a file, not a directory"
    entries = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(directory))
    if not entries:
        return "it is empty"
    more = f" and {len(entries) - SHOWN} more" if len(entries) > SHOWN else ""
    return f"it holds {', '.join(entries[:SHOWN])}{more}"


def partial(data_dir: str, layouts: Sequence[Layout]) -> str:
    """'; cifar-10-batches-py/ lacks test_batch' for each layout whose folder is there but not all of its files."""
    notes = []
    for layout in layouts:
        if layout.folder and os.path.isdir(os.path.join(data_dir, layout.folder)):
            lacking = [name for name in layout.files if layout.path(data_dir, name) is None]
            notes.append(f"; {layout.folder}/ lacks {', '.join(lacking)}")
    return "".join(notes)
