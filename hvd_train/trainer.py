"""The one room of the training loop: the Trainer, a step, an epoch, the loop fit_epochs(), and evaluation.

Also the loop's own parts: the batch's way to the model (Feed), the learning-rate schedule and the batch arithmetic
(LRSchedule, Batching), regularisation (Mixing, WeightAverage), an epoch's record and line, and rank 0's progress.
The loss's guards are in hvd_train/guards/divergence.py.

Per-step work stays on the device: loss terms and counts are summed into tensors and reduced across ranks once per
epoch, in one allreduce; validation's sums too, so every rank gets exact global figures whatever the shards' sizes.
The only other host syncs are every `log_every` steps: the progress figures and the all-rank check for a non-finite
loss, which stops every rank at the same point, before a checkpoint replaces a good one. Every rank runs the same
collectives in the same order. A mode adds what it needs to fit_epochs() through Hooks (the sampler's epoch, the
point of training that sets the learning rate, per-step work such as an elastic commit, what follows each epoch).

The loaders hand images over as uint8 (data/images.py, data/arrays.py): a quarter of float32's bytes through pinned
memory, and loader CPUs that decode rather than convert. Feed makes a uint8 (N, C, H, W) first item float32
(x / 255 - mean) / std on the device (the data set's preprocessing record; 0 and 1 where it has none), decodes photos
still encoded (--data.decode gpu) first, and only moves any other batch; on GPUs it prepares the next batch on a side
stream while the current step runs (as timm's PrefetchLoader does).

The learning rate is a function of how far training has come, in fractional epochs: epoch - 1 + step /
steps_per_epoch in a fixed run, epoch - 1 + samples processed / samples in the epoch in an elastic one (whose steps
per epoch change with the workers). Set before every optimizer step, the schedule holds whatever the number of ranks,
and a resumed run needs only its epoch.

Regularisation uses timm's own classes (RandomErasing, Mixup, ModelEmaV3). Erasing (--reprob) and mixup draw from
generators seeded by (seed, rank, epoch, step), not NumPy's global one: ranks and epochs differ, and a resumed run
draws as the run it continues did. The weights' average is updated after every step on every rank; its BatchNorm
buffers (each rank's from its own samples) are averaged over the ranks with the model's before each validation.

Progress: a tqdm bar where a person watches a terminal, found at the nearest launcher above this process (under
horovodrun and mpirun stderr is a pipe to it); in a log, whose carriage returns would join every update into one
line, a whole line every --logging.progress_every seconds.
"""
import collections
import contextlib
import itertools
import logging
import math
import os
import queue
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Collection, ContextManager, Iterable, Iterator, Optional, Sequence,
                    Union, cast)

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

import hvd_utils
from hvd_train import timing
from hvd_train.config import LR_SCHEDULES, AugConfig, HorovodConfig, LoggingConfig, OptimConfig, RunConfig
from hvd_train.data.augment import derived_seed
from hvd_train.data.images import EncodedBatch, crop_batch, decode_batch
from hvd_train.errors import say
from hvd_train.guards import watchdog
from hvd_train.guards.divergence import check_divergence, check_finite, first_loss
from hvd_train.tasks import averages, first_tensor, visible

if TYPE_CHECKING:
    from timm.data.random_erasing import RandomErasing

    from hvd_train.config import Config
    from hvd_train.data import DataInfo
    from hvd_train.data.shards import ShardLoader
    from hvd_train.profiling import StepProfiler
    from hvd_train.run.checkpoint import StepSaves
    from hvd_train.run.state import RunState
    from hvd_train.tasks import RunTask

log = logging.getLogger("hvd_train")


@dataclass
class StepOptions:
    """How every step runs: the config's own sections that a step reads (no copies of their fields: a setting
    reaches the step from its section, docs/architecture.md), and how this rank shows its progress."""
    optim: OptimConfig = field(default_factory=OptimConfig)        # amp, clip_grad
    horovod: HorovodConfig = field(default_factory=HorovodConfig)  # batches_per_allreduce: backward passes a step
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # log_every, progress_every, straggler_pct
    run: RunConfig = field(default_factory=RunConfig)              # divergence_factor
    show_progress: bool = False   # this rank shows its progress
    terminal: bool = False        # stderr reaches a terminal (directly or through the launcher): a bar

    @classmethod
    def from_config(cls, cfg: "Config", is_main: bool) -> "StepOptions":
        show = is_main and cfg.logging.progress
        return cls(optim=cfg.optim, horovod=cfg.horovod, logging=cfg.logging, run=cfg.run, show_progress=show,
                   terminal=show and on_terminal())


