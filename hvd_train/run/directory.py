"""The run directory (--output-dir): every file a run writes, how the directory is claimed, and the one writer.

    <output dir>/config.json        the resolved configuration
    <output dir>/metrics.jsonl      one record per epoch, appended as training goes
    <output dir>/summary.json       headline figures and the whole history, at the end (benchmark: its figures)
    <output dir>/evaluation.json    --evaluate's metrics
    <output dir>/curves.png         loss and accuracy curves
    <output dir>/tensorboard/       TensorBoard events
    <output dir>/checkpoints/       epoch_NNNN.pt, last.pt, best.pt
    <output dir>/profile/           --profile: rank<r>.trace.json (torch.profiler), horovod_timeline.json
    <output dir>/export/            hvd-train export: model<suffix> and its model card
    <output dir>/mlflow.db          --mlflow without --mlflow-uri: MLflow's store (SQLite) ...
    <output dir>/mlflow-artifacts/  ... and the files of its runs
    <output dir>/wandb/             --wandb: W&B's offline runs
    <output dir>/.hvd-train.lock    while a job runs in it (hvd_train/run/lock.py)

Only rank 0 writes, and every write goes through atomic_write: a reader, or a run killed halfway, sees the old
file or the new one, never half of one.

The directory owns its files: nothing a run writes lies outside it, and no symbolic link below it is followed (the
directory itself may be one, the user's choice). A link planted at a name the run writes into (a folder, a store, the
lock) is refused when the directory is claimed and again by each writer; a file the run replaces whole (config.json,
curves.png, ...) is renamed over a link planted there, which replaces the link. A tracking store found in the
directory is state from elsewhere, read as data: MLflow's must keep every run's files in mlflow-artifacts/.
"""
import contextlib
import errno
import json
import logging
import os
import re
import shutil
import sqlite3
import stat
import tempfile
from urllib.parse import quote, unquote, urlsplit

from hvd_train.errors import CheckpointError
from hvd_train.run.lock import NAME as LOCK_NAME, RunLock
from hvd_train.uris import redact

log = logging.getLogger("hvd_train")
# The checkpoints that stand for a run: the newest (what --resume auto continues) and the best by the task's metric
# (what evaluation, export and predict use).
LAST_CHECKPOINT, BEST_CHECKPOINT = "last.pt", "best.pt"


