"""Checkpoints within epochs, and stops that save first: every N steps, every M minutes, on SIGUSR1 or SIGTERM, and
ahead of a SLURM job's time limit.

A checkpoint within an epoch holds what an epoch-end one does and where the epoch stands: its steps done, each rank's
metric sums of them and the time they took. `--resume auto` from it continues at the next step, bit for bit (the
loader skips the batches done without loading them; hvd_train/data).

Every rank must take such a checkpoint at the same step. A step count is the same everywhere; a clock, a signal that
reached some ranks, or rank 0's background writer failing are not, so each step every rank votes (hvd_utils.StepVote:
an asynchronous allreduce, read one step later) and all act on the same sums at the same step.
"""
import signal
import time
from dataclasses import dataclass, field

import torch

import hvd_utils
from hvd_train.guards.divergence import check_finite
from hvd_train.guards import interrupt

SAVE, SIGTERM, SIGUSR1, TIME_LIMIT, FAILED = range(5)  # what each rank raises in the step vote


@dataclass
class SaveTimes:
    """How long the training thread waited for each checkpoint taken within an epoch (the summary reports it)."""
    background: bool
    seconds: list = field(default_factory=list)

    def summary(self):
        s = self.seconds
        return {"count": len(s), "background": self.background, "mean_stall_s": sum(s) / len(s) if s else 0.0,
                "max_stall_s": max(s, default=0.0)}


class StepSaves:
    """Told of every optimizer step (engine Hooks.after_step); writes the checkpoints due within the epoch and stops
    the run, after one, when a signal or the time limit asks."""

    def __init__(self, cfg, after_epoch, deadline=None):
        c = cfg.checkpoint
        self.every_steps, self.every_s, self.deadline = c.every_steps, c.every_minutes * 60, deadline
        self.after_epoch = after_epoch  # its payload, the run state and rank 0's checkpointer
        self.vote = hvd_utils.StepVote("step_vote", 5)
        self.last = time.monotonic()
        self.times = SaveTimes(c.background)

    def after_step(self, epoch, step, steps, sums):
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
    def checkpointer(self):
        return self.after_epoch.out.checkpointer

    def save(self, epoch, step, steps, sums):
        """The checkpoint after step `step` of the `steps` of `epoch` (a collective: every rank's sums and RNG
        states go in)."""
        began = time.perf_counter()
        state = self.after_epoch.state
        cfg = self.after_epoch.cfg
        position = {"epoch": epoch, "steps": step, "world_size": hvd_utils.world_size(),
                    "samples_per_rank": step * self.after_epoch.trainer.batching.per_rank,
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

    def close(self):
        """The loop has ended: the vote in flight is collected (every rank sent it)."""
        self.vote.drain()