@dataclass
class Trainer:
    """What a step needs: the model and its task, the (Horovod-wrapped) optimizer and its learning-rate schedule,
    the AMP gradient scaler (fp16 only), the device, the step options and the number of epochs."""
    model: torch.nn.Module
    task: "RunTask"
    optimizer: torch.optim.Optimizer
    schedule: "LRSchedule"
    device: torch.device
    opts: StepOptions
    epochs: int = 1
    scaler: Optional[torch.amp.GradScaler] = None
    profiler: Optional["StepProfiler"] = None  # --profile: hvd_train.profiling.StepProfiler, told of every step
    ema: Optional["WeightAverage"] = None     # --model-ema: hvd_train.trainer.WeightAverage, updated after every step
    mixing: Optional["Mixing"] = None  # --mixup/--cutmix: hvd_train.trainer.Mixing, applied to every batch
    feed: Optional["Feed"] = None    # hvd_train.trainer.Feed: batches to the device, images normalized (None: moved)
    # hvd_train.trainer.Batching of the ranks it trains on, made once by training.trainer (an elastic run's when
    # the workers change): what the reports, the checkpoints within epochs and the benchmark read.
    batching: Optional["Batching"] = None
    clock: timing.StepClock = timing.OFF  # where this rank's step time goes (OFF: nowhere)

    def rescale(self, batching: "Batching", show_progress: bool) -> None:
        """Another number of ranks under it (an elastic run's workers changed): the batch arithmetic made for them,
        the schedule's rate scaled with it, and whether this rank now shows progress."""
        self.batching = batching
        self.schedule.lr_scale = batching.lr_scale
        self.opts.show_progress = show_progress


class Hooks:
    """What a mode adds to fit_epochs(); these defaults suit a fixed set of ranks with a DistributedSampler.
    `saves`: the checkpoints taken between epoch ends (hvd_train/run/checkpoint.py), told of every step."""

    def __init__(self, sampler: Optional[torch.utils.data.Sampler] = None,
                 on_epoch_end: Optional[Callable[[int, dict[str, Any]], Optional[bool]]] = None,
                 state: Optional["RunState"] = None, saves: Optional["StepSaves"] = None) -> None:
        self.sampler, self.on_epoch_end, self.state, self.saves = sampler, on_epoch_end, state, saves

    def epoch_start(self, epoch: int) -> None:
        if self.state is not None:
            self.state.begin_epoch(epoch)
        if self.sampler is not None:
            # Horovod: a new shuffle every epoch, the same on every rank, so the shards stay disjoint.
            self.sampler.set_epoch(epoch)

    def carried(self, epoch: int) -> tuple[int, dict[str, Any]]:
        """(steps of `epoch` trained before a checkpoint taken within it, this rank's metric sums of them): where a
        run resumed from that checkpoint continues the epoch; (0, {}) for an epoch started afresh."""
        if self.state is None:
            return 0, {}
        return self.state.carried(epoch, hvd_utils.rank(), hvd_utils.world_size())

    def carried_seconds(self, epoch: int) -> float:
        """Seconds spent on the steps carried() names (the epoch's time counts them)."""
        return self.state.carried_seconds(epoch) if self.state is not None else 0.0

    def position(self, epoch: int, step: int, steps: int) -> float:
        """Epochs done (fractional) before step `step` (0-based) of an epoch of `steps`: sets the rate."""
        return epoch - 1 + step / steps

    def after_step(self, epoch: int, step: int, steps: int, sums: dict[str, torch.Tensor]) -> None:
        """After optimizer step `step` of `steps` in `epoch` (`sums`: this rank's metric sums of the epoch so far):
        count it in the run state (checkpoints record it), then the step checkpoints' turn."""
        if self.state is not None:
            self.state.count_step()
        if self.saves is not None:
            self.saves.after_step(epoch, step, steps, sums)

    def steps_done(self) -> None:
        """An epoch's steps are done, before its validation and checkpoint."""
        if self.state is not None:
            self.state.note_training_memory()

    def epoch_end(self, epoch: int, record: dict[str, Any]) -> bool:
        """After every epoch, on every rank; true ends training there."""
        return bool(self.on_epoch_end(epoch, record)) if self.on_epoch_end is not None else False


# --------------------------------------------------------------------------------------------------------------------
# Steps and epochs


