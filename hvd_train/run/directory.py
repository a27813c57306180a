"""The run directory (--output-dir): the name of every file a run writes (RunDir), and the lock by which one job
claims it (RunLock).

    <output dir>/config.json        the resolved configuration
    <output dir>/metrics.jsonl      one record per epoch, appended as training goes
    <output dir>/summary.json       headline figures and the whole history, at the end (benchmark: its figures)
    <output dir>/evaluation.json    --evaluate's metrics
    <output dir>/curves.png         loss and accuracy curves
    <output dir>/tensorboard/       TensorBoard events
    <output dir>/checkpoints/       last.pt, best.pt, epoch_NNNN.pt, step_NNNNNNNN.pt, best_epoch_NNNN.pt
    <output dir>/profile/           --profile: rank<r>.trace.json (torch.profiler), horovod_timeline.json
    <output dir>/export/            hvd-train export: model<suffix> and its model card (model<suffix>.json)
    <output dir>/mlflow.db          --mlflow without --mlflow-uri: MLflow's store (SQLite) ...
    <output dir>/mlflow-artifacts/  ... and the files of its runs
    <output dir>/wandb/             --wandb: W&B's offline runs
    <output dir>/.hvd-train.lock    while a job runs in it (RunLock)

Only rank 0 writes, and every write goes through hvd_train/files.py (atomic_write): a reader, or a run killed
halfway, sees the old file or the new one, never half of one. Writing, finding and reading the checkpoints is
hvd_train/run/checkpoint.py's; this module only names them.

The directory owns its files: nothing a run writes lies outside it, and no symbolic link below it is followed (the
directory itself may be one, the user's choice). A link planted at a name the run writes into (a folder, a store, the
lock) is refused when the directory is claimed and again by each writer; a file the run replaces whole (config.json,
curves.png, ...) is renamed over a link planted there, which replaces the link. A tracking store found in the
directory is state from elsewhere, read as data: MLflow's must keep every run's files in mlflow-artifacts/.

One job per output directory: rank 0 holds <output dir>/.hvd-train.lock while its run lives. The lock is made with
O_CREAT | O_EXCL, which lets one creator win on a local file system and on NFS (v3 and later, Linux clients), and
holds the holder's host, pid, process start time and a random token. A thread touches it every HEARTBEAT_S seconds.
A lock left by a job that is gone is taken over, with a warning:
- on the same host, when its pid no longer runs that process (the start time tells a reused pid apart);
- from another host, which cannot look at the holder's processes, when it has not been touched for STALE_S seconds
  (file times come from the file server on NFS, so this holds as long as the hosts' clocks agree within minutes).
Taking over a dead job's lock is best effort: two jobs that find the same stale lock at the same instant may both
start. A job that holds the lock is never displaced.
"""
import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
import sqlite3
import stat
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional
from urllib.parse import quote, unquote, urlsplit

import psutil

from hvd_train.errors import CheckpointError, redact
from hvd_train.files import (
    first_link_within,
    missing_parents,
    no_link_below,
    one_line,
    read_json_or_none,
    remove_empty,
    reported_write,
    write_json,
)

if TYPE_CHECKING:
    from hvd_train.config import Config

# The checkpoints that stand for a run: the newest (what --resume auto continues) and the best by the task's metric
# (what evaluation, export and predict use).
LAST_CHECKPOINT, BEST_CHECKPOINT = "last.pt", "best.pt"

NAME = ".hvd-train.lock"


