"""Writing files so that no reader sees half of one: atomic replacement, appends, private modes, and a failed write
named in one line. The run directory (hvd_train/run/directory.py), checkpoints, reports and `hvd-train shard`
(hvd_train/tools/shard.py) all write through here; what a run directory holds is named in RunDir, not here.

Every replacement is written into a temporary file beside its name, created exclusively with an unpredictable name
(never through a planted link), then renamed over the name: a reader, or a writer killed halfway, sees the old file
or the new one. Where the output directory is given (root), a symbolic link on the way from it to the file is
refused: what a run writes lies in its own directory, never where a link planted there points.
"""
import contextlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
from typing import IO, Any, Callable, Iterable, Iterator, Optional

from hvd_train.errors import CheckpointError


@contextlib.contextmanager
def reported_write(path: str, then: str = "") -> Iterator[None]:
    """Turn a failed write of `path` into one CheckpointError: the file, the cause and the fix (a full disk names
    the free space; torch.save buries the OSError under its own RuntimeError, so the chain is searched)."""
    try:
        yield
    except Exception as e:
        cause: Optional[BaseException] = e
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        where = os.path.dirname(os.path.abspath(path))
        if cause.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(where).free if os.path.isdir(where) else 0
            why = (f"no space left on the device ({free / 2**20:.1f} MB free in {where}); free space there or "
                   f"choose another --output-dir")
        else:
            why = f"{cause.strerror or cause}; make {where} writable or choose another --output-dir"
        raise CheckpointError(f"could not write {path}: {why}{then}") from None


def no_link_below(root: str, path: str) -> None:
    """Refuse (one CheckpointError naming it) a symbolic link at any component of `path` below the output directory
    `root`, from root down to path itself: what the run writes lies in root, never where a link planted there points.
    root itself may be a link (the user's choice on the command line); components that do not exist yet are fine."""
    root, path = os.path.abspath(root), os.path.abspath(path)
    below = os.path.relpath(path, root)
    if below == os.curdir:
        return
    if below == os.pardir or below.startswith(os.pardir + os.sep):
        raise ValueError(f"{path} is not in {root}")
    here = root
    for part in below.split(os.sep):
        here = os.path.join(here, part)
        try:
            mode = os.lstat(here).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return
        if stat.S_ISLNK(mode):
            raise CheckpointError(
                f"{one_line(here)}: a symbolic link (to {one_line(os.readlink(here))}) inside the output directory "
                f"{root}: a run writes only into its own directory, never through a link planted there; remove the "
                f"link (--overwrite removes one at a name it replaces, never what it points to), or choose another "
                f"--output-dir")


def first_link_within(folder: str) -> Optional[str]:
    """The first symbolic link anywhere inside `folder` (none is followed), or None."""
    for top, folders, files in os.walk(folder):  # a link to a folder is listed, never entered
        for name in sorted(folders + files):
            if os.path.islink(os.path.join(top, name)):
                return os.path.join(top, name)
    return None


def one_line(text: str) -> str:
    """`text` (a name or location found in a directory, which anyone may have chosen) with its control characters
    escaped, so that a message holding it stays one line."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m.group())[1:-1], text)


def missing_parents(path: str) -> list[str]:
    """The directories makedirs(path) would create, deepest first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_empty(made: Iterable[str]) -> None:
    """Remove directories this run made (deepest first), each only if empty: another process may have written there
    meanwhile."""
    for directory in made:
        try:
            os.rmdir(directory)
        except OSError:
            break


PRIVATE = 0o027  # no write for the group, nothing for others: run files 0640, directories 0750


def keep_private() -> None:
    """Make every file this process creates from now on readable by its owner and group only (0640, directories
    0750): run files, checkpoints, TensorBoard events and tracker stores hold a model and settings that are not
    the whole cluster's business. A stricter umask the user has stays."""
    os.umask(os.umask(0) | PRIVATE)


def temporary_beside(path: str) -> tuple[int, str]:
    """(open file descriptor, name) of a new file beside `path` with an unpredictable name, created exclusively
    (never through a link someone planted), with the mode the umask gives new files."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=os.path.basename(path) + ".tmp.")
    os.fchmod(fd, run_file_mode())
    return fd, tmp


def run_file_mode() -> int:
    """The mode of the files a run writes: what the umask gives a new file (0640 under keep_private)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def with_run_mode(path: str) -> None:
    """Give the file at `path`, written by a library that chose its own mode (safetensors writes 0600), the mode
    of the run's other files."""
    os.chmod(path, run_file_mode())


def atomic_write(path: str, write: Callable[[IO[Any]], object], binary: bool = False, sync: bool = False,
                 root: Optional[str] = None) -> None:
    """write(file) into a temporary file beside `path`, then rename it over `path` (a link planted at `path` is
    replaced, never written through). sync: flush to disk first (checkpoints, which must survive a crash of the
    machine too). root: the output directory `path` lies in; a link on the way from it to the file is refused."""
    if root is not None:
        no_link_below(root, os.path.dirname(os.path.abspath(path)))
    fd, tmp = temporary_beside(path)
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str, obj: Any, root: Optional[str] = None) -> None:
    def dump(f: IO[Any]) -> None:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    atomic_write(path, dump, root=root)


def append_line(path: str, line: str, root: Optional[str] = None) -> None:
    """Append `line` to the file `path`, created where missing; a link planted at `path` is refused (OSError), never
    written through, and so is one on the way from the output directory `root` (CheckpointError)."""
    if root is not None:
        no_link_below(root, os.path.dirname(os.path.abspath(path)))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    with os.fdopen(fd, "a") as f:
        f.write(line)


def read_json_or_none(path: str) -> Any:
    """The JSON object in `path`, or None where there is no such file or it is not valid JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
