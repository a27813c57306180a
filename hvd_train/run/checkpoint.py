"""Writing checkpoints: everything a run needs to continue exactly, written atomically by rank 0 (read back by
hvd_train/run/resume.py, the one reader).

A checkpoint holds the model, optimizer and AMP scaler states, the run state (epoch, optimizer steps, best metric,
per-epoch history), the resolved config and every rank's RNG states (torch's, CUDA's, Python's and NumPy's global
generator's); the learning rate follows from the epoch.
Files in <dir>: epoch_NNNN.pt (the newest keep_last), step_NNNNNNNN.pt (the newest checkpoint taken within an
epoch, named by the run's optimizer steps), last.pt and best.pt: the names here, the folder's in RunDir.
"""
import logging
import os
import random
import re
import shutil
import stat
import threading

import numpy as np
import torch

from hvd_train.errors import CheckpointError
from hvd_train.files import atomic_write, no_link_below, reported_write, temporary_beside
from hvd_train.guards import interrupt
from hvd_train.run.directory import BEST_CHECKPOINT, LAST_CHECKPOINT

log = logging.getLogger("hvd_train")
VERSION = 1


def seed_generators(seed):
    """Seed every generator a model, a task or a user's data set may draw from in this process: torch's (CUDA's
    too), Python's `random` and NumPy's global one (which takes 32 bits): the ones rng_state() saves."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state():
    """This process's random number generator states, in types torch.load(weights_only=True) accepts: NumPy's
    global generator's as its name, its key (a torch int64 tensor, not a NumPy array) and plain numbers."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"kind": str(kind), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    """The states rng_state() returned put back; a checkpoint written before NumPy's was saved leaves it as it
    is (seeded by --seed)."""
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(state["python"]))
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def atomic_save(obj, path):
    """torch.save through the run directory's atomic writer, flushed to disk."""
    atomic_write(path, lambda f: torch.save(obj, f), binary=True, sync=True)


def _link_or_copy(src, dst):
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


def numbered_files(directory, pattern=EPOCH_FILE):
    """The files in `directory` whose names `pattern` numbers, oldest first (any other file, say epoch_best.pt, is
    left be)."""
    if not os.path.isdir(directory):
        return []
    numbered = [(int(m.group(1)), name) for name in os.listdir(directory) if (m := pattern.fullmatch(name))]
    return [os.path.join(directory, name) for _, name in sorted(numbered)]


def epoch_files(directory):
    """Per-epoch checkpoints in `directory`, oldest first."""
    return numbered_files(directory, EPOCH_FILE)


def snapshot(obj, copy=True):
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

    def __init__(self, directory, keep_last=3, enabled=True, background=False):
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

    def save(self, payload, epoch, is_best, best_epochs=(), then=None):
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

    def save_step(self, payload, step, then=None, what=None):
        """Write a checkpoint taken within an epoch, after optimizer step `step` of the run, as step_NNNNNNNN.pt and
        last.pt; the older step file goes. `what`: how its lines name it (where in the epoch it was taken)."""
        if not self.enabled:
            return None
        return self._submit(lambda data: self._write(data, f"step_{step:08d}.pt"), payload, then,
                            what or f"checkpoint at step {step}", f"step_{step:08d}.pt", [LAST_CHECKPOINT])

    def failure(self):
        """The error of a background write that has failed (None while writing, or if none failed)."""
        if self.writer is not None and not self.writer.is_alive():
            self.writer = None
        return self.error

    def raise_failure(self):
        error, self.error = self.failure(), None
        if error is not None:
            raise error

    def settle(self):
        """Wait for the write under way, whatever becomes of it (a run that stops on another error)."""
        if self.writer is not None:
            self.writer.join()

    def wait(self):
        """Wait for the write under way; raise its error."""
        if self.writer is not None:
            self.writer.join()
            self.writer = None
        self.raise_failure()

    def _submit(self, write, payload, then, what, name, also):
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

        def run():
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

    def _write(self, payload, name):
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

    def _write_epoch(self, payload, epoch, is_best, best_epochs):
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
