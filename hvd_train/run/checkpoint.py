"""Checkpoints, written and read in one place: everything a run needs to continue exactly.

A checkpoint holds the model, optimizer and AMP scaler states, the run state (epoch, optimizer steps, best metric,
per-epoch history), the resolved config and every rank's RNG states (torch's, CUDA's, Python's and NumPy's global
generator's); the learning rate follows from the epoch. Files in checkpoints/ (RunDir names the folder, last.pt and
best.pt: hvd_train/run/directory.py): last.pt, best.pt, epoch_NNNN.pt (the newest keep_last), best_epoch_NNNN.pt
(--checkpoint-hist) and step_NNNNNNNN.pt (the newest taken within an epoch, named by the run's optimizer steps).

Written by rank 0 (Checkpointer): atomically and flushed to disk, by default from a copy in host memory on a thread
of its own while training goes on.
Read here alone (load): torch.load(weights_only=True) of a file whose members are all stored as torch.save stores
them, through the gate (hvd_train/provenance.py), checked against the settings of the run that loads it. Found: the
checkpoint --resume names (`auto`: the newest whole one in checkpoints/, said in one line where newer ones were passed
over or a save was never finished), and the one a run directory offers export and predict (best.pt, else last.pt).
Resumed: rank 0 reads, every rank gets the weights, the run state, and its RNG states where the number of ranks is
unchanged.

Within epochs (StepSaves): every N steps and every M minutes; on SIGUSR1 or SIGTERM and ahead of a SLURM job's time
limit, a save and then a stop. Such a checkpoint also holds where the epoch stands (its steps done, each rank's metric
sums of them and the time they took), and `--resume auto` from it continues at the next step, bit for bit (the loader
skips the batches done without loading them; hvd_train.data). Every rank must take it at the same step: a step count
is the same everywhere, but a clock, a signal that reached some ranks, or rank 0's background writer failing are not,
so each step every rank votes (hvd_utils.StepVote: an asynchronous allreduce, read one step later) and all act on the
same sums at the same step.
"""
import logging
import os
import pickle
import random
import re
import shutil
import signal
import stat
import threading
import time
import warnings
import zipfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union, cast

import numpy as np
import torch

import hvd_utils
from hvd_train.errors import CheckpointError
from hvd_train.files import atomic_write, no_link_below, reported_write, temporary_beside
from hvd_train.guards import interrupt
from hvd_train.guards.divergence import check_finite
from hvd_train.provenance import RecordError, plain
from hvd_train.run.directory import BEST_CHECKPOINT, LAST_CHECKPOINT, RunDir

if TYPE_CHECKING:
    from hvd_train.config import Config
    from hvd_train.data import DataInfo
    from hvd_train.run.state import AfterEpoch, RunState
    from hvd_train.tasks import RunTask
    from hvd_train.trainer import Batching, LRSchedule, Trainer, WeightAverage

log = logging.getLogger("hvd_train")
VERSION = 1


def seed_generators(seed: int) -> None:
    """Seed every generator a model, a task or a user's data set may draw from in this process: torch's (CUDA's
    too), Python's `random` and NumPy's global one (which takes 32 bits): the ones rng_state() saves."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state() -> dict[str, Any]:
    """This process's random number generator states, in types torch.load(weights_only=True) accepts: NumPy's
    global generator's as its name, its key (a torch int64 tensor, not a NumPy array) and plain numbers."""
    kind, key, pos, has_gauss, gauss = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"kind": str(kind), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """The states rng_state() returned put back; a checkpoint written before NumPy's was saved leaves it as it
    is (seeded by --seed)."""
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(state["python"]))
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def atomic_save(obj: object, path: str) -> None:
    """torch.save through the run directory's atomic writer, flushed to disk."""
    atomic_write(path, lambda f: torch.save(obj, f), binary=True, sync=True)


