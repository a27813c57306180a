"""Rank 0's progress through an epoch's steps: a tqdm bar where a person watches a terminal, whole lines in a log.

Under horovodrun and mpirun a rank's stderr is a pipe to the launcher even when the launcher writes to a terminal,
so the terminal is looked for at the launcher: the nearest launcher process above this one on this host. A bar's
carriage returns in a log file (SLURM, nohup, tee) would join every update and the next epoch's line into one
line; there, one whole line every --logging.progress_every seconds instead.
"""
import os
import sys
import time

from tqdm import tqdm

from hvd_train.errors import say

LAUNCHERS = ("horovodrun", "mpirun", "mpiexec", "orterun", "prterun", "orted", "prted", "srun", "slurmstepd")


def _is_terminal(pid, fd):
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}").startswith(("/dev/pts/", "/dev/tty"))
    except OSError:
        return False


def on_terminal():
    """Whether stderr reaches a terminal: this process's own, or that of the launcher that relays it. The first
    process above with a terminal decides: a launcher's is where this output goes; anyone else's (the shell that
    ran `horovodrun ... > log`) is not."""
    if sys.stderr.isatty():
        return True
    try:
        import psutil

        for parent in psutil.Process().parents()[:6]:
            if _is_terminal(parent.pid, 1) and _is_terminal(parent.pid, 2):
                # The launcher itself, or a helper it started (horovodrun's Gloo mode relays through one).
                commands = [parent.cmdline()] + ([parent.parent().cmdline()] if parent.parent() else [])
                return any(name in " ".join(command) for command in commands for name in LAUNCHERS)
    except Exception:  # a process that ended or cannot be read: take it for a log
        return False
    return False


class Progress:
    """update() after every step with the figures to show; close() at the end of the epoch."""

    def __init__(self, epoch, epochs, steps, enabled, every_s, terminal, done=0):
        """done: steps of the epoch trained before (a run resumed within it)."""
        self.label, self.steps, self.enabled, self.every_s = f"epoch {epoch}/{epochs}", steps, enabled, every_s
        self.bar = tqdm(total=steps, initial=done, desc=self.label, unit="step", dynamic_ncols=True, leave=False) \
            if enabled and terminal else None
        self.start = self.last = time.monotonic()
        self.step, self.figures = done, {}

    def update(self, step, **figures):
        """Step `step` is done; figures (loss, lr, ...) are the latest, or empty between the steps that have them."""
        self.step = step
        self.figures.update(figures)
        if self.bar is not None:
            self.bar.update(1)
            if figures:
                self.bar.set_postfix(self.figures, refresh=False)
        elif self.enabled and self.every_s and time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            shown = "  ".join(f"{k} {v}" for k, v in self.figures.items())
            say(f"{self.label}: step {step}/{self.steps} ({100 * step / max(1, self.steps):.0f}%), "
                f"{time.monotonic() - self.start:.0f}s  {shown}".rstrip())

    def close(self):
        if self.bar is not None:
            self.bar.close()
