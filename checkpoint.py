"""Checkpoints: everything a run needs to continue exactly, written atomically by rank 0.

A checkpoint holds the model, optimizer, learning-rate schedule and AMP scaler states, the epoch and step, the best
metric so far, the resolved config, the per-epoch history and every rank's RNG states. Files in <dir>:
epoch_NNNN.pt (the newest keep_last), last.pt and best.pt. Loading uses torch.load(weights_only=True): a
checkpoint is data, and a file that would run code on loading is refused.
"""
import glob
import os
import random
import re
import shutil

import torch

VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or does not fit this run; the message names the file."""


def rng_state():
    """This process's random number generator states, in types torch.load(weights_only=True) accepts."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def atomic_save(obj, path):
    """Write to a temporary file in the same directory, flush it to disk, then rename over `path`: a reader, or a
    run killed halfway, sees the old file or the new one, never half of one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _link_or_copy(src, dst):
    """dst becomes the same content as src, atomically (a hard link costs no space; copy where links fail)."""
    tmp = f"{dst}.tmp.{os.getpid()}"
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def epoch_files(directory):
    """Per-epoch checkpoints in `directory`, oldest first."""
    files = glob.glob(os.path.join(directory, "epoch_*.pt"))
    return sorted(files, key=lambda p: int(re.search(r"epoch_(\d+)\.pt$", p).group(1)))


# What a run leaves in its output directory; a fresh run refuses to start over these unless told to.
RUN_FILES = ("checkpoints/last.pt", "summary.json", "metrics.jsonl")
REPLACED_ON_OVERWRITE = ("summary.json", "metrics.jsonl", "config.json", "curves.png", "tensorboard", "checkpoints")


def claim_output_dir(output_dir, resume, overwrite):
    """Decide how this run uses output_dir without losing an earlier run; returns the checkpoint to resume from,
    or None for a fresh start.

    A directory holding a run is continued (--resume), replaced (--overwrite), or refused with the choices named.
    """
    ckpt_dir = os.path.join(output_dir, "checkpoints")
    found = [f for f in RUN_FILES if os.path.exists(os.path.join(output_dir, f))]
    if resume:
        path = resolve(resume, ckpt_dir)
        if path is None and found:
            raise CheckpointError(f"--resume auto: {output_dir} holds a run ({', '.join(found)}) but no "
                                  f"checkpoints/last.pt to continue from; pass --overwrite to replace it, or choose "
                                  f"another --output-dir")
        return path
    if found and not overwrite:
        raise CheckpointError(f"{output_dir} already holds a run ({', '.join(found)}); continue it with --resume auto, "
                              f"replace it with --overwrite, or choose another --output-dir")
    if found:
        for name in REPLACED_ON_OVERWRITE:
            path = os.path.join(output_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    return None


class Checkpointer:
    """Writes checkpoints on rank 0 and keeps last.pt, best.pt and the newest keep_last per-epoch files."""

    def __init__(self, directory, keep_last=3, enabled=True):
        self.directory, self.keep_last, self.enabled = directory, keep_last, enabled
        if enabled:
            os.makedirs(directory, exist_ok=True)
            # Left by a writer that was killed mid-write; the files they were replacing are intact.
            for stale in glob.glob(os.path.join(directory, "*.tmp.*")):
                os.remove(stale)

    def save(self, payload, epoch, is_best):
        """Write epoch `epoch`; returns the path of last.pt (None on ranks that do not write)."""
        if not self.enabled:
            return None
        os.makedirs(self.directory, exist_ok=True)  # an elastic run's writer may change, and start late
        path = os.path.join(self.directory, f"epoch_{epoch:04d}.pt")
        atomic_save(payload, path)
        last = os.path.join(self.directory, "last.pt")
        _link_or_copy(path, last)
        if is_best:
            _link_or_copy(path, os.path.join(self.directory, "best.pt"))
        for old in epoch_files(self.directory)[:-self.keep_last or None]:
            os.remove(old)
        return last


def resolve(resume, directory):
    """The checkpoint file named by --resume: a path, or `auto` for <directory>/last.pt (None when there is none
    yet, so a job script can always pass --resume auto)."""
    if resume == "auto":
        last = os.path.join(directory, "last.pt")
        return last if os.path.isfile(last) else None
    if not os.path.isfile(resume):
        raise CheckpointError(f"--resume {resume}: no such file")
    return resume


def load(path):
    """Read a checkpoint safely (weights_only) and check it is one of ours."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, foreign pickle, not a torch file: all the same to the user
        first_line = (str(e).splitlines() or [""])[0][:200]
        raise CheckpointError(f"{path}: not a readable hvd-train checkpoint ({type(e).__name__}: {first_line})") \
            from None
    if not isinstance(ckpt, dict) or ckpt.get("version") != VERSION:
        raise CheckpointError(f"{path}: not an hvd-train checkpoint (version {VERSION} expected)")
    return ckpt