class RunDir:
    made: list[str]
    # Every name in the directory is spelled here (tracking.py, checkpoint.py and tools/export.py take theirs from
    # here).
    CHECKPOINTS, TENSORBOARD, PROFILE, EXPORT = "checkpoints", "tensorboard", "profile", "export"
    EXPORTED = "model"  # export/model<the format's suffix>, and its card beside it
    MLFLOW_DB, MLFLOW_ARTIFACTS, WANDB = "mlflow.db", "mlflow-artifacts", "wandb"  # (W&B names its folder wandb/)
    # SQLite's files beside a database: a journal left there is rolled into the database when it is opened.
    MLFLOW_DB_SIDECARS = (MLFLOW_DB + "-journal", MLFLOW_DB + "-wal", MLFLOW_DB + "-shm")
    TRACKING_STORES = (MLFLOW_DB, *MLFLOW_DB_SIDECARS, MLFLOW_ARTIFACTS, WANDB)
    # Written whole into a temporary file and renamed over the name: a link planted there is replaced, never followed.
    REPLACED_WHOLE = ("config.json", "metrics.jsonl", "summary.json", "evaluation.json", "curves.png")
    # Written in place, into or through the name: a link there is refused (inside these folders too: their files'
    # names are known in advance).
    WRITTEN_IN_PLACE = (CHECKPOINTS, TENSORBOARD, PROFILE, EXPORT, *TRACKING_STORES, NAME)
    WRITTEN_INSIDE = (MLFLOW_ARTIFACTS, PROFILE)
    # What a run leaves behind; a fresh run refuses to start over these unless told to.
    RUN_FILES = (f"{CHECKPOINTS}/{LAST_CHECKPOINT}", "summary.json", "metrics.jsonl")
    REPLACED_ON_OVERWRITE = ("summary.json", "metrics.jsonl", "config.json", "curves.png", TENSORBOARD, CHECKPOINTS,
                             PROFILE, *TRACKING_STORES)
    # What a run may have written in a directory it made before its first step: removed when it stops then
    # (lock_held()).
    RUN_OWN = (*REPLACED_ON_OVERWRITE, "evaluation.json")

    def __init__(self, root: str) -> None:
        self.root = root
        self.lock = RunLock(root)  # taken by acquire(), for one job at a time
        # The directories acquire() made, deepest first, until training starts (lock_held(), keep_from_now()).
        self.made = []
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

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def checkpoint(self, name: str) -> str:
        """checkpoints/<name>: last.pt, best.pt or epoch_NNNN.pt."""
        return os.path.join(self.checkpoints, name)

    def exported(self, suffix: str) -> str:
        """export/model<suffix>: hvd-train export's file in a format (suffix: .onnx, .safetensors, ...)."""
        return os.path.join(self.export, self.EXPORTED + suffix)

    def acquire(self, resume: str, overwrite: bool, local_mlflow: bool = False, *,
                find_checkpoint: Callable[["RunDir", str], Optional[str]]) -> Optional[str]:
        """Take the directory's lock (a job running in it refuses this one), then decide how this run uses it
        without losing an earlier run; returns the checkpoint to resume from, or None for a fresh start. A
        directory holding a run is continued (--resume), replaced (--overwrite), or refused with the choices named;
        a refused run leaves the lock and a directory it made behind it as they were. local_mlflow: the run logs to
        the MLflow store in the directory (--mlflow without --mlflow-uri), which is checked first. The directories
        made here are remembered until training starts: a run stopped before then removes them (lock_held()).
        find_checkpoint(run_dir, resume) is the checkpoint --resume names (run/checkpoint.py's
        checkpoint_to_resume, passed in: the checkpoint's room reads the names this one spells)."""
        made = missing_parents(self.root)  # the lock makes them: a refused run removes them again
        self.lock.acquire()
        try:
            decided = self._decide(resume, overwrite, local_mlflow, find_checkpoint)
        except CheckpointError:
            self.lock.release()
            remove_empty(made)
            raise
        self.made = made
        return decided

    @contextlib.contextmanager
    def lock_held(self) -> Iterator["RunDir"]:
        """The claimed directory until the block ends, when its lock is released. A run stopped before training
        started (keep_from_now() not called: a checkpoint of another model, a refused setting or plug-in found after the
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

    def keep_from_now(self) -> None:
        """Training starts: what the run writes from here on is kept whatever becomes of it."""
        self.made = []

    def remove_own(self, made: list[str]) -> None:
        """The run's own files (RUN_OWN), where this run made the directory (`made`)."""
        if os.path.abspath(self.root) not in made:
            return  # the directory existed before: nothing in it is this function's to remove
        for name in self.RUN_OWN:
            path = self.path(name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                os.remove(path)

    def _decide(self, resume: str, overwrite: bool, local_mlflow: bool,
                find_checkpoint: Callable[["RunDir", str], Optional[str]]) -> Optional[str]:
        found = [f for f in self.RUN_FILES if os.path.exists(self.path(f))]
        if resume:
            self.refuse_planted(bool(found), local_mlflow)
            path = find_checkpoint(self, resume)
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

    def refuse_planted(self, holds_run: bool = False, local_mlflow: bool = True) -> None:
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

    def check_mlflow_store(self, holds_run: bool = False) -> None:
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

    def holds_artifacts(self, location: object) -> bool:
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

    def acquire_for_benchmark(self, overwrite: bool) -> None:
        """A benchmark writes summary.json: it may replace an earlier benchmark's, never a training run's."""
        summary = read_json_or_none(self.summary)
        holds_run = os.path.exists(self.checkpoints) or (summary is not None and summary.get("mode") != "benchmark")
        if holds_run and not overwrite:
            raise CheckpointError(f"{self.root} holds a training run; give the benchmark another --output-dir, or "
                                  f"replace the run with --overwrite")


def write_config(path: str, cfg: "Config") -> None:
    """The run's settings (config.json), written whole; a failed write is one CheckpointError."""
    with reported_write(path):
        write_json(path, cfg.to_dict())


def check_writable(root: str, tidy: bool = True) -> None:
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


log = logging.getLogger("hvd_train")

HEARTBEAT_S = 30.0
STALE_S = 300.0


class RunLock:
    token: Optional[str]

    def __init__(self, root: str) -> None:
        self.root, self.path = root, os.path.join(root, NAME)
        self.token, self._stop = None, threading.Event()

    def acquire(self) -> None:
        """Take the lock, or raise CheckpointError naming the job that holds it and what to do."""
        os.makedirs(self.root, exist_ok=True)
        me = psutil.Process()
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "started": me.create_time(),
                "token": secrets.token_hex(8)}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.read()
                if holder is not None and (holder.get("host"), holder.get("pid")) == (mine["host"], mine["pid"]):
                    os.remove(self.path)  # this process's own, from a run before in it (hvd_train.train() twice)
                    continue
                reason = self.gone(holder)
                if reason is None:
                    raise CheckpointError(self.held_message(holder)) from None
                log.warning("--output-dir %s: taking over the lock of a job that is gone (%s)", self.root, reason)
                if self.read() == holder:  # still that job's lock, not one a third job has just taken
                    try:
                        os.remove(self.path)
                    except FileNotFoundError:
                        pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
            self.token = mine["token"]
            threading.Thread(target=self._heartbeat, name="hvd-train-lock", daemon=True).start()
            return
        raise CheckpointError(f"--output-dir {self.root}: another job took it over at the same moment ({self.path}); "
                              f"choose another --output-dir")

    def read(self) -> Optional[dict[str, Any]]:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):  # gone meanwhile, or written halfway by a job that died
            return None

    def gone(self, holder: Optional[dict[str, Any]]) -> Optional[str]:
        """Why the holder is gone, or None while it may be alive."""
        age = time.time() - os.path.getmtime(self.path) if os.path.exists(self.path) else STALE_S + 1
        if holder is None or holder.get("host") != socket.gethostname():
            return f"its lock was not touched for {age:.0f} s" if age > STALE_S else None
        try:
            process = psutil.Process(holder["pid"])
            # A zombie has ended: only its parent has not reaped it (a killed launcher's rank, in a container
            # whose first process reaps nothing).
            alive = (abs(process.create_time() - holder["started"]) < 1.0
                     and process.status() != psutil.STATUS_ZOMBIE)
        except (psutil.NoSuchProcess, KeyError, TypeError):
            alive = False
        return None if alive else f"pid {holder.get('pid')} on {holder['host']} no longer runs"

    def held_message(self, holder: Optional[dict[str, Any]]) -> str:
        if holder is None:
            who = f"a job whose lock file cannot be read ({self.path})"
        else:
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
            who = f"the job whose rank 0 runs on {holder.get('host')} as pid {holder.get('pid')}, started {started}"
        return (f"--output-dir {self.root} is in use by {who}; wait for it to end, or choose another --output-dir. "
                f"If that job is gone, the next run takes its lock over (at once on the same host; from another, "
                f"{STALE_S / 60:.0f} minutes after its last sign of life), or delete {self.path}")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Remove the lock if this process holds it (a job that took it over since keeps its own)."""
        if self.token is None:
            return
        self._stop.set()
        holder = self.read()
        if holder is not None and holder.get("token") == self.token:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        self.token = None