def _link_or_copy(src: str, dst: str) -> None:
    """dst becomes the same content as src, atomically (a hard link costs no space; copy where links fail)."""
    fd, tmp = temporary_beside(dst)
    os.close(fd)
    os.remove(tmp)  # only the unpredictable name is wanted: link() refuses a name that exists, even a planted link
    try:
        os.link(src, tmp)
        os.replace(tmp, dst)
    except OSError:
        with open(src, "rb") as source:
            atomic_write(dst, lambda f: shutil.copyfileobj(source, f), binary=True)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


EPOCH_FILE = re.compile(r"epoch_(\d+)\.pt")
BEST_FILE = re.compile(r"best_epoch_(\d+)\.pt")  # --checkpoint-hist: one of the N best epochs
STEP_FILE = re.compile(r"step_(\d+)\.pt")  # a checkpoint within an epoch, by the run's optimizer steps
# The temporary file the atomic writer (files.temporary_beside: tempfile.mkstemp, 8 characters of its alphabet)
# makes beside a checkpoint; a writer killed mid-write leaves one. Nothing else in checkpoints/ is the app's to remove.
LEFT_BEHIND = re.compile(r"(last|best|epoch_\d{4,}|best_epoch_\d{4,}|step_\d{8,})\.pt\.tmp\.[a-z0-9_]{8}")
KEPT_TAIL = "; the checkpoints written before are intact, and --resume auto continues from the newest"


def numbered_files(directory: str, pattern: "re.Pattern[str]" = EPOCH_FILE) -> list[str]:
    """The files in `directory` whose names `pattern` numbers, oldest first (any other file, say epoch_best.pt, is
    left be)."""
    if not os.path.isdir(directory):
        return []
    numbered = [(int(m.group(1)), name) for name in os.listdir(directory) if (m := pattern.fullmatch(name))]
    return [os.path.join(directory, name) for _, name in sorted(numbered)]


def epoch_files(directory: str) -> list[str]:
    """Per-epoch checkpoints in `directory`, oldest first."""
    return numbered_files(directory, EPOCH_FILE)


