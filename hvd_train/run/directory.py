"""The run directory (--output-dir): every file a run writes, how the directory is claimed, and the one writer.

    <output dir>/config.json        the resolved configuration
    <output dir>/metrics.jsonl      one record per epoch, appended as training goes
    <output dir>/summary.json       headline figures and the whole history, at the end (benchmark: its figures)
    <output dir>/evaluation.json    --evaluate's metrics
    <output dir>/curves.png         loss and accuracy curves
    <output dir>/tensorboard/       TensorBoard events
    <output dir>/checkpoints/       epoch_NNNN.pt, last.pt, best.pt
    <output dir>/profile/           --profile: rank<r>.trace.json (torch.profiler), horovod_timeline.json
    <output dir>/.hvd-train.lock    while a job runs in it (hvd_train/run/lock.py)

Only rank 0 writes, and every write goes through atomic_write: a reader, or a run killed halfway, sees the old
file or the new one, never half of one.
"""
import contextlib
import errno
import json
import logging
import os
import shutil
import tempfile

from hvd_train.errors import CheckpointError
from hvd_train.run.lock import RunLock

log = logging.getLogger("hvd_train")
# The checkpoints that stand for a run: the newest (what --resume auto continues) and the best by the task's metric
# (what evaluation, export and predict use).
LAST_CHECKPOINT, BEST_CHECKPOINT = "last.pt", "best.pt"


