"""The training and evaluation loops.

Each function takes what it uses as arguments and returns plain dicts. Per-step work stays on the device: losses
and counts are summed into tensors and read back once per epoch, when they are reduced across ranks in one
allreduce (hvd_utils.allreduce_sums). Only `fit` talks to other ranks, and every rank runs the same collectives.
"""
import logging
import math
import time

import torch
import torch.nn.functional as F

import hvd_utils
from config import LR_SCHEDULES

log = logging.getLogger("hvd_train")


def train_step(model, optimizer, images, labels):
    """One optimizer step on one batch; returns the batch's mean loss and its logits, both detached."""
    optimizer.zero_grad()  # Horovod's wrapper takes no arguments; torch's default sets grads to None
    logits = model(images)
    loss = F.cross_entropy(logits, labels)
    loss.backward()  # Horovod: DistributedOptimizer starts the allreduce of each gradient as it is produced.
    optimizer.step()  # Horovod: waits for the averaged gradients, then applies them.
    return loss.detach(), logits.detach()


def lr_factor(step, total_steps, schedule):
    """Multiplier of the peak learning rate at optimizer step `step` (0-based) of `total_steps`."""
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        # Half a cosine from 1 to 0 over the run: large steps early, small ones that settle the weights at the end.
        return 0.5 * (1.0 + math.cos(math.pi * min(step, total_steps) / max(1, total_steps)))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")


def make_scheduler(optimizer, schedule, total_steps):
    """A per-step schedule: call .step() after every optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, schedule))


def _accumulate(sums, loss, logits, labels):
    n = labels.shape[0]
    sums["loss_sum"] += loss * n
    sums["correct1"] += (logits.argmax(dim=1) == labels).sum()
    k = min(5, logits.shape[1])
    sums["correct5"] += (logits.topk(k, dim=1).indices == labels.unsqueeze(1)).any(dim=1).sum()
    sums["count"] += n


def _zero_sums(device):
    keys = ("loss_sum", "correct1", "correct5", "count")
    return {k: torch.zeros((), dtype=torch.float64, device=device) for k in keys}


def train_one_epoch(model, loader, optimizer, scheduler, device):
    """Train on this rank's shard; returns this rank's sums (loss_sum, correct1, correct5, count) as tensors."""
    model.train()
    sums = _zero_sums(device)
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        loss, logits = train_step(model, optimizer, images, labels)
        scheduler.step()
        _accumulate(sums, loss, logits, labels)
    return sums


@torch.no_grad()
def evaluate(model, loader, device):
    """Evaluate on this rank's shard; returns this rank's sums (loss_sum, correct1, correct5, count)."""
    model.eval()
    sums = _zero_sums(device)
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        logits = model(images)
        loss = F.cross_entropy(logits, labels)
        _accumulate(sums, loss, logits, labels)
    return sums


def averages(totals):
    """Global sums -> mean loss and accuracies in percent. A rank that saw nothing still contributes its zeros."""
    count = totals["count"]
    if count == 0:
        return {"loss": float("nan"), "acc1": 0.0, "acc5": 0.0, "count": 0}
    return {
        "loss": totals["loss_sum"] / count,
        "acc1": 100.0 * totals["correct1"] / count,
        "acc5": 100.0 * totals["correct5"] / count,
        "count": int(count),
    }


def fit(model, optimizer, train_loader, val_loader, train_sampler, epochs, device, schedule="constant"):
    """Train for `epochs`, validating after each; returns the per-epoch history and the run's headline figures.

    The learning rate follows `schedule` per step from the optimizer's own (already scaled) rate.
    """
    scheduler = make_scheduler(optimizer, schedule, epochs * len(train_loader))
    history, best_acc1, train_seconds, train_samples = [], 0.0, 0.0, 0
    for epoch in range(1, epochs + 1):
        # Horovod: a new shuffle every epoch, the same on every rank, so the shards stay disjoint.
        train_sampler.set_epoch(epoch)
        lr = optimizer.param_groups[0]["lr"]  # at the start of the epoch
        start = time.perf_counter()
        train_sums = train_one_epoch(model, train_loader, optimizer, scheduler, device)
        train = averages(hvd_utils.allreduce_sums(train_sums, name="train_sums"))
        epoch_seconds = time.perf_counter() - start
        val = averages(hvd_utils.allreduce_sums(evaluate(model, val_loader, device), name="val_sums"))

        train_seconds += epoch_seconds
        train_samples += train["count"]
        best_acc1 = max(best_acc1, val["acc1"])
        record = {
            "epoch": epoch, "train_loss": train["loss"], "train_acc1": train["acc1"], "val_loss": val["loss"],
            "val_acc1": val["acc1"], "val_acc5": val["acc5"], "val_count": val["count"], "lr": lr,
            "samples_per_sec": train["count"] / epoch_seconds, "epoch_seconds": epoch_seconds,
        }
        history.append(record)
        log.info("epoch %d/%d  train loss %.4f acc %.2f%%  val loss %.4f top-1 %.2f%% top-5 %.2f%%  "
                 "lr %.4g  %.0f samples/s  %.2fs", epoch, epochs, train["loss"], train["acc1"], val["loss"],
                 val["acc1"], val["acc5"], lr, record["samples_per_sec"], epoch_seconds)
    return {
        "history": history,
        "best_val_acc1": best_acc1,
        "final_val_acc1": history[-1]["val_acc1"],
        "final_val_loss": history[-1]["val_loss"],
        "train_samples_per_sec": train_samples / train_seconds if train_seconds > 0 else 0.0,
    }
