"""A training step, an epoch, and the one training loop that every mode drives (validation: validation.py; the
loss's guards: guards/divergence.py; the epoch's record and line: epoch_line.py).

Per-step work stays on the device: loss terms and counts are summed into tensors and read back once per epoch, when
they are reduced across ranks in one allreduce. The only other host syncs are every `log_every` steps, for the
progress bar and the all-rank check for a non-finite loss. Every rank runs the same collectives in the same order.
fit() is the loop; a mode adds what it needs through Hooks (the sampler's epoch, the point of training that sets
the learning rate, per-step work such as an elastic commit, and what follows each epoch).
"""
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

import hvd_utils
from hvd_train.guards import watchdog
from hvd_train.guards.divergence import check_divergence, check_finite, first_loss
from hvd_train.run.best import averages
from hvd_train.progress import Progress, on_terminal
from hvd_train.batches import autocast, split_batch
from hvd_train.epoch_line import epoch_record, format_record
from hvd_train.validation import add_sums, evaluate_all, feed_of, reduce_sums
from hvd_train import timing

log = logging.getLogger("hvd_train")


@dataclass
class StepOptions:
    """How every step runs; read from the config once and passed down as one value."""
    accumulate: int = 1           # backward passes per optimizer step (horovod.batches_per_allreduce)
    amp: str = "off"              # autocast dtype: off, bf16 or fp16
    clip_grad: float = 0.0        # clip the averaged gradients' norm to this; 0: off
    log_every: int = 20           # steps between the non-finite check and progress-bar updates
    show_progress: bool = False   # this rank shows its progress
    progress_every: float = 60.0  # seconds between progress lines when stderr is not a terminal
    terminal: bool = False        # stderr reaches a terminal (directly or through the launcher): a bar
    divergence_factor: float = 100.0  # an epoch's train loss above this x the first step's stops the run; 0: off
    straggler_pct: float = 20.0   # a rank whose own work per step is this % above the median rank's is named

    @classmethod
    def from_config(cls, cfg, is_main):
        show = is_main and cfg.logging.progress
        return cls(cfg.horovod.batches_per_allreduce, cfg.optim.amp, cfg.optim.clip_grad, cfg.logging.log_every,
                   show, cfg.logging.progress_every, show and on_terminal(), cfg.run.divergence_factor,
                   cfg.logging.straggler_pct)


@dataclass
class Trainer:
    """What a step needs: the model and its task, the (Horovod-wrapped) optimizer and its learning-rate schedule,
    the AMP gradient scaler (fp16 only), the device, the step options and the number of epochs."""
    model: torch.nn.Module
    task: object
    optimizer: torch.optim.Optimizer
    schedule: object
    device: torch.device
    opts: StepOptions
    epochs: int = 1
    scaler: Optional[object] = None
    profiler: Optional[object] = None  # --profile: hvd_train.profiling.StepProfiler, told of every step
    ema: Optional[object] = None     # --model-ema: hvd_train.regularize.WeightAverage, updated after every step
    mixing: Optional[object] = None  # --mixup/--cutmix: hvd_train.regularize.Mixing, applied to every batch
    feed: Optional[object] = None    # hvd_train.feed.Feed: batches to the device, images normalized (None: moved)
    # hvd_train.schedule.Batching of the ranks it trains on, made once by training.trainer (an elastic run's when
    # the workers change): what the reports, the checkpoints within epochs and the benchmark read.
    batching: Optional[object] = None
    clock: timing.StepClock = timing.OFF  # where this rank's step time goes (OFF: nowhere)