def train_step(trainer: Trainer, batch: Any) -> dict[str, Any]:
    """One optimizer step on one batch, split into horovod.batches_per_allreduce backward passes; returns the batch's
    metric sums.

    Horovod's DistributedOptimizer allreduces each gradient after that many backward passes. The step then
    goes synchronize -> unscale/clip -> step without a second synchronize, so the scaler and the clipping see
    the averaged gradients, not this rank's.
    """
    t, opts, clock = trainer, trainer.opts, trainer.clock
    accumulate = opts.horovod.batches_per_allreduce
    t.optimizer.zero_grad()  # Horovod's wrapper takes no arguments; torch's default sets the gradients to None
    sums: dict[str, Any] = {}
    n = t.task.samples(batch)
    for chunk in split_batch(batch, accumulate) if accumulate > 1 else [batch]:
        with autocast(t.device, opts.optim.amp):
            loss, chunk_sums = t.task.step(t.model, chunk)
        # Weight each chunk by its share of the batch: the gradient is the batch mean, however it was split.
        weighted = loss * (chunk_sums["count"] / n) if accumulate > 1 else loss
        (t.scaler.scale(weighted) if t.scaler is not None else weighted).backward()
        for key, value in chunk_sums.items():
            sums[key] = sums[key] + value if key in sums else value

    def before_step() -> None:
        clock.mark(timing.WAIT)  # Horovod handed back the averaged gradients (Adasum: this rank's own)
        if t.scaler is not None:
            hvd_utils.unscale_gradients(t.scaler, t.optimizer)
        if opts.optim.clip_grad > 0:
            hvd_utils.clip_gradients(t.model, t.optimizer, opts.optim.clip_grad)

    step = (lambda: cast("torch.amp.GradScaler", t.scaler).step(t.optimizer)) if t.scaler is not None \
        else t.optimizer.step
    watchdog.tick()  # backward done: what is left waits on the other ranks' gradients
    clock.mark(timing.COMPUTE)
    hvd_utils.apply_gradients(t.optimizer, step, before_step)
    if t.scaler is not None:
        t.scaler.update()
    if t.ema is not None:  # on every rank, from the same weights: the averages stay identical
        t.ema.update(t.model)
    clock.mark(timing.OPTIMIZER)
    return sums


def train_one_epoch(trainer: Trainer, loader: Union[torch.utils.data.DataLoader, "ShardLoader", Sequence[Any]],
                    epoch: int, hooks: Hooks) -> dict[str, torch.Tensor]:
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
    progress = Progress(epoch, t.epochs, steps, opts.show_progress, opts.logging.progress_every, opts.terminal, done)
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
        figures: dict[str, str] = {}
        if step % opts.logging.log_every == 0 or step == steps:
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


def fit_epochs(trainer: Trainer, train_loader: Union[torch.utils.data.DataLoader, "ShardLoader", Sequence[Any]],
               val_loader: Iterable[Any], hooks: Hooks, first_epoch: int = 1) -> None:
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


def close_epoch(trainer: Trainer, train_sums: dict[str, torch.Tensor], val_loader: Iterable[Any],
                at: EpochTiming) -> dict[str, Any]:
    """After an epoch's steps, on every rank: reduce the training sums, agree on BatchNorm statistics, validate,
    log one line; returns the epoch's record. (After an elastic reset mid-epoch the training sums cover the steps
    since the reset; validation is always complete.)"""
    t = trainer
    train = t.task.epoch_figures(averages(reduce_sums(t.task, train_sums, name="train_sums")))
    check_divergence(train, at.epoch, at.first_loss, t.opts.run.divergence_factor)
    epoch_seconds = time.perf_counter() - at.start
    hvd_utils.average_buffers(t.model)  # BatchNorm statistics agree before validation and checkpoints
    val = evaluate_all(t.model, t.task, val_loader, feed_of(t), t.opts.optim.amp)
    record = epoch_record(at.epoch, at.lr, epoch_seconds, train, val)
    lines = account_time(t, record)
    if t.ema is not None:  # the average, validated beside the weights (its statistics agree first, as theirs)
        hvd_utils.average_buffers(t.ema.module)
        ema = evaluate_all(t.ema.module, t.task, val_loader, feed_of(t), t.opts.optim.amp)
        record.update({f"val_ema_{k}": v for k, v in ema.items()})
    log.info(format_record(at.epoch, t.epochs, train, val, record, t.task.shown, t.task.helpers))
    for line in lines:
        log.info(line)
    return record


