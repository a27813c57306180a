"""The training and evaluation loops.

Each function takes what it uses as arguments and returns plain dicts. Per-step work stays on the device: loss terms
and counts are summed into tensors and read back once per epoch, when they are reduced across ranks in one
allreduce. The only other host syncs are every `log_every` steps, for the progress bar and the all-rank check for
a non-finite loss. Every rank runs the same collectives in the same order.
"""
import contextlib
import logging
import math
import sys
import time

import torch
from tqdm import tqdm

import hvd_utils
from config import LR_SCHEDULES
from tasks import averages

log = logging.getLogger("hvd_train")


class NonFiniteLossError(RuntimeError):
    """A loss was NaN or infinite on at least one rank; raised on every rank at the same step."""


# --------------------------------------------------------------------------------------------------------------------
# Optimizer and learning rate


def param_groups(model, weight_decay, decay_norm_and_bias=False):
    """Two groups: weights with weight decay; biases and normalization parameters (all 1-d tensors) without,
    since shrinking them toward zero only hurts (the usual practice since Goyal et al. 2017)."""
    if decay_norm_and_bias or weight_decay == 0:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model, optim_cfg, lr):
    """SGD (momentum, optionally Nesterov), Adam or AdamW at learning rate `lr` (already scaled)."""
    groups = param_groups(model, optim_cfg.weight_decay, optim_cfg.decay_norm_and_bias)
    if optim_cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=optim_cfg.momentum, nesterov=optim_cfg.nesterov)
    if optim_cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if optim_cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    raise ValueError(f"unknown optimizer {optim_cfg.optimizer!r}")


def lr_factor(step, steps_per_epoch, total_steps, schedule, warmup_epochs=0.0, warmup_start=1.0,
              milestones=(), gamma=0.1):
    """Multiplier of the scaled learning rate at optimizer step `step` (0-based).

    Warmup (Goyal et al. 2017) climbs linearly from `warmup_start` (1 / scale: the unscaled rate) to 1 over
    `warmup_epochs`; then `schedule` decays per step: cosine to 0 at the end, step by `gamma` at each epoch in
    `milestones`, exponential by `gamma` per epoch, or constant.
    """
    epoch = step / steps_per_epoch
    warmup_steps = warmup_epochs * steps_per_epoch
    if step < warmup_steps:
        return warmup_start + (1.0 - warmup_start) * step / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = (step - warmup_steps) / max(1.0, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    if schedule == "step":
        return gamma ** sum(1 for m in milestones if epoch >= m)
    if schedule == "exponential":
        return gamma ** epoch
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")


def set_lr_at(optimizer, optim_cfg, lr_scale, epochs_done):
    """Set the rate for a point in training measured in (fractional) epochs: elastic runs, whose steps per epoch
    change with the number of workers, follow the same schedule as fixed ones."""
    per_epoch = 1000  # resolution of the fractional epoch
    factor = lr_factor(epochs_done * per_epoch, per_epoch, optim_cfg.epochs * per_epoch, optim_cfg.lr_schedule,
                       optim_cfg.warmup_epochs, 1.0 / lr_scale, optim_cfg.lr_milestones, optim_cfg.lr_gamma)
    for group in optimizer.param_groups:
        group["lr"] = optim_cfg.lr * lr_scale * factor


def make_scheduler(optimizer, optim_cfg, steps_per_epoch, lr_scale):
    """A per-step LambdaLR following optim_cfg's schedule and warmup; call .step() after every optimizer step."""
    total = optim_cfg.epochs * steps_per_epoch

    def factor(step):
        return lr_factor(step, steps_per_epoch, total, optim_cfg.lr_schedule, optim_cfg.warmup_epochs,
                         1.0 / lr_scale, optim_cfg.lr_milestones, optim_cfg.lr_gamma)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --------------------------------------------------------------------------------------------------------------------
# Steps and epochs


def autocast(device, amp):
    """Mixed precision for the forward pass: bf16 (CPU and GPU) or fp16 (GPU); off gives a no-op context."""
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def train_step(model, task, optimizer, images, labels, *, accumulate=1, amp="off", scaler=None, clip_grad=0.0):
    """One optimizer step on one batch, split into `accumulate` backward passes; returns the batch's metric sums.

    Horovod's DistributedOptimizer allreduces each gradient after `accumulate` backward passes. The step then
    goes synchronize -> unscale/clip -> step without a second synchronize, so the scaler and the clipping see
    the averaged gradients, not this rank's.
    """
    optimizer.zero_grad()  # Horovod's wrapper takes no arguments; torch's default sets the gradients to None
    sums = {}
    n = labels.shape[0]
    for chunk_images, chunk_labels in zip(images.chunk(accumulate), labels.chunk(accumulate)):
        with autocast(images.device, amp):
            loss, outputs = task.losses(model, chunk_images, chunk_labels)
        # Weight each chunk by its share of the batch: the gradient is the batch mean, however it was split.
        weighted = loss * (chunk_labels.shape[0] / n) if accumulate > 1 else loss
        (scaler.scale(weighted) if scaler is not None else weighted).backward()
        for key, value in task.sums(loss, outputs, chunk_labels).items():
            sums[key] = sums[key] + value if key in sums else value

    def before_step():
        if scaler is not None:
            scaler.unscale_(optimizer)
        if clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)

    hvd_utils.apply_gradients(optimizer, (lambda: scaler.step(optimizer)) if scaler is not None else optimizer.step,
                              before_step)
    if scaler is not None:
        scaler.update()
    return sums