class Hooks:
    """What a mode adds to fit(); these defaults suit a fixed set of ranks with a DistributedSampler. `saves`: the
    checkpoints taken between epoch ends (hvd_train/run/saves.py), told of every step."""

    def __init__(self, sampler=None, on_epoch_end=None, state=None, saves=None):
        self.sampler, self.on_epoch_end, self.state, self.saves = sampler, on_epoch_end, state, saves

    def epoch_start(self, epoch):
        if self.state is not None:
            self.state.begin_epoch(epoch)
        if self.sampler is not None:
            # Horovod: a new shuffle every epoch, the same on every rank, so the shards stay disjoint.
            self.sampler.set_epoch(epoch)

    def carried(self, epoch):
        """(steps of `epoch` trained before a checkpoint taken within it, this rank's metric sums of them): where a
        run resumed from that checkpoint continues the epoch; (0, {}) for an epoch started afresh."""
        if self.state is None:
            return 0, {}
        return self.state.carried(epoch, hvd_utils.rank(), hvd_utils.world_size())

    def carried_seconds(self, epoch):
        """Seconds spent on the steps carried() names (the epoch's time counts them)."""
        return self.state.carried_seconds(epoch) if self.state is not None else 0.0

    def position(self, epoch, step, steps):
        """Epochs done (fractional) before step `step` (0-based) of an epoch of `steps`: sets the rate."""
        return epoch - 1 + step / steps

    def after_step(self, epoch, step, steps, sums):
        """After optimizer step `step` of `steps` in `epoch` (`sums`: this rank's metric sums of the epoch so far):
        count it in the run state (checkpoints record it), then the step checkpoints' turn."""
        if self.state is not None:
            self.state.count_step()
        if self.saves is not None:
            self.saves.after_step(epoch, step, steps, sums)

    def steps_done(self):
        """An epoch's steps are done, before its validation and checkpoint."""
        if self.state is not None:
            self.state.note_training_memory()

    def epoch_end(self, epoch, record):
        """After every epoch, on every rank; true ends training there."""
        return bool(self.on_epoch_end(epoch, record)) if self.on_epoch_end is not None else False


# --------------------------------------------------------------------------------------------------------------------
# Steps and epochs


def train_step(trainer, batch):
    """One optimizer step on one batch, split into `accumulate` backward passes; returns the batch's metric sums.

    Horovod's DistributedOptimizer allreduces each gradient after `accumulate` backward passes. The step then
    goes synchronize -> unscale/clip -> step without a second synchronize, so the scaler and the clipping see
    the averaged gradients, not this rank's.
    """
    t, opts, clock = trainer, trainer.opts, trainer.clock
    t.optimizer.zero_grad()  # Horovod's wrapper takes no arguments; torch's default sets the gradients to None
    sums = {}
    n = t.task.samples(batch)
    for chunk in split_batch(batch, opts.accumulate) if opts.accumulate > 1 else [batch]:
        with autocast(t.device, opts.amp):
            loss, chunk_sums = t.task.step(t.model, chunk)
        # Weight each chunk by its share of the batch: the gradient is the batch mean, however it was split.
        weighted = loss * (chunk_sums["count"] / n) if opts.accumulate > 1 else loss
        (t.scaler.scale(weighted) if t.scaler is not None else weighted).backward()
        for key, value in chunk_sums.items():
            sums[key] = sums[key] + value if key in sums else value

    def before_step():
        clock.mark(timing.WAIT)  # Horovod handed back the averaged gradients (Adasum: this rank's own)
        if t.scaler is not None:
            hvd_utils.unscale_gradients(t.scaler, t.optimizer)
        if opts.clip_grad > 0:
            hvd_utils.clip_gradients(t.model, t.optimizer, opts.clip_grad)

    step = (lambda: t.scaler.step(t.optimizer)) if t.scaler is not None else t.optimizer.step
    watchdog.tick()  # backward done: what is left waits on the other ranks' gradients
    clock.mark(timing.COMPUTE)
    hvd_utils.apply_gradients(t.optimizer, step, before_step)
    if t.scaler is not None:
        t.scaler.update()
    if t.ema is not None:  # on every rank, from the same weights: the averages stay identical
        t.ema.update(t.model)
    clock.mark(timing.OPTIMIZER)
    return sums