def account_time(trainer: Trainer, record: dict[str, Any]) -> list[str]:
    """Every rank's step time by phase (one small gather, on every rank), into the record; returns the lines rank 0
    adds to the epoch line: a straggler named, or the job found communication-bound."""
    if not trainer.clock.enabled:
        return []
    acc = timing.account(timing.gather(trainer.clock))
    record["timing"] = acc
    record.update(timing.figures(acc))
    line = timing.straggler(acc, trainer.opts.logging.straggler_pct) or timing.comm_bound(acc)
    return [line] if line else []


def autocast(device: torch.device, amp: str) -> ContextManager[Any]:
    """Mixed precision for the forward pass: bf16 (CPU and GPU) or fp16 (GPU); off gives a no-op context."""
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch's tensors on `device` (through tuples, lists and dicts); anything else as it is."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def split_batch(batch: Any, parts: int) -> list[Any]:
    """The batch cut into `parts` along its first dimension (fewer where it has fewer samples): each tensor is cut,
    tuples, lists and dicts keep their shape, anything else goes into every part."""
    first = first_tensor(batch)
    count = len(first.chunk(parts)) if first is not None else 1

    def part(x: Any, i: int) -> Any:
        if torch.is_tensor(x):
            return x.chunk(parts)[i] if x.dim() else x
        if isinstance(x, dict):
            return {key: part(value, i) for key, value in x.items()}
        if isinstance(x, (tuple, list)):
            return type(x)(part(value, i) for value in x)
        return x

    return [part(batch, i) for i in range(count)]