def _add(total, sums, device):
    """total += sums, per key, in float64 on the device: allocated at the first step, added in place after."""
    for key, value in sums.items():
        if key in total:
            total[key].add_(value)
        else:
            total[key] = torch.as_tensor(value, device=device, dtype=torch.float64).clone()


def train_one_epoch(model, task, loader, optimizer, scheduler, device, *, epoch=1, epochs=1, accumulate=1,
                    amp="off", scaler=None, clip_grad=0.0, log_every=20, show_progress=False, progress_every=60.0):
    """Train on this rank's shard for one epoch; returns this rank's metric sums as float64 tensors.

    Raises NonFiniteLossError on every rank when any rank saw a NaN or infinite loss (checked every log_every
    steps and at the end, with one tiny allreduce).
    """
    model.train()
    total = {}
    # On a terminal the bar redraws in place. In a log (horovodrun and mpirun pipe the output) every redraw is a
    # new line, so there it appears only for epochs longer than progress_every seconds, and updates that often.
    quiet = 0.0 if sys.stderr.isatty() else progress_every
    bar = tqdm(total=len(loader), desc=f"epoch {epoch}/{epochs}", unit="step", disable=not show_progress,
               dynamic_ncols=True, leave=False, delay=quiet, mininterval=max(0.1, quiet))
    start = time.perf_counter()
    for step, (images, labels) in enumerate(loader, 1):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        sums = train_step(model, task, optimizer, images, labels, accumulate=accumulate, amp=amp, scaler=scaler,
                          clip_grad=clip_grad)
        scheduler.step()
        _add(total, sums, device)
        bar.update(1)
        if step % log_every == 0 or step == len(loader):
            # The one host sync every log_every steps: all ranks learn whether any loss went non-finite. A NaN or
            # infinite loss leaves the running loss sum non-finite for good, so checking the sum covers every step.
            if hvd_utils.sum_across_ranks(~torch.isfinite(total["loss_sum"]), name="nonfinite") > 0:
                bar.close()
                raise NonFiniteLossError(f"the loss became NaN or infinite at epoch {epoch}, step {step} on at "
                                         f"least one rank; lower --lr, use --clip-grad, or check the data")
            seen = float(total["count"])
            bar.set_postfix(loss=f"{float(total['loss_sum']) / max(1.0, seen):.4f}",
                            lr=f"{optimizer.param_groups[0]['lr']:.3g}",
                            samples_s=f"{seen / (time.perf_counter() - start):.0f}", refresh=False)
    bar.close()
    return total


@torch.no_grad()
def evaluate(model, task, loader, device, amp="off"):
    """Evaluate on this rank's shard; returns this rank's metric sums."""
    model.eval()
    total = {}
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with autocast(device, amp):
            loss, outputs = task.losses(model, images, labels)
        _add(total, task.sums(loss, outputs, labels), device)
    return total


def evaluate_all(model, task, loader, device, amp="off"):
    """Evaluate across all ranks: exact global metrics (one allreduce; a rank with no samples adds zeros)."""
    return averages(reduce_sums(task, evaluate(model, task, loader, device, amp), name="val_sums"))


def reduce_sums(task, local, name):
    """Sum a task's metric sums over all ranks; every key is sent even where this rank has none."""
    zero = torch.zeros((), dtype=torch.float64)
    return hvd_utils.allreduce_sums({k: local.get(k, zero) for k in task.keys}, name=name)


def fit(model, task, optimizer, scheduler, train_loader, val_loader, train_sampler, device, *, epochs,
        start_epoch=1, accumulate=1, amp="off", scaler=None, clip_grad=0.0, log_every=20, show_progress=False,
        progress_every=60.0, on_epoch_end=None):
    """Train epochs start_epoch..epochs, validating after each; returns the per-epoch history.

    on_epoch_end(epoch, record) runs on every rank after each epoch (checkpoints, reports); when it returns true
    (a --stop-at target reached: the same on every rank, as the record is reduced) training ends there.
    """
    history = []
    for epoch in range(start_epoch, epochs + 1):
        # Horovod: a new shuffle every epoch, the same on every rank, so the shards stay disjoint.
        train_sampler.set_epoch(epoch)
        lr = optimizer.param_groups[0]["lr"]  # at the start of the epoch
        start = time.perf_counter()
        train_sums = train_one_epoch(model, task, train_loader, optimizer, scheduler, device, epoch=epoch,
                                     epochs=epochs, accumulate=accumulate, amp=amp, scaler=scaler,
                                     clip_grad=clip_grad, log_every=log_every, show_progress=show_progress,
                                     progress_every=progress_every)
        record, stop = close_epoch(model, task, train_sums, val_loader, device, amp, epoch, epochs, lr, start,
                                   on_epoch_end)
        history.append(record)
        if stop:
            break
    return history