class RunDir:
    # What a run leaves behind; a fresh run refuses to start over these unless told to.
    RUN_FILES = (f"checkpoints/{LAST_CHECKPOINT}", "summary.json", "metrics.jsonl")
    REPLACED_ON_OVERWRITE = ("summary.json", "metrics.jsonl", "config.json", "curves.png", "tensorboard",
                             "checkpoints", "profile")

    def __init__(self, root):
        self.root = root
        self.lock = RunLock(root)  # taken by claim(), for one job at a time
        self.config = self.path("config.json")
        self.metrics = self.path("metrics.jsonl")
        self.summary = self.path("summary.json")
        self.evaluation = self.path("evaluation.json")
        self.curves = self.path("curves.png")
        self.tensorboard = self.path("tensorboard")
        self.checkpoints = self.path("checkpoints")
        self.profile = self.path("profile")
        self.last_checkpoint = self.checkpoint(LAST_CHECKPOINT)
        self.best_checkpoint = self.checkpoint(BEST_CHECKPOINT)

    def path(self, name):
        return os.path.join(self.root, name)

    def checkpoint(self, name):
        """checkpoints/<name>: last.pt, best.pt or epoch_NNNN.pt."""
        return os.path.join(self.checkpoints, name)

    def resolve(self, resume):
        """The checkpoint named by --resume: a path, or `auto` for the newest intact checkpoint in checkpoints/
        (last.pt, else the newest whole one beside it, named in one line with why the newer ones were passed over;
        None when there is none yet, so a job script can always pass --resume auto). A path is taken as given."""
        if resume == "auto":
            from hvd_train.run.checkpoint import newest_intact  # it writes through this module: imported late

            path, passed_over = newest_intact(self.checkpoints)
            if passed_over:
                skipped = "; ".join(f"{os.path.relpath(p, self.root)} ({why})" for p, why in passed_over)
                if path is None:
                    raise CheckpointError(f"--resume auto: no checkpoint in {self.checkpoints} is whole: {skipped}; "
                                          f"pass --overwrite to start again, or --resume a checkpoint you have")
                log.warning("--resume auto: passed over %s; resuming from %s, the newest whole checkpoint", skipped,
                            os.path.relpath(path, self.root))
            return path
        if not os.path.isfile(resume):
            raise CheckpointError(f"--resume {resume}: no such file")
        return resume

    def claim(self, resume, overwrite):
        """Take the directory's lock (a job running in it refuses this one), then decide how this run uses it
        without losing an earlier run; returns the checkpoint to resume from, or None for a fresh start. A
        directory holding a run is continued (--resume), replaced (--overwrite), or refused with the choices named;
        a refused run leaves the lock and a directory it made behind it as they were."""
        made = missing_parents(self.root)  # the lock makes them: a refused run removes them again
        self.lock.acquire()
        try:
            return self._decide(resume, overwrite)
        except CheckpointError:
            self.lock.release()
            remove_empty(made)
            raise

    def _decide(self, resume, overwrite):
        found = [f for f in self.RUN_FILES if os.path.exists(self.path(f))]
        if resume:
            path = self.resolve(resume)
            if path is None and found:
                raise CheckpointError(f"--resume auto: {self.root} holds a run ({', '.join(found)}) but no "
                                      f"checkpoints/last.pt to continue from; pass --overwrite to replace it, or "
                                      f"choose another --output-dir")
            return path
        if found and not overwrite:
            raise CheckpointError(f"{self.root} already holds a run ({', '.join(found)}); continue it with --resume "
                                  f"auto, replace it with --overwrite, or choose another --output-dir")
        if found:
            for name in self.REPLACED_ON_OVERWRITE:
                path = self.path(name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                elif os.path.lexists(path):  # a file, or a link (removed itself: never what it points to)
                    os.remove(path)
        return None

    def claim_for_benchmark(self, overwrite):
        """A benchmark writes summary.json: it may replace an earlier benchmark's, never a training run's."""
        summary = read_json_or_none(self.summary)
        holds_run = os.path.exists(self.checkpoints) or (summary is not None and summary.get("mode") != "benchmark")
        if holds_run and not overwrite:
            raise CheckpointError(f"{self.root} holds a training run; give the benchmark another --output-dir, or "
                                  f"replace the run with --overwrite")


@contextlib.contextmanager
def reported_write(path, then=""):
    """Turn a failed write of `path` into one CheckpointError: the file, the cause and the fix (a full disk names
    the free space; torch.save buries the OSError under its own RuntimeError, so the chain is searched)."""
    try:
        yield
    except Exception as e:
        cause = e
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


def write_config(path, cfg):
    """The run's settings (config.json), written whole; a failed write is one CheckpointError."""
    with reported_write(path):
        write_json(path, cfg.to_dict())


def check_writable(root, tidy=True):
    """Prove that the output directory can be made and written (rank 0, before any data or model is built). tidy:
    leave no new directory behind, so a run that then stops on a data or setting error leaves the disk as it was
    (not where several processes check at once: one would remove the directory under another's probe).
    Raises CheckpointError naming the path and the reason."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--output-dir {root}: is a file, not a directory; choose another --output-dir")
    made = missing_parents(root) if tidy else []
    try:
        os.makedirs(root, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=".write-test.")  # a new file: never through a planted link
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--output-dir {root}: cannot write there ({e.strerror or e}); choose a directory "
                              f"this user can create and write") from None
    finally:
        remove_empty(made)


def missing_parents(path):
    """The directories makedirs(path) would create, deepest first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_empty(made):
    """Remove directories this run made (deepest first), each only if empty: another process may have written there
    meanwhile."""
    for directory in made:
        try:
            os.rmdir(directory)
        except OSError:
            break


PRIVATE = 0o027  # no write for the group, nothing for others: run files 0640, directories 0750


def keep_private():
    """Make every file this process creates from now on readable by its owner and group only (0640, directories
    0750): run files, checkpoints, TensorBoard events and tracker stores hold a model and settings that are not
    the whole cluster's business. A stricter umask the user has stays."""
    os.umask(os.umask(0) | PRIVATE)


def temporary_beside(path):
    """(open file descriptor, name) of a new file beside `path` with an unpredictable name, created exclusively
    (never through a link someone planted), with the mode the umask gives new files."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=os.path.basename(path) + ".tmp.")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, tmp


def atomic_write(path, write, binary=False, sync=False):
    """write(file) into a temporary file beside `path`, then rename it over `path`. sync: flush to disk first
    (checkpoints, which must survive a crash of the machine too)."""
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


def write_json(path, obj):
    def dump(f):
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    atomic_write(path, dump)


def append_line(path, line):
    """Append `line` to the file `path`, created where missing; a link planted at `path` is refused (OSError), never
    written through."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    with os.fdopen(fd, "a") as f:
        f.write(line)


def read_json_or_none(path):
    """The JSON object in `path`, or None where there is no such file or it is not valid JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
