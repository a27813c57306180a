"""The run directory (--output-dir): the name of every file a run writes, and how the directory is claimed.

    <output dir>/config.json        the resolved configuration
    <output dir>/metrics.jsonl      one record per epoch, appended as training goes
    <output dir>/summary.json       headline figures and the whole history, at the end (benchmark: its figures)
    <output dir>/evaluation.json    --evaluate's metrics
    <output dir>/curves.png         loss and accuracy curves
    <output dir>/tensorboard/       TensorBoard events
    <output dir>/checkpoints/       epoch_NNNN.pt, last.pt, best.pt
    <output dir>/profile/           --profile: rank<r>.trace.json (torch.profiler), horovod_timeline.json
    <output dir>/export/            hvd-train export: model<suffix> and its model card (model<suffix>.json)
    <output dir>/mlflow.db          --mlflow without --mlflow-uri: MLflow's store (SQLite) ...
    <output dir>/mlflow-artifacts/  ... and the files of its runs
    <output dir>/wandb/             --wandb: W&B's offline runs
    <output dir>/.hvd-train.lock    while a job runs in it (hvd_train/run/lock.py)

Only rank 0 writes, and every write goes through hvd_train/files.py (atomic_write): a reader, or a run killed
halfway, sees the old file or the new one, never half of one. Finding and reading the checkpoints here is
hvd_train/run/resume.py's; writing them, hvd_train/run/checkpoint.py's.

The directory owns its files: nothing a run writes lies outside it, and no symbolic link below it is followed (the
directory itself may be one, the user's choice). A link planted at a name the run writes into (a folder, a store, the
lock) is refused when the directory is claimed and again by each writer; a file the run replaces whole (config.json,
curves.png, ...) is renamed over a link planted there, which replaces the link. A tracking store found in the
directory is state from elsewhere, read as data: MLflow's must keep every run's files in mlflow-artifacts/.
"""
import contextlib
import os
import shutil
import sqlite3
import stat
import tempfile
from urllib.parse import quote, unquote, urlsplit

from hvd_train.errors import CheckpointError
from hvd_train.files import (first_link_within, missing_parents, no_link_below, one_line, read_json_or_none,
                             remove_empty, reported_write, write_json)
from hvd_train.run.lock import NAME as LOCK_NAME, RunLock
from hvd_train.uris import redact

# The checkpoints that stand for a run: the newest (what --resume auto continues) and the best by the task's metric
# (what evaluation, export and predict use).
LAST_CHECKPOINT, BEST_CHECKPOINT = "last.pt", "best.pt"


class RunDir:
    # Every name in the directory is spelled here (tracking.py, resume.py and tools/export.py take theirs from here).
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

    def exported(self, suffix):
        """export/model<suffix>: hvd-train export's file in a format (suffix: .onnx, .safetensors, ...)."""
        return os.path.join(self.export, self.EXPORTED + suffix)

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
            from hvd_train.run.resume import resolve  # resume.py reads the names spelled here: imported when used

            self.refuse_planted(bool(found), local_mlflow)
            path = resolve(self, resume)
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