class Feed:
    """Batches from a loader as the model takes them. mean, std: the images' per-channel figures (None: 0 and 1);
    erasing: timm's RandomErasing for training batches, or None."""

    def __init__(self, device: torch.device, mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None, erasing: Optional["RandomErasing"] = None, seed: int = 0,
                 rank: int = 0) -> None:
        self.device, self.erasing, self.seed, self.rank = device, erasing, seed, rank
        self.said = False  # whether the log says yet where photos are decoded
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)

    @classmethod
    def of_run(cls, cfg: "Config", info: Optional["DataInfo"], device: torch.device, rank: int) -> "Feed":
        """The feed of a run: the data's preprocessing (mean, std) and --reprob."""
        return cls(device, *image_figures(info), erasing_of(cfg.aug, device), cfg.run.seed, rank)

    def __call__(self, batch: Any, key: Optional[tuple[int, int]] = None) -> Any:
        """One batch on the device, its images normalized; erased when `key` (epoch, step) names a training step."""
        images = _images(batch)
        return self.erased(self.prepare(batch), key) if images is not None else to_device(batch, self.device)

    def prepare(self, batch: Union[tuple[Any, ...], list[Any]]) -> Union[tuple[Any, ...], list[Any]]:
        """One batch of images on the device: decoded where they are still encoded, and normalized."""
        images = _images(batch)
        if isinstance(images, EncodedBatch):
            if not self.said:
                log.info("photos are decoded, cropped and flipped on %s, a batch at a time (--data.decode): the "
                         "loader workers read their bytes and draw their crops", self.device)
                self.said = True
            ready = self.normalize(crop_batch(images, decode_batch(images, self.device)), scale=255.0)
        else:
            ready = self.normalize(cast(torch.Tensor, images).to(self.device, non_blocking=True).float(), scale=255.0)
        return type(batch)([ready, *to_device(list(batch[1:]), self.device)])

    def erased(self, batch: Union[tuple[Any, ...], list[Any]],
               key: Optional[tuple[int, int]]) -> Union[tuple[Any, ...], list[Any]]:
        """A prepared batch of images, erased where `key` names a training step and --reprob is on."""
        if key is None or self.erasing is None:
            return batch
        return type(batch)([self.erase(batch[0], key), *batch[1:]])

    def normalize(self, images: torch.Tensor, scale: float) -> torch.Tensor:
        images = images.div_(scale)
        if self.mean is not None:
            images = images.sub_(self.mean).div_(self.std)
        return images

    def erase(self, images: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
        state = random.getstate()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                seed = derived_seed("erase", self.seed, self.rank, *key)
                random.seed(seed)
                torch.manual_seed(seed)
                return cast("RandomErasing", self.erasing)(images)
        finally:
            random.setstate(state)

    def batches(self, loader: Iterable[Any], epoch: Optional[int] = None, first_step: int = 1) -> Iterator[Any]:
        """The loader's batches ready for the model; `epoch` given: training's, numbered from first_step (the keys
        of their erasing). On a GPU each batch is copied and prepared on a side stream while the step before it
        runs. Photos still encoded (--data.decode gpu) are decoded on a thread of their own (ahead())."""
        keys = (None if epoch is None else (epoch, step) for step in _count(first_step))
        batches = iter(loader)
        first = next(batches, None)
        if first is None:
            return
        batches = itertools.chain([first], batches)
        if isinstance(_images(first), EncodedBatch):
            yield from self.ahead(batches, keys)
            return
        if self.device.type != "cuda":
            for batch, key in zip(batches, keys):
                yield self(batch, key)
            return
        stream, current = torch.cuda.Stream(device=self.device), torch.cuda.current_stream(self.device)
        ready = None
        for batch, key in zip(batches, keys):
            with torch.cuda.stream(stream):
                upcoming = self(batch, key)
            if ready is not None:
                yield ready
            current.wait_stream(stream)
            _record(upcoming, current)  # its memory stays the step's until the step is done with it
            ready = upcoming
        if ready is not None:
            yield ready

    def ahead(self, batches: Iterator[Any], keys: Iterable[Optional[tuple[int, int]]]) -> Iterator[Any]:
        """Encoded photos decoded, cropped and normalized on a thread of their own, AHEAD batches before the step
        that takes them, and erased here in step order. The loader is read on this thread, as always: a data set
        loaded in this process draws its crops here, and the decoding thread draws nothing.

        Why a thread: torchvision's decode on a GPU waits on the host for its decoder's stream, and on a GPU
        without a hardware JPEG decoder (the H100, H200 and A100 have one) decodes the Huffman stage on the CPU;
        both happen with the GIL released, so on a thread of its own they overlap the step's launches instead of
        holding them back. (Measured on an H200 with the flat byte transfer not yet in place, the thread alone
        did not change the training rate: docs/data.md.)"""
        todo: queue.Queue[Any]
        out: queue.Queue[Any]
        todo, out, stop = queue.Queue(), queue.Queue(), threading.Event()
        worker = threading.Thread(target=self._decode_ahead, args=(todo, out, stop), daemon=True,
                                  name="hvd-train-decode")
        worker.start()
        inflight: collections.deque[Optional[Exception]]
        inflight = collections.deque()  # per batch in order: None (with the thread), or the loader's error

        def submit() -> bool:
            try:
                batch = next(batches, _END)
            except Exception as e:  # raised in its place, after the batches before it
                inflight.append(e)
                return False
            if batch is _END:
                return False
            todo.put(batch)
            inflight.append(None)
            return True

        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        try:
            more = all(submit() for _ in range(AHEAD))
            for key in keys:
                if not inflight:
                    return
                error = inflight.popleft()
                if error is not None:
                    raise error
                item = out.get()
                more = more and submit()  # the thread decodes it while this step runs
                if isinstance(item, BaseException):
                    raise item
                batch, event = item
                if current is not None:
                    current.wait_event(event)
                    _record(batch, current)  # its memory stays the step's until the step is done with it
                yield self.erased(batch, key)
        finally:
            stop.set()  # what the thread holds is left unprepared
            todo.put(_END)
            worker.join()

    def _decode_ahead(self, todo: "queue.Queue[Any]", out: "queue.Queue[Any]", stop: threading.Event) -> None:
        """The decoding thread: each batch from `todo` prepared, on a side stream on a GPU with an event the step
        waits for, onto `out` (or the error it raised), until _END."""
        stream = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device and stream are each thread's own
            stream = torch.cuda.Stream(device=self.device)
        while True:
            batch = todo.get()
            if batch is _END or stop.is_set():
                return
            try:
                if stream is None:
                    out.put((self.prepare(batch), None))
                    continue
                with torch.cuda.stream(stream):
                    ready = self.prepare(batch)
                    event = torch.cuda.Event()
                    event.record(stream)
                out.put((ready, event))
            except BaseException as e:  # the training thread raises it, in its place among the batches
                out.put(e)


# Batches of encoded photos being prepared ahead of the step that takes them (Feed.ahead): two keep the decode
# busy while a step runs, and bound the memory they hold.
AHEAD = 2
_END = object()


def _images(batch: Any) -> Optional[Union[EncodedBatch, torch.Tensor]]:
    """The batch's images where the feed normalizes them (photos still encoded, or uint8 (N, C, H, W)); else None."""
    images: Any = batch[0] if isinstance(batch, (tuple, list)) and batch else None
    if isinstance(images, EncodedBatch):
        return images
    if torch.is_tensor(images) and images.dtype == torch.uint8 and images.dim() == 4:
        return images
    return None


def _count(start: int) -> Iterator[int]:
    while True:
        yield start
        start += 1


def _record(batch: Any, stream: torch.cuda.Stream) -> None:
    if torch.is_tensor(batch):
        batch.record_stream(stream)
    elif isinstance(batch, dict):
        for value in batch.values():
            _record(value, stream)
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            _record(value, stream)


def erasing_of(aug_cfg: AugConfig, device: torch.device) -> Optional["RandomErasing"]:
    """timm's RandomErasing for --reprob, on `device`; None where it is off."""
    if aug_cfg.no_aug or not aug_cfg.reprob:
        return None
    from timm.data.random_erasing import RandomErasing

    return RandomErasing(aug_cfg.reprob, mode=aug_cfg.remode, max_count=aug_cfg.recount, device=device)


def image_figures(info: Optional["DataInfo"]) -> tuple[Optional[tuple[float, ...]], Optional[tuple[float, ...]]]:
    """(mean, std) of the data's images from its preprocessing record; (None, None) where it has none."""
    pre = info.preprocessing if info is not None else None
    return (pre.mean, pre.std) if pre is not None else (None, None)


def add_sums(total: dict[str, torch.Tensor], sums: dict[str, Any], device: torch.device) -> None:
    """total += sums, per key, in float64 on the device: allocated at the first step, added in place after."""
    for key, value in sums.items():
        if key in total:
            total[key].add_(value)
        else:
            total[key] = torch.as_tensor(value, device=device, dtype=torch.float64).clone()


@torch.no_grad()
def evaluate(model: torch.nn.Module, task: "RunTask", loader: Iterable[Any], feed: Union["Feed", torch.device],
             amp: str = "off") -> dict[str, torch.Tensor]:
    """Evaluate on this rank's shard; returns this rank's metric sums. feed: a hvd_train.trainer.Feed, or the device
    for batches that only move there."""
    feed = as_feed(feed)
    model.eval()
    total: dict[str, torch.Tensor] = {}
    for batch in feed.batches(loader):
        watchdog.busy()  # validation shards differ in size, so these batches are not counted progress points
        with autocast(feed.device, amp):
            _, sums = task.step(model, batch)
        add_sums(total, sums, feed.device)
    return total


def evaluate_all(model: torch.nn.Module, task: "RunTask", loader: Iterable[Any], feed: Union["Feed", torch.device],
                 amp: str = "off") -> dict[str, Any]:
    """Evaluate across all ranks: exact global metrics (one allreduce; a rank with no samples adds zeros)."""
    local = evaluate(model, task, loader, feed, amp)
    watchdog.tick()  # validation done
    return task.epoch_figures(averages(reduce_sums(task, local, name="val_sums")))


def as_feed(feed: Union["Feed", torch.device]) -> "Feed":
    return Feed(feed) if isinstance(feed, torch.device) else feed


def feed_of(trainer: Trainer) -> "Feed":
    """The trainer's feed; a plain move to its device where it has none (a Trainer built by hand)."""
    return trainer.feed if trainer.feed is not None else Feed(trainer.device)


def reduce_sums(task: "RunTask", local: dict[str, torch.Tensor], name: str) -> dict[str, Any]:
    """Sum a task's metric sums over all ranks; every key is sent even where this rank has none (zeros of the
    shape the sum has: every rank packs the same number of values)."""
    sent = {k: local[k] if k in local else torch.zeros(task.shapes.get(k, ()), dtype=torch.float64)
            for k in task.keys}
    total = hvd_utils.allreduce_sums(sent, name=name)
    return {k: total[k] for k in task.keys}  # in the task's order: records and log lines show them so


@dataclass(frozen=True)
class Batching:
    """The batch arithmetic of a run on `ranks` ranks, made in one place: samples per rank per step (the batch x
    batches per allreduce), the global batch, and the learning rate's multiplier (the linear scaling rule; Adasum
    counts only the local accumulation) and the rate it gives."""
    per_rank: int
    ranks: int
    global_batch: int
    lr_scale: float
    lr: float


def batching(cfg: "Config", ranks: int) -> Batching:
    accumulate = cfg.horovod.batches_per_allreduce
    scale = hvd_utils.lr_scale(ranks, accumulate, cfg.horovod.use_adasum)
    per_rank = cfg.optim.batch_size * accumulate
    return Batching(per_rank, ranks, per_rank * ranks, scale, cfg.optim.lr * scale)


def lr_factor(epochs_done: float, epochs: int, schedule: str, warmup_epochs: float = 0.0, warmup_start: float = 1.0,
              milestones: Sequence[int] = (), gamma: float = 0.1) -> float:
    """Multiplier of the scaled learning rate after `epochs_done` (fractional) of `epochs`.

    Warmup (Goyal et al. 2017) climbs linearly from `warmup_start` (1 / scale: the unscaled rate) to 1 over
    `warmup_epochs`; then `schedule` decays: cosine to 0 at the end, step by `gamma` at each epoch in `milestones`,
    exponential by `gamma` per epoch, or constant.
    """
    if epochs_done < warmup_epochs:
        return warmup_start + (1.0 - warmup_start) * epochs_done / warmup_epochs
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = (epochs_done - warmup_epochs) / max(1e-9, epochs - warmup_epochs)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    if schedule in ("step", "multistep"):
        return gamma ** sum(1 for m in milestones if epochs_done >= m)
    if schedule == "exponential":
        return gamma ** epochs_done
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")


class LRSchedule:
    """optim_cfg's schedule at the rate scaled by `lr_scale` (ranks x batches per allreduce; an elastic run
    updates it when the workers change)."""

    def __init__(self, optim_cfg: "OptimConfig", lr_scale: float) -> None:
        self.cfg, self.lr_scale = optim_cfg, lr_scale

    def lr(self, epochs_done: float, planned_epochs: Optional[int] = None) -> float:
        """The rate after `epochs_done` (fractional) epochs of a run of optim_cfg.epochs epochs, or of
        `planned_epochs` (what a resumed checkpoint's run planned)."""
        c = self.cfg
        factor = lr_factor(epochs_done, planned_epochs or c.epochs, c.lr_schedule, c.warmup_epochs, 1.0 / self.lr_scale,
                           c.lr_milestones, c.lr_gamma)
        return c.lr * self.lr_scale * factor

    def apply(self, optimizer: torch.optim.Optimizer, epochs_done: float) -> float:
        """Set the rate for this point of training on every parameter group; returns it."""
        lr = self.lr(epochs_done)
        for group in optimizer.param_groups:
            # timm's layer-wise decay (--layer-decay) gives each group its share of the rate.
            group["lr"] = lr * group.get("lr_scale", 1.0)
        return lr


class Mixing:
    """timm's Mixup (mixup and/or CutMix, with label smoothing) on a batch (images, labels) -> (mixed images,
    labels, soft targets): the task learns from the soft targets and counts its accuracy against the labels."""

    def __init__(self, aug_cfg: AugConfig, num_classes: int, seed: int, rank: int) -> None:
        from timm.data import Mixup
        from timm.data.mixup import mixup_target

        self.mixup = Mixup(mixup_alpha=aug_cfg.mixup, cutmix_alpha=aug_cfg.cutmix, prob=aug_cfg.mixup_prob,
                           switch_prob=aug_cfg.mixup_switch_prob, mode=aug_cfg.mixup_mode,
                           label_smoothing=aug_cfg.smoothing, num_classes=num_classes)
        self.off_epoch, self.seed, self.rank = aug_cfg.mixup_off_epoch, seed, rank
        self.smoothing, self.num_classes = aug_cfg.smoothing, num_classes
        self.one_hot = mixup_target  # (labels, classes, weight 1, smoothing): an unmixed sample's target

    def __call__(self, batch: Sequence[torch.Tensor], epoch: int,
                 step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        images, labels = batch[0], batch[1]
        # timm's batch and pair modes pair each sample with its mirror in the batch: an odd last sample is left
        # unmixed, with its (smoothed) one-hot target.
        even = images.shape[0] - images.shape[0] % 2
        self.mixup.mixup_enabled = not (self.off_epoch and epoch >= self.off_epoch)
        state = np.random.get_state()
        try:
            np.random.seed(derived_seed("mix", self.seed, self.rank, epoch, step, size=4))
            mixed, targets = self.mixup(images[:even].clone(), labels[:even]) if even else (images[:0], None)
        finally:
            np.random.set_state(state)
        if even < images.shape[0]:
            rest = self.one_hot(labels[even:], self.num_classes, 1.0, self.smoothing)
            mixed = torch.cat([mixed, images[even:]])
            targets = rest if targets is None else torch.cat([targets, rest])
        return (mixed, labels, targets)


class WeightAverage(nn.Module):
    """The exponential moving average of a model's weights (timm's ModelEmaV3) and the count of its updates, which
    sets the warmup of the decay and is saved with it: a module, so checkpoints and Horovod's elastic state carry
    both as one state_dict."""

    def __init__(self, model: torch.nn.Module, decay: float, warmup: bool = False) -> None:
        super().__init__()
        from timm.utils import ModelEmaV3

        self.average = ModelEmaV3(model, decay=decay, use_warmup=warmup)
        # A model compiled in place (--compile) is copied with its compiled forward, which calls the original
        # module: the average runs eagerly (it is only evaluated once per epoch).
        for module in self.average.module.modules():
            if getattr(module, "_compiled_call_impl", None) is not None:
                module._compiled_call_impl = None
        # On the CPU whatever the model's device (this module is never moved): reading it costs no device sync.
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))

    @property
    def module(self) -> torch.nn.Module:
        """The averaged model."""
        return self.average.module

    @torch.no_grad()
    def restart(self, model: torch.nn.Module) -> None:
        """Average from `model`'s weights as they are now (after the broadcast from rank 0, or --init-from)."""
        self.average.module.load_state_dict(model.state_dict())
        self.updates.zero_()

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        self.updates += 1
        self.average.update(model, step=int(self.updates))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def weight_average(cfg: "Config", model: torch.nn.Module) -> Optional[WeightAverage]:
    """--model-ema: the average of `model`'s weights, or None."""
    if not cfg.model.ema:
        return None
    return WeightAverage(model, cfg.model.ema_decay, cfg.model.ema_warmup)