def train_one_epoch(trainer, loader, epoch, hooks):
    """Train on this rank's shard for one epoch; returns this rank's metric sums as float64 tensors.

    Before each step the learning rate is set for hooks.position(); after it hooks.after_step() runs. Raises
    NonFiniteLossError on every rank when any rank saw a NaN or infinite loss (checked every log_every steps and
    at the end, with one tiny allreduce).
    """
    t, opts = trainer, trainer.opts
    t.model.train()
    # A run resumed from a checkpoint taken within this epoch continues after the steps it holds, with their sums.
    done, carried = hooks.carried(epoch)
    total = {key: torch.as_tensor(value, device=t.device, dtype=torch.float64) for key, value in carried.items()}
    steps = done + len(loader)
    # A bar where a person watches a terminal; whole lines every progress_every seconds in a log.
    progress = Progress(epoch, t.epochs, steps, opts.show_progress, opts.progress_every, opts.terminal, done)
    start, seen_before = time.perf_counter(), float(carried.get("count", 0.0))
    clock = t.clock
    clock.begin()
    for step, batch in enumerate(feed_of(t).batches(loader, epoch, done + 1), done + 1):
        watchdog.tick()  # a batch in hand
        clock.mark(timing.DATA)
        t.schedule.apply(t.optimizer, hooks.position(epoch, step - 1, steps))
        if t.mixing is not None:
            batch = t.mixing(batch, epoch, step)
        add_sums(total, train_step(t, batch), t.device)
        if step == 1 and epoch == 1 and hooks.state is not None:
            # Every rank reduces here (an elastic worker that joined in epoch 1 too); a value is kept only once.
            hooks.state.keep_first_loss(first_loss(total))
        if t.profiler is not None:
            t.profiler.step()
        figures = {}
        if step % opts.log_every == 0 or step == steps:
            # The one host sync every log_every steps: all ranks learn whether any loss went non-finite. A NaN or
            # infinite loss leaves the running loss sum non-finite for good, so checking the sum covers every step.
            check_finite(total, epoch, step, progress)
            seen = float(total["count"]) - seen_before
            figures = {"loss": f"{float(total['loss']) / max(1.0, seen):.4f}",
                       "lr": f"{t.optimizer.param_groups[0]['lr']:.3g}",
                       "samples_s": f"{seen / (time.perf_counter() - start):.0f}"}
        progress.update(step, **figures)
        hooks.after_step(epoch, step, steps, total)
        clock.step_done()
    progress.close()
    return total


def fit(trainer, train_loader, val_loader, hooks, first_epoch=1):
    """Train epochs first_epoch..trainer.epochs, validating after each; hooks.epoch_end(epoch, record) returning
    true (a --stop-at target reached: the same on every rank, as the record is reduced) ends training there.

    An elastic run re-enters it after every reset, at the epoch of its last commit: its sampler then yields only
    the samples that epoch has not processed yet.
    """
    for epoch in range(first_epoch, trainer.epochs + 1):
        hooks.epoch_start(epoch)
        # The rate of the epoch's first step, for its record (train_one_epoch sets it before every step).
        lr = trainer.schedule.lr(hooks.position(epoch, 0, max(1, len(train_loader))))
        start = time.perf_counter() - hooks.carried_seconds(epoch)
        train_sums = train_one_epoch(trainer, train_loader, epoch, hooks)
        hooks.steps_done()
        first = hooks.state.first_loss if hooks.state is not None else None
        record = close_epoch(trainer, train_sums, val_loader, EpochTiming(epoch, lr, start, first))
        if hooks.epoch_end(epoch, record):
            break


@dataclass
class EpochTiming:
    epoch: int
    lr: float      # the rate at the epoch's first step
    start: float   # time.perf_counter() when its first step began
    first_loss: Optional[float] = None  # the run's first step's loss, for the divergence check


def close_epoch(trainer, train_sums, val_loader, at):
    """After an epoch's steps, on every rank: reduce the training sums, agree on BatchNorm statistics, validate,
    log one line; returns the epoch's record. (After an elastic reset mid-epoch the training sums cover the steps
    since the reset; validation is always complete.)"""
    t = trainer
    train = t.task.finish(averages(reduce_sums(t.task, train_sums, name="train_sums")))
    check_divergence(train, at.epoch, at.first_loss, t.opts.divergence_factor)
    epoch_seconds = time.perf_counter() - at.start
    hvd_utils.average_buffers(t.model)  # BatchNorm statistics agree before validation and checkpoints
    val = evaluate_all(t.model, t.task, val_loader, feed_of(t), t.opts.amp)
    record = epoch_record(at.epoch, at.lr, epoch_seconds, train, val)
    lines = account_time(t, record)
    if t.ema is not None:  # the average, validated beside the weights (its statistics agree first, as theirs)
        hvd_utils.average_buffers(t.ema.module)
        ema = evaluate_all(t.ema.module, t.task, val_loader, feed_of(t), t.opts.amp)
        record.update({f"val_ema_{k}": v for k, v in ema.items()})
    log.info(format_record(at.epoch, t.epochs, train, val, record, t.task.shown, t.task.helpers))
    for line in lines:
        log.info(line)
    return record


def account_time(trainer, record):
    """Every rank's step time by phase (one small gather, on every rank), into the record; returns the lines rank 0
    adds to the epoch line: a straggler named, or the job found communication-bound."""
    if not trainer.clock.enabled:
        return []
    acc = timing.account(timing.gather(trainer.clock))
    record["timing"] = acc
    record.update(timing.figures(acc))
    line = timing.straggler(acc, trainer.opts.straggler_pct) or timing.comm_bound(acc)
    return [line] if line else []