def close_epoch(model, task, train_sums, val_loader, device, amp, epoch, epochs, lr, start, on_epoch_end):
    """After an epoch's steps, on every rank: reduce the training sums, agree on BatchNorm statistics, validate,
    log one line, hand the record to on_epoch_end(epoch, record) (checkpoints, reports); returns the record and
    whether on_epoch_end asked to stop."""
    train = averages(reduce_sums(task, train_sums, name="train_sums"))
    epoch_seconds = time.perf_counter() - start
    hvd_utils.average_buffers(model)  # BatchNorm statistics agree before validation and checkpoints
    val = evaluate_all(model, task, val_loader, device, amp)
    record = {"epoch": epoch, "lr": lr, "epoch_seconds": epoch_seconds,
              "samples_per_sec": train["count"] / epoch_seconds}
    record.update({f"train_{k}": v for k, v in train.items()})
    record.update({f"val_{k}": v for k, v in val.items()})
    log.info(format_record(record, epochs))
    stop = bool(on_epoch_end(epoch, record)) if on_epoch_end is not None else False
    return record, stop


class _EveryStep:
    """Something with a step() method, for train_one_epoch to call after each optimizer step."""

    def __init__(self, fn):
        self.step = fn


def fit_elastic(state, model, task, optimizer, train_loader, train_sampler, make_val_loader, device, *, optim_cfg,
                lr_scale_fn, commit_every, progress, accumulate=1, amp="off", scaler=None, clip_grad=0.0,
                log_every=20, show_progress=False, progress_every=60.0, on_epoch_end=None):
    """The training loop of an elastic run, to be wrapped in hvd_utils.elastic.run: re-entered after every reset
    from the last commit (state.epoch, state.batch and the sampler's position), with whatever workers remain.

    Commits every `commit_every` steps and after each epoch; `progress` (a dict) records the last step done, so a
    reset callback can tell how many steps were rolled back.
    """
    val_loader = make_val_loader()  # validation shards follow the current set of workers
    num_samples = len(train_sampler.dataset)
    while state.epoch <= optim_cfg.epochs:
        epoch = state.epoch

        def epochs_done():
            return epoch - 1 + min(1.0, train_sampler.processed_num / num_samples)

        def after_step():
            state.batch += 1
            state.steps += 1
            train_sampler.record_batch(state.batch, train_loader.batch_size)
            progress.update(epoch=epoch, batch=state.batch)
            set_lr_at(optimizer, optim_cfg, lr_scale_fn(), epochs_done())
            if state.batch % commit_every == 0:
                state.commit()  # also where a worker learns that hosts were added or removed

        set_lr_at(optimizer, optim_cfg, lr_scale_fn(), epochs_done())
        lr = optimizer.param_groups[0]["lr"]
        start = time.perf_counter()
        train_sums = train_one_epoch(model, task, train_loader, optimizer, _EveryStep(after_step), device,
                                     epoch=epoch, epochs=optim_cfg.epochs, accumulate=accumulate, amp=amp,
                                     scaler=scaler, clip_grad=clip_grad, log_every=log_every,
                                     show_progress=show_progress, progress_every=progress_every)
        # After a reset mid-epoch the training sums cover the steps since the reset; validation is always complete.
        _, stop = close_epoch(model, task, train_sums, val_loader, device, amp, epoch, optim_cfg.epochs, lr, start,
                              on_epoch_end)
        train_sampler.set_epoch(epoch + 1)  # Horovod's ElasticSampler: called at the end, it starts a new epoch
        state.batch, state.epoch = 0, (optim_cfg.epochs + 1 if stop else epoch + 1)
        state.commit()


def format_record(record, epochs):
    """One line per epoch: train and validation terms, top-1/top-5 where there are any, rate and time."""
    def term(name, value):
        return f"top-{name[3:]} {value:.2f}%" if name.startswith("acc") else f"{name} {value:.4f}"

    def terms(prefix):
        names = sorted((k[len(prefix):] for k in record if k.startswith(prefix) and not k.endswith("count")),
                       key=lambda name: (name.startswith("acc"), name != "loss", name))  # loss first, then terms
        return " ".join(term(name, record[prefix + name]) for name in names)

    return (f"epoch {record['epoch']}/{epochs}  train {terms('train_')}  val {terms('val_')}  "
            f"lr {record['lr']:.4g}  {record['samples_per_sec']:.0f} samples/s  {record['epoch_seconds']:.2f}s")