def epoch_record(epoch: int, lr: float, epoch_seconds: float, train: dict[str, Any],
                 val: dict[str, Any]) -> dict[str, Any]:
    """The flat record written to metrics.jsonl, the history and TensorBoard: train_* and val_* terms."""
    record = {"epoch": epoch, "lr": lr, "epoch_seconds": epoch_seconds,
              "samples_per_sec": train["count"] / epoch_seconds}
    record.update({f"train_{k}": v for k, v in train.items()})
    record.update({f"val_{k}": v for k, v in val.items()})
    return record


def format_record(epoch: int, epochs: int, train: dict[str, Any], val: dict[str, Any], record: dict[str, Any],
                  shown: Optional[dict[str, str]] = None, helpers: Collection[str] = ()) -> str:
    """One line per epoch: train and validation terms and metrics as the task names them (shown: {metric: label}
    for those it shows in percent, as classification's top-1 and top-5), rate and time. Helpers and metrics that
    are tensors (lists in the record) are left for metrics.jsonl."""
    shown = shown or {}

    def terms(metrics: dict[str, Any]) -> str:
        # The task's order: loss, its terms, its metrics, its derived figures.
        names = [k for k in visible(metrics, helpers) if k != "count"]
        return " ".join(f"{shown[k]} {metrics[k]:.2f}%" if k in shown else f"{k} {metrics[k]:.4f}" for k in names)

    ema = {k[8:]: v for k, v in record.items() if k.startswith("val_ema_")}
    averaged = f"  val(ema) {terms(ema)}" if ema else ""
    split = f"  {timing.split_line(record['timing']['ranks'])}" if "timing" in record else ""
    return (f"epoch {epoch}/{epochs}  train {terms(train)}  val {terms(val)}{averaged}  lr {record['lr']:.4g}  "
            f"{record['samples_per_sec']:.0f} samples/s  {record['epoch_seconds']:.2f}s{split}")


LAUNCHERS = ("horovodrun", "mpirun", "mpiexec", "orterun", "prterun", "orted", "prted", "srun", "slurmstepd")


def _is_terminal(pid: int, fd: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}").startswith(("/dev/pts/", "/dev/tty"))
    except OSError:
        return False


def on_terminal() -> bool:
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

    def __init__(self, epoch: int, epochs: int, steps: int, enabled: bool, every_s: float, terminal: bool,
                 done: int = 0) -> None:
        """done: steps of the epoch trained before (a run resumed within it)."""
        self.label, self.steps, self.enabled, self.every_s = f"epoch {epoch}/{epochs}", steps, enabled, every_s
        self.bar = tqdm(total=steps, initial=done, desc=self.label, unit="step", dynamic_ncols=True, leave=False) \
            if enabled and terminal else None
        self.start = self.last = time.monotonic()
        self.figures: dict[str, str]
        self.step, self.figures = done, {}

    def update(self, step: int, **figures: str) -> None:
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

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