class RunDir:
    # Every name in the directory is spelled here (tracking.py and tools/export.py take theirs from here).
    CHECKPOINTS, TENSORBOARD, PROFILE, EXPORT = "checkpoints", "tensorboard", "profile", "export"
    MLFLOW_DB, MLFLOW_ARTIFACTS, WANDB = "mlflow.db", "mlflow-artifacts", "wandb"  # (W&B names its folder wandb/)
    # SQLite's files beside a database: a journal left there is rolled into the database when it is opened.
    MLFLOW_DB_SIDECARS = (MLFLOW_DB + "-journal", MLFLOW_DB + "-wal", MLFLOW_DB + "-shm")
    TRACKING_STORES = (MLFLOW_DB, *MLFLOW_DB_SIDECARS, MLFLOW_ARTIFACTS, WANDB)
    # Written whole into a temporary file and renamed over the name: a link planted there is replaced, never followed.
    REPLACED_WHOLE = ("config.json", "metrics.jsonl", "summary.json", "evaluation.json", "curves.png")
    # Written in place, into or through the name: a link there is refused (inside these folders too: their files'
    # names are known in advance).
    WRITTEN_IN_PLACE = (CHECKPOINTS, TENSORBOARD, PROFILE, EXPORT, *TRACKING_STORES, LOCK_NAME)
    WRITTEN_INSIDE = (MLFLOW_ARTIFACTS, PROFILE)
    # What a run leaves behind; a fresh run refuses to start over these unless told to.
    RUN_FILES = (f"{CHECKPOINTS}/{LAST_CHECKPOINT}", "summary.json", "metrics.jsonl")
    REPLACED_ON_OVERWRITE = ("summary.json", "metrics.jsonl", "config.json", "curves.png", TENSORBOARD, CHECKPOINTS,
                             PROFILE, *TRACKING_STORES)
    # What a run may have written in a directory it made before its first step: removed when it stops then (held()).
    RUN_OWN = (*REPLACED_ON_OVERWRITE, "evaluation.json")

    def __init__(self, root):
        self.root = root
        self.lock = RunLock(root)  # taken by claim(), for one job at a time
        self.made = []  # the directories claim() made, deepest first, until training starts (held(), training())
        self.config = self.path("config.json")
        self.metrics = self.path("metrics.jsonl")
        self.summary = self.path("summary.json")
        self.evaluation = self.path("evaluation.json")
        self.curves = self.path("curves.png")
        self.tensorboard = self.path(self.TENSORBOARD)
        self.checkpoints = self.path(self.CHECKPOINTS)
        self.profile = self.path(self.PROFILE)
        self.export = self.path(self.EXPORT)
        self.mlflow_db = self.path(self.MLFLOW_DB)
        self.mlflow_artifacts = self.path(self.MLFLOW_ARTIFACTS)
        self.wandb = self.path(self.WANDB)
        self.last_checkpoint = self.checkpoint(LAST_CHECKPOINT)
        self.best_checkpoint = self.checkpoint(BEST_CHECKPOINT)

    def path(self, name):
        return os.path.join(self.root, name)

    def checkpoint(self, name):
        """checkpoints/<name>: last.pt, best.pt or epoch_NNNN.pt."""
        return os.path.join(self.checkpoints, name)

    def resolve(self, resume, training=True):
        """The checkpoint named by --resume: a path, or `auto` for the newest intact checkpoint in checkpoints/
        (last.pt, else the newest whole one beside it, named in one line with why the newer ones were passed over;
        None when there is none yet, so a job script can always pass --resume auto). A save its writer never finished
        (killed mid-write: only its temporary file is there) is named in one line too, with the checkpoint resumed
        from instead (where `training`: --evaluate reads a checkpoint and removes nothing, and may run beside a
        job whose save is under way). A path is taken as given."""
        if resume == "auto":
            from hvd_train.run.checkpoint import newest_intact, unfinished_saves  # they write through this module

            path, passed_over = newest_intact(self.checkpoints)
            if training:
                self.say_unfinished(unfinished_saves(self.checkpoints), path)
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

    def say_unfinished(self, unfinished, path):
        """One line for the saves whose writer was stopped before the rename ([(file it was to become, temporary
        file left)]): what was not saved, and what --resume auto continues from instead."""
        if not unfinished:
            return

        def rel(p):
            return os.path.relpath(p, self.root)

        what = "; ".join(f"{rel(target)} (its writer stopped before the rename and left {rel(left)}, which this "
                         f"run removes)" for target, left in unfinished)
        if path is None:
            instead = "no checkpoint was saved before it, so the run starts afresh"
        elif any(target == path for target, _ in unfinished):
            instead = f"resuming from {rel(path)} as it was before that save"
        else:
            instead = f"resuming from {rel(path)} instead"
        log.warning("--resume auto: a save was not finished: %s; %s", what, instead)

    def claim(self, resume, overwrite, local_mlflow=False):
        """Take the directory's lock (a job running in it refuses this one), then decide how this run uses it
        without losing an earlier run; returns the checkpoint to resume from, or None for a fresh start. A
        directory holding a run is continued (--resume), replaced (--overwrite), or refused with the choices named;
        a refused run leaves the lock and a directory it made behind it as they were. local_mlflow: the run logs to
        the MLflow store in the directory (--mlflow without --mlflow-uri), which is checked first. The directories
        made here are remembered until training starts: a run stopped before then removes them (held())."""
        made = missing_parents(self.root)  # the lock makes them: a refused run removes them again
        self.lock.acquire()
        try:
            decided = self._decide(resume, overwrite, local_mlflow)
        except CheckpointError:
            self.lock.release()
            remove_empty(made)
            raise
        self.made = made
        return decided

    @contextlib.contextmanager
    def held(self):
        """The claimed directory until the block ends, when its lock is released. A run stopped before training
        started (training() not called: a checkpoint of another model, a refused setting or plug-in found after the
        claim, a failure, an interruption) leaves no directory it made: the run's own files in it (RUN_OWN) are
        removed, then each directory it made, deepest first, if nothing else is in it. A directory that existed
        before is never removed, nor anything in it. (Only the process that claimed the directory made any.)"""
        try:
            yield self
        except BaseException:
            # The run's own files go while the lock is held (a job that took it next must lose nothing), the
            # directories it made after (the lock's file is in the root).
            made, self.made = self.made, []
            self.remove_own(made)
            self.lock.release()
            remove_empty(made)
            raise
        self.lock.release()
        self.made = []

    def training(self):
        """Training starts: what the run writes from here on is kept whatever becomes of it."""
        self.made = []

    def remove_own(self, made):
        """The run's own files (RUN_OWN), where this run made the directory (`made`)."""
        if os.path.abspath(self.root) not in made:
            return  # the directory existed before: nothing in it is this function's to remove
        for name in self.RUN_OWN:
            path = self.path(name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                os.remove(path)

    def _decide(self, resume, overwrite, local_mlflow):
        found = [f for f in self.RUN_FILES if os.path.exists(self.path(f))]
        if resume:
            self.refuse_planted(bool(found), local_mlflow)
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
        self.refuse_planted(False, local_mlflow)
        return None

    def refuse_planted(self, holds_run=False, local_mlflow=True):
        """Refuse, in one CheckpointError naming it, what the directory holds that would make the run write outside
        it or send its files away: a symbolic link at a name the run writes in place (or anywhere inside
        mlflow-artifacts/ and profile/, whose files' names are known in advance), and a local MLflow store whose
        artifact locations lie outside mlflow-artifacts/ (where the run logs to it: local_mlflow). holds_run: the
        directory holds a run, which --overwrite replaces (named as the fix)."""
        for name in self.WRITTEN_IN_PLACE:
            no_link_below(self.root, self.path(name))
        for folder in self.WRITTEN_INSIDE:
            link = first_link_within(self.path(folder))
            if link is not None:
                no_link_below(self.root, link)
        if local_mlflow:
            self.check_mlflow_store(holds_run)

    def check_mlflow_store(self, holds_run=False):
        """A local MLflow store found here is state from elsewhere, read as data (SQLite, read-only, never through a
        link) before MLflow opens it: every experiment's artifact location and every run's artifact URI must lie in
        mlflow-artifacts/, since MLflow writes a run's files, and uploads them with the user's credentials, wherever
        its store says. MLflow's own experiment 0 ('Default', made in every new store, its location in the working
        directory) is left be while no run is in it: a run logs into its own experiment (one that names Default is
        checked when the tracker opens it: holds_artifacts)."""
        fix = ("--overwrite removes it with the run (or remove it and mlflow-artifacts/, the run's MLflow history, "
               "yourself), or choose another --output-dir" if holds_run else
               "remove it, or choose another --output-dir")
        db = self.mlflow_db
        if not os.path.lexists(db):
            for sidecar in self.MLFLOW_DB_SIDECARS:
                if os.path.lexists(self.path(sidecar)):  # SQLite would roll it into the store MLflow creates
                    raise CheckpointError(f"{one_line(self.path(sidecar))}: SQLite's file of an MLflow store that "
                                          f"is not there, state from elsewhere; {fix}")
            return
        no_link_below(self.root, db)
        if not stat.S_ISREG(os.lstat(db).st_mode):
            raise CheckpointError(f"{one_line(db)}: not a file, so not an MLflow store this app made; {fix}")
        try:
            # mode=ro: nothing is written, a hot journal beside it is not rolled back (the read fails instead).
            store = sqlite3.connect(f"file:{quote(os.path.abspath(db))}?mode=ro", uri=True)
            try:
                tables = {row[0] for row in store.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                runs = list(store.execute("SELECT run_uuid, artifact_uri, experiment_id FROM runs")) \
                    if "runs" in tables else []
                experiments = list(store.execute("SELECT experiment_id, name, artifact_location FROM experiments")) \
                    if "experiments" in tables else []
            finally:
                store.close()
        except sqlite3.Error as e:
            raise CheckpointError(f"{one_line(db)}: cannot be read as an MLflow store ({one_line(str(e))}); "
                                  f"{fix}") from None
        used = {str(experiment) for _, _, experiment in runs}
        where = [(f"its experiment {name!r}", location) for experiment, name, location in experiments
                 if not (str(experiment) == "0" and "0" not in used)]
        where += [(f"its run {run}", uri) for run, uri, _ in runs]
        for what, location in where:
            if not self.holds_artifacts(location):
                raise CheckpointError(f"{one_line(db)}: {one_line(what)} keeps its files at "
                                      f"{one_line(redact(str(location)))}, outside {self.mlflow_artifacts}: a "
                                      f"tracking store from elsewhere, which would have MLflow write or send the "
                                      f"run's files there; {fix}")

    def holds_artifacts(self, location):
        """Whether the MLflow artifact location (a file:// URI or a plain path; no other scheme) lies in
        mlflow-artifacts/, resolved (a `..`, or a link on the way, that leads out of it does not)."""
        if not isinstance(location, str) or not location:
            return False
        parts = urlsplit(location)
        if parts.scheme == "file" and parts.netloc in ("", "localhost"):
            path = unquote(parts.path)
        elif parts.scheme == "":
            path = location
        else:
            return False
        base = os.path.realpath(self.mlflow_artifacts)
        return os.path.commonpath([os.path.realpath(path), base]) == base

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


def no_link_below(root, path):
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


def first_link_within(folder):
    """The first symbolic link anywhere inside `folder` (none is followed), or None."""
    for top, folders, files in os.walk(folder):  # a link to a folder is listed, never entered
        for name in sorted(folders + files):
            if os.path.islink(os.path.join(top, name)):
                return os.path.join(top, name)
    return None


def one_line(text):
    """`text` (a name or location found in a directory, which anyone may have chosen) with its control characters
    escaped, so that a message holding it stays one line."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m.group())[1:-1], text)


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
    os.fchmod(fd, run_file_mode())
    return fd, tmp


def run_file_mode():
    """The mode of the files a run writes: what the umask gives a new file (0640 under keep_private)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def with_run_mode(path):
    """Give the file at `path`, written by a library that chose its own mode (safetensors writes 0600), the mode
    of the run's other files."""
    os.chmod(path, run_file_mode())


def atomic_write(path, write, binary=False, sync=False, root=None):
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


def write_json(path, obj, root=None):
    def dump(f):
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    atomic_write(path, dump, root=root)


def append_line(path, line, root=None):
    """Append `line` to the file `path`, created where missing; a link planted at `path` is refused (OSError), never
    written through, and so is one on the way from the output directory `root` (CheckpointError)."""
    if root is not None:
        no_link_below(root, os.path.dirname(os.path.abspath(path)))
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