def snapshot(obj: Any, copy: Union[bool, str] = True) -> Any:
    """A checkpoint's contents as torch saves them: the containers rebuilt as plain dicts, lists and tuples (what
    torch.load(weights_only=True) reads back) and, where `copy`, every tensor copied into host memory (from the
    GPU, or cloned) so that training can change the originals while a thread writes the copy. A part made for the
    checkpoint alone (`written_as_is`: a sharded optimizer's gathered state, hvd_utils/zero.py) is not copied where
    it is in host memory already (copying it held the whole state twice on rank 0)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True) if copy is True or (copy and obj.device.type != "cpu") else obj
    if copy and getattr(obj, "written_as_is", False):
        copy = "off the host only"
    if isinstance(obj, dict):
        return {key: snapshot(value, copy) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(value, copy) for value in obj)
    return obj


class Checkpointer:
    """Writes checkpoints on rank 0 and keeps last.pt, best.pt, the newest keep_last per-epoch files and the newest
    file written within an epoch (step_NNNNNNNN.pt, until an epoch's end supersedes it).

    background: each save copies the checkpoint into host memory and a thread of its own writes it while training
    goes on; a save waits for the one before it, and a failed write is raised by the next save, by failure() and
    by wait(). Otherwise the save writes in the caller's thread."""
    writer: Optional[threading.Thread]
    error: Optional[CheckpointError]

    def __init__(self, directory: str, keep_last: int = 3, enabled: bool = True, background: bool = False) -> None:
        self.directory, self.keep_last, self.enabled, self.background = directory, keep_last, enabled, background
        self.writer, self.error = None, None
        if enabled:
            no_link_below(os.path.dirname(os.path.abspath(directory)), directory)  # its folder is the run's own
            os.makedirs(directory, exist_ok=True)
            # Left by a writer that was killed mid-write (the files they were replacing are intact): only the
            # temporary files the app names and makes, only files (a link is no file of the app's), listed and
            # removed in the folder opened without following a link.
            folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                for name in os.listdir(folder):
                    if LEFT_BEHIND.fullmatch(name) and \
                            stat.S_ISREG(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
                        os.remove(name, dir_fd=folder)
            finally:
                os.close(folder)

    def save(self, payload: dict[str, Any], epoch: int, is_best: bool, best_epochs: Sequence[int] = (),
             then: Optional[Callable[[], None]] = None) -> Optional[str]:
        """Write epoch `epoch`; returns the path of last.pt (None on ranks that do not write). A failed write (a
        full disk) is one CheckpointError and leaves the earlier checkpoints as they were. best_epochs: the N best
        epochs (--checkpoint-hist N > 1), kept as best_epoch_NNNN.pt whatever keep_last removes. then(): after the
        checkpoint is written (the epoch's record follows its checkpoint)."""
        if not self.enabled:
            return None
        also = [LAST_CHECKPOINT, *([BEST_CHECKPOINT] if is_best else []),
                *([f"best_epoch_{epoch:04d}.pt"] if epoch in best_epochs else [])]
        return self._submit(lambda data: self._write_epoch(data, epoch, is_best, best_epochs), payload, then,
                            f"checkpoint epoch {epoch}", f"epoch_{epoch:04d}.pt", also)

    def save_step(self, payload: dict[str, Any], step: int, then: Optional[Callable[[], None]] = None,
                  what: Optional[str] = None) -> Optional[str]:
        """Write a checkpoint taken within an epoch, after optimizer step `step` of the run, as step_NNNNNNNN.pt and
        last.pt; the older step file goes. `what`: how its lines name it (where in the epoch it was taken)."""
        if not self.enabled:
            return None
        return self._submit(lambda data: self._write(data, f"step_{step:08d}.pt"), payload, then,
                            what or f"checkpoint at step {step}", f"step_{step:08d}.pt", [LAST_CHECKPOINT])

    def failure(self) -> Optional[CheckpointError]:
        """The error of a background write that has failed (None while writing, or if none failed)."""
        if self.writer is not None and not self.writer.is_alive():
            self.writer = None
        return self.error

    def raise_failure(self) -> None:
        error, self.error = self.failure(), None
        if error is not None:
            raise error

    def wait_ignoring_errors(self) -> None:
        """Wait for the write under way, whatever becomes of it (a run that stops on another error)."""
        if self.writer is not None:
            self.writer.join()

    def wait(self) -> None:
        """Wait for the write under way; raise its error."""
        if self.writer is not None:
            self.writer.join()
            self.writer = None
        self.raise_failure()

    def _submit(self, write: Callable[[Any], object], payload: dict[str, Any], then: Optional[Callable[[], None]],
                what: str, name: str, also: list[str]) -> str:
        """write() the payload, here or on the writer's thread (background). Said as `what` ("checkpoint epoch 3"):
        a background write says where it writes when it starts; either says "saved" with the file's name once it
        is in place (renamed over its name), with `also`, the names linked to it (last.pt, best.pt)."""
        self.wait()  # one write at a time: the next save waits for the last
        last = os.path.join(self.directory, LAST_CHECKPOINT)
        path = os.path.join(self.directory, name)
        saved = f"{what}: saved {path} (and {', '.join(also)})"
        if not self.background:
            write(snapshot(payload, copy=False))
            log.info("%s", saved)
            if then is not None:
                then()
            return last
        data = snapshot(payload)
        log.info("%s: writing %s in the background", what, path)

        def run() -> None:
            with interrupt.background_write():  # the process ends only once it is written
                try:
                    write(data)
                    log.info("%s", saved)
                    if then is not None:
                        then()
                except CheckpointError as e:
                    self.error = e
                except Exception as e:  # a bug, or a fault the writer cannot name: still one error, raised later
                    self.error = CheckpointError(f"writing a checkpoint in {self.directory} failed: "
                                                 f"{type(e).__name__}: {e}{KEPT_TAIL}")

        # Not a daemon: the interpreter waits for it at exit, so a run that ends right after a save leaves it whole.
        self.writer = threading.Thread(target=run, name="checkpoint-writer")
        self.writer.start()
        return last

    def _write(self, payload: Any, name: str) -> str:
        """payload as `name` and last.pt, atomically; then the older files written within epochs go."""
        path = os.path.join(self.directory, name)
        with reported_write(path, KEPT_TAIL):
            # An elastic run's writer may change, and start late; never into a link planted meanwhile.
            no_link_below(os.path.dirname(os.path.abspath(self.directory)), self.directory)
            os.makedirs(self.directory, exist_ok=True)
            atomic_save(payload, path)
            _link_or_copy(path, os.path.join(self.directory, LAST_CHECKPOINT))
        for old in numbered_files(self.directory, STEP_FILE):
            if old != path:
                os.remove(old)
        return path

    def _write_epoch(self, payload: Any, epoch: int, is_best: bool, best_epochs: Sequence[int]) -> None:
        path = self._write(payload, f"epoch_{epoch:04d}.pt")
        with reported_write(path, KEPT_TAIL):
            if is_best:
                _link_or_copy(path, os.path.join(self.directory, BEST_CHECKPOINT))
            if epoch in best_epochs:
                _link_or_copy(path, os.path.join(self.directory, f"best_epoch_{epoch:04d}.pt"))
        if best_epochs:
            for name in os.listdir(self.directory):
                kept = BEST_FILE.fullmatch(name)
                if kept and int(kept.group(1)) not in best_epochs:
                    os.remove(os.path.join(self.directory, name))
        for old in epoch_files(self.directory)[:-self.keep_last or None]:
            os.remove(old)


# The setting behind each field a checkpoint must share with the run that loads it (checkpoint_fits).
FIT_SETTINGS = {"model_name": "--model", "task": "--task", "dataset": "--dataset", "optimizer_name": "--optimizer",
                "num_classes": "the data set's num_classes", "in_channels": "the data set's in_channels",
                "image_size": "--image-size"}


# Finding: which file a run continues from, or export and predict read.
def checkpoint_to_resume(run_dir: RunDir, resume: str, training: bool = True) -> Optional[str]:
    """The checkpoint named by --resume in the RunDir `run_dir`: a path, or `auto` for the newest intact checkpoint
    in checkpoints/ (last.pt, else the newest whole one beside it, named in one line with why the newer ones were
    passed over; None when there is none yet, so a job script can always pass --resume auto). A save its writer
    never finished (killed mid-write: only its temporary file is there) is named in one line too, with the
    checkpoint resumed from instead (where `training`: --evaluate reads a checkpoint and removes nothing, and may
    run beside a job whose save is under way). A path is taken as given."""
    if resume == "auto":
        path, passed_over = newest_intact(run_dir.checkpoints)
        if training:
            say_unfinished(run_dir, unfinished_saves(run_dir.checkpoints), path)
        if passed_over:
            skipped = "; ".join(f"{os.path.relpath(p, run_dir.root)} ({why})" for p, why in passed_over)
            if path is None:
                raise CheckpointError(f"--resume auto: no checkpoint in {run_dir.checkpoints} is whole: {skipped}; "
                                      f"pass --overwrite to start again, or --resume a checkpoint you have")
            log.warning("--resume auto: passed over %s; resuming from %s, the newest whole checkpoint", skipped,
                        os.path.relpath(path, run_dir.root))
        return path
    if not os.path.isfile(resume):
        raise CheckpointError(f"--resume {resume}: no such file")
    return resume


def say_unfinished(run_dir: RunDir, unfinished: list[tuple[str, str]], path: Optional[str]) -> None:
    """One line for the saves whose writer was stopped before the rename ([(file it was to become, temporary
    file left)]): what was not saved, and what --resume auto continues from instead."""
    if not unfinished:
        return

    def rel(p: str) -> str:
        return os.path.relpath(p, run_dir.root)

    what = "; ".join(f"{rel(target)} (its writer stopped before the rename and left {rel(left)}, which this "
                     f"run removes)" for target, left in unfinished)
    if path is None:
        instead = "no checkpoint was saved before it, so the run starts afresh"
    elif any(target == path for target, _ in unfinished):
        instead = f"resuming from {rel(path)} as it was before that save"
    else:
        instead = f"resuming from {rel(path)} instead"
    log.warning("--resume auto: a save was not finished: %s; %s", what, instead)


def newest_intact(directory: str) -> tuple[Optional[str], list[tuple[str, str]]]:
    """(the newest checkpoint in `directory` that is whole, or None; [(path, why) of each newer one passed over]).
    Newest first: last.pt, then the checkpoints taken within an epoch (they outlive only the newest epoch's), then
    the epochs'."""
    candidates = [os.path.join(directory, LAST_CHECKPOINT), *numbered_files(directory, STEP_FILE)[::-1],
                  *epoch_files(directory)[::-1]]
    passed_over: list[tuple[str, str]] = []
    for path in candidates:
        if os.path.isfile(path):
            why = damage(path)
            if why is None:
                return path, passed_over
            passed_over.append((path, why))
    return None, passed_over


def unfinished_saves(directory: str) -> list[tuple[str, str]]:
    """[(the checkpoint a killed writer was saving, the temporary file it left)] in `directory`, by name: the files
    (never links) LEFT_BEHIND matches, which the next Checkpointer removes."""
    if not os.path.isdir(directory):
        return []
    return [(os.path.join(directory, name.split(".tmp.")[0]), os.path.join(directory, name))
            for name in sorted(os.listdir(directory))
            if LEFT_BEHIND.fullmatch(name) and os.path.isfile(os.path.join(directory, name))
            and not os.path.islink(os.path.join(directory, name))]


def damage(path: str) -> Optional[str]:
    """Why the checkpoint file at `path` cannot be resumed from, or None: cut short (no whole zip archive), or a
    member whose bytes no longer match their checksum (every member is read)."""
    try:
        if not zipfile.is_zipfile(path):
            return "cut short: not a whole zip archive"
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
        return f"its member {bad} fails its checksum" if bad else None
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        return f"unreadable ({e})"


def find_checkpoint(source: str) -> str:
    """The checkpoint `source` names: the file itself, or a run directory's best.pt (last.pt without one)."""
    if os.path.isdir(source):
        run_dir = RunDir(source)
        for name in (BEST_CHECKPOINT, LAST_CHECKPOINT):
            for path in (run_dir.checkpoint(name), run_dir.path(name)):  # its checkpoints/, or given that folder
                if os.path.isfile(path):
                    return path
        raise CheckpointError(f"{source}: no checkpoints/best.pt or checkpoints/last.pt in this directory; give a "
                              f"run's output directory (--output-dir) or a checkpoint file")
    if not os.path.isfile(source):
        raise CheckpointError(f"{source}: no such file or directory; give a run's output directory or a checkpoint")
    return source


# Reading one file: bounded, data only, one of ours, and fit for the run that loads it.
def unbounded_members(path: str) -> Optional[str]:
    """Why reading the torch.save archive at `path` could take more memory than the file holds, or None. torch.save
    stores every member as it is; torch.load inflates a compressed one in memory whatever its size, so a small file
    of DEFLATE-compressed zeros would take gigabytes before its contents could be checked."""
    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
    for member in members:
        if member.compress_type != zipfile.ZIP_STORED or member.file_size != member.compress_size:
            return (f"its member {member.filename} is compressed ({member.compress_size:,} bytes that would inflate "
                    f"to {member.file_size:,}); torch.save stores every member uncompressed")
    if sum(m.file_size for m in members) > os.path.getsize(path):
        return "its members claim more bytes than the file holds"
    return None


def load(path: str) -> dict[str, Any]:
    """Read a checkpoint safely (weights_only, every member stored) and check it is one of ours."""
    if os.path.isdir(path):
        raise CheckpointError(f"{path}: is a directory; give a checkpoint file such as {path}/last.pt")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: not a checkpoint, or one cut short (torch.save writes a zip archive and this "
                              f"is not a whole one)")
    unbounded = unbounded_members(path)
    if unbounded:
        raise CheckpointError(f"{path}: not a checkpoint torch.save wrote: {unbounded}; it is refused unread")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols, meaningless to a user
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's own message advises weights_only=False, which would run the file's code: not for our users.
        raise CheckpointError(f"{path}: not an hvd-train checkpoint (it holds Python objects other than tensors "
                              f"and plain values, and is refused: loading those could run code)") from None
    except Exception as e:  # a zip archive cut short or damaged
        raise CheckpointError(f"{path}: damaged or incomplete checkpoint ({type(e).__name__}); resume from an "
                              f"earlier one in the same directory") from None
    try:  # the gate (hvd_train/provenance.py): its plain values bounded as a tree, shared references counted each time
        plain(ckpt, path)
    except RecordError as e:
        raise CheckpointError(f"{e}; it is refused") from None
    if not isinstance(ckpt, dict) or ckpt.get("version") != VERSION:
        raise CheckpointError(f"{path}: not an hvd-train checkpoint (version {VERSION} expected)")
    return ckpt


def check_fits(ckpt: dict[str, Any], path: str, expect: Mapping[str, object]) -> None:
    """Every setting in `expect` the checkpoint records must match (older checkpoints record fewer)."""
    for key, value in expect.items():
        if key in ckpt and ckpt[key] != value:
            setting = FIT_SETTINGS.get(key, key)
            raise CheckpointError(f"{path} was written with {key}={ckpt[key]!r}, this run has {key}={value!r}: a "
                                  f"checkpoint fits only a run with the same {key} ({setting}); use the "
                                  f"checkpoint's setting, or another file")


def read_into(path: str, model: torch.nn.Module, expect: Mapping[str, object],
              optimizer: Optional[torch.optim.Optimizer] = None,
              ema: Optional["WeightAverage"] = None) -> dict[str, Any]:
    """Load checkpoint `path` into the model (and the optimizer, and the weights' average, when given) after
    checking it fits `expect`; returns its other fields (counters, history, scaler, world size, RNG states). A
    checkpoint without an average starts one from its weights."""
    ckpt = load(path)
    check_fits(ckpt, path, expect)
    try:
        model.load_state_dict(ckpt["model"])
        if optimizer is not None:
            optimizer.load_state_dict(ckpt["optimizer"])
        if ema is not None and isinstance(ckpt.get("ema"), dict):
            ema.load_state_dict(ckpt["ema"])
        elif ema is not None:
            ema.restart(model)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: its weights do not fit this model ({str(e).splitlines()[0]})")
    planned = (ckpt.get("config") or {}).get("optim", {}).get("epochs")
    return {**{k: v for k, v in ckpt.items() if k not in ("model", "optimizer", "config", "ema")},
            "planned_epochs": planned}


# Resuming: rank 0 reads, every rank continues from what it read.
def checkpoint_fits(cfg: "Config", info: "DataInfo", task: "RunTask",
                    continuing: bool = True) -> dict[str, Union[str, int, None]]:
    """The settings a checkpoint must share with this run to be loaded into it: the model's shape always; to
    continue training also the data it was trained on and the optimizer whose state it holds."""
    fits = {"model_name": cfg.model.name, "task": task.name, "num_classes": info.num_classes,
            "in_channels": info.in_channels, "image_size": info.image_size}
    if continuing:
        fits.update(dataset=cfg.data.dataset, optimizer_name=cfg.optim.optimizer)
    return fits


def resume(path: str, trainer: "Trainer", state: "RunState", fits: Mapping[str, object]) -> None:
    """Continue from checkpoint `path` on every rank: read_checkpoint, then rank 0's weights and optimizer state to
    the others (as an elastic run does inside Horovod's loop; train_hvd.py shows that broadcast as its own step)."""
    read_checkpoint(path, trainer, state, fits)
    hvd_utils.broadcast_state(trainer.model, trainer.optimizer, root_rank=0)


def read_checkpoint(path: str, trainer: "Trainer", state: "RunState",
                    fits: Mapping[str, object]) -> dict[str, Any]:
    """Rank 0 reads checkpoint `path` into its model and optimizer (Horovod's broadcast, next, gives them to every
    rank); every rank gets the weights' average (--model-ema), the scaler, its RNG states where the number of ranks
    is unchanged, and the run state (the learning rate follows from its epoch). A checkpoint that has reached
    --epochs is refused: there is nothing to train, and no summary may pretend so."""
    meta = hvd_utils.decide_on_root(lambda: read_into(path, trainer.model, fits, trainer.optimizer, trainer.ema),
                                    "checkpoint")
    if trainer.ema is not None:
        hvd_utils.broadcast_module(trainer.ema)
    if meta["epoch"] >= trainer.epochs:
        raise CheckpointError(f"--resume {path}: nothing to train: the checkpoint is at epoch {meta['epoch']} and "
                              f"--epochs is {trainer.epochs}; pass a larger --epochs to train further, or "
                              f"--evaluate --resume {path} to measure it")
    if trainer.scaler is not None and meta.get("scaler"):
        trainer.scaler.load_state_dict(meta["scaler"])
    restore_rng(meta)
    state.load(meta)
    state.resumed(path, hvd_utils.world_size(), meta.get("world_size"))
    say_schedule_change(trainer.schedule, meta.get("planned_epochs"), meta["epoch"])
    return meta.get("rank_buffers") or {}


def restore_rank_buffers(trainer: "Trainer", rank_buffers: dict[str, Any], partial: dict[str, Any]) -> None:
    """After the broadcast of rank 0's state, each rank's own BatchNorm statistics (of the model and of the
    average) from a checkpoint taken within an epoch; on another number of ranks than wrote it, their average,
    said in one line."""
    averaged = hvd_utils.restore_buffers_by_rank(trainer.model, rank_buffers.get("model"))
    if trainer.ema is not None:
        averaged = hvd_utils.restore_buffers_by_rank(trainer.ema.module, rank_buffers.get("ema")) or averaged
    if averaged:
        log.info("the checkpoint was taken within epoch %d on %d ranks, whose BatchNorm statistics differ: each of "
                 "the %d ranks now goes on from their average", partial["epoch"], partial["world_size"],
                 hvd_utils.world_size())


def say_schedule_change(schedule: "LRSchedule", planned: Optional[int], epoch: int) -> None:
    """A resume with another --epochs than the checkpoint's run planned changes the cosine schedule from here on
    (it decays to 0 at the new end): said in one line, with the rate it changes."""
    c = schedule.cfg
    if not planned or planned == c.epochs or c.lr_schedule != "cosine":
        return
    before = schedule.lr(epoch, planned_epochs=planned)
    log.info("--epochs %d where the checkpoint's run planned %d: the cosine schedule now decays to 0 over %d epochs, "
             "so the learning rate after epoch %d is %.4g (it was %.4g on the old plan)", c.epochs, planned, c.epochs,
             epoch, schedule.lr(epoch), before)


def load_everywhere(path: str, model: torch.nn.Module, expect: Mapping[str, object],
                    optimizer: Optional[torch.optim.Optimizer] = None,
                    ema: Optional["WeightAverage"] = None) -> dict[str, Any]:
    """Rank 0 loads checkpoint `path` (checked against `expect`: model_name, task, num_classes, dataset, ...), then
    every rank gets its weights and optimizer state (and the weights' average, under --model-ema): the one loader of
    resuming, elastic and evaluation runs. Returns the checkpoint's other fields, the same on every rank."""
    meta = hvd_utils.decide_on_root(lambda: read_into(path, model, expect, optimizer, ema), "checkpoint")
    hvd_utils.broadcast_state(model, optimizer)
    if ema is not None:
        hvd_utils.broadcast_module(ema)
    return meta


def restore_rng(meta: dict[str, Any]) -> None:
    """This rank's RNG states from a checkpoint's, where it was written by as many ranks as there are now (with
    another number of ranks, rank r's stream would not continue anyway)."""
    if meta.get("world_size") == hvd_utils.world_size() and meta.get("rng"):
        set_rng_state(meta["rng"][hvd_utils.rank()])


SAVE, SIGTERM, SIGUSR1, TIME_LIMIT, FAILED = range(5)  # what each rank raises in the step vote


@dataclass
class SaveTimes:
    """How long the training thread waited for each checkpoint taken within an epoch (the summary reports it)."""
    background: bool
    seconds: list = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        s = self.seconds
        return {"count": len(s), "background": self.background, "mean_stall_s": sum(s) / len(s) if s else 0.0,
                "max_stall_s": max(s, default=0.0)}


class StepSaves:
    """Told of every optimizer step (hvd_train/trainer.py Hooks.after_step); writes the checkpoints due within the
    epoch and stops the run, after one, when a signal or the time limit asks."""

    def __init__(self, cfg: "Config", after_epoch: "AfterEpoch", deadline: Optional[float] = None) -> None:
        c = cfg.checkpoint
        self.every_steps, self.every_s, self.deadline = c.every_steps, c.every_minutes * 60, deadline
        self.after_epoch = after_epoch  # its payload, the run state and rank 0's checkpointer
        self.vote = hvd_utils.StepVote("step_vote", 5)
        self.last = time.monotonic()
        self.times = SaveTimes(c.background)

    def after_step(self, epoch: int, step: int, steps: int, sums: dict[str, torch.Tensor]) -> None:
        raised = [0] * 5
        clock_due = bool(self.every_s) and time.monotonic() - self.last >= self.every_s
        raised[SAVE] = int(clock_due and hvd_utils.rank() == 0)  # rank 0's clock decides
        asked = interrupt.stop_asked() and interrupt.signalled()
        raised[SIGTERM], raised[SIGUSR1] = int(asked == signal.SIGTERM), int(asked == signal.SIGUSR1)
        raised[TIME_LIMIT] = int(self.deadline is not None and time.monotonic() >= self.deadline)
        raised[FAILED] = int(self.checkpointer.failure() is not None)
        agreed = self.vote.exchange(raised)
        if agreed[FAILED]:  # rank 0's last background write failed: every rank stops here with its message
            hvd_utils.decide_on_root(self.checkpointer.raise_failure, "background_write")
        stop = agreed[SIGTERM] or agreed[SIGUSR1] or agreed[TIME_LIMIT]
        due = self.every_steps and self.after_epoch.state.step % self.every_steps == 0
        if agreed[SIGTERM] or agreed[SIGUSR1]:
            interrupt.announce(signal.SIGUSR1 if agreed[SIGUSR1] else signal.SIGTERM)
        if stop or agreed[SAVE] or due:
            check_finite(sums, epoch, step)  # a checkpoint never holds weights a NaN has reached
            self.save(epoch, step, steps, sums)
        if stop:
            # A warning or the time limit ahead: stop to be requeued (exit 75); SIGTERM alone: as a SIGTERM.
            interrupt.stop_now(signal.SIGUSR1 if agreed[SIGUSR1] else None if agreed[TIME_LIMIT] else
                               signal.SIGTERM)

    @property
    def checkpointer(self) -> Checkpointer:
        return self.after_epoch.out.checkpointer

    def save(self, epoch: int, step: int, steps: int, sums: dict[str, torch.Tensor]) -> None:
        """The checkpoint after step `step` of the `steps` of `epoch` (a collective: every rank's sums and RNG
        states go in)."""
        began = time.perf_counter()
        state = self.after_epoch.state
        cfg = self.after_epoch.cfg
        position = {"epoch": epoch, "steps": step, "world_size": hvd_utils.world_size(),
                    "samples_per_rank": step * cast("Batching", self.after_epoch.trainer.batching).per_rank,
                    "workers": cfg.data.workers,
                    "seconds": time.perf_counter() - state.epoch_began,
                    "sums": hvd_utils.gather_objects({k: torch.as_tensor(v).tolist() for k, v in sums.items()},
                                                     "step_sums")}  # numbers, and lists for a tensor's sums
        payload = self.after_epoch.payload(partial=position)
        # Said by the checkpointer: where it writes (in the background) and, once the file is in place, "saved".
        what = f"checkpoint within epoch {epoch}, after step {step} of {steps} (step {state.step} of the run)"
        with interrupt.protected():
            hvd_utils.decide_on_root(lambda: self.checkpointer.save_step(payload, state.step, what=what),
                                     "step_checkpoint")
        state.saved_step(position)
        self.last = time.monotonic()
        self.times.seconds.append(time.perf_counter() - began)

    def close(self) -> None:
        """The loop has ended: the vote in flight is collected (every rank sent it)."""
        self.vote.drain()
