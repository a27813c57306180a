"""Validation: each rank evaluates its shard, and one allreduce of the metric sums gives every rank the exact global
figures, whatever the shards' sizes."""
import torch

import hvd_utils
from hvd_train.batches import autocast
from hvd_train.feed import Feed
from hvd_train.guards import watchdog
from hvd_train.run.best import averages


def add_sums(total, sums, device):
    """total += sums, per key, in float64 on the device: allocated at the first step, added in place after."""
    for key, value in sums.items():
        if key in total:
            total[key].add_(value)
        else:
            total[key] = torch.as_tensor(value, device=device, dtype=torch.float64).clone()


@torch.no_grad()
def evaluate(model, task, loader, feed, amp="off"):
    """Evaluate on this rank's shard; returns this rank's metric sums. feed: a hvd_train.feed.Feed, or the device
    for batches that only move there."""
    feed = as_feed(feed)
    model.eval()
    total = {}
    for batch in feed.batches(loader):
        watchdog.busy()  # validation shards differ in size, so these batches are not counted progress points
        with autocast(feed.device, amp):
            _, sums = task.step(model, batch)
        add_sums(total, sums, feed.device)
    return total


def evaluate_all(model, task, loader, feed, amp="off"):
    """Evaluate across all ranks: exact global metrics (one allreduce; a rank with no samples adds zeros)."""
    local = evaluate(model, task, loader, feed, amp)
    watchdog.tick()  # validation done
    return task.finish(averages(reduce_sums(task, local, name="val_sums")))


def as_feed(feed):
    return Feed(feed) if isinstance(feed, torch.device) else feed


def feed_of(trainer):
    """The trainer's feed; a plain move to its device where it has none (a Trainer built by hand)."""
    return trainer.feed if trainer.feed is not None else Feed(trainer.device)


def reduce_sums(task, local, name):
    """Sum a task's metric sums over all ranks; every key is sent even where this rank has none (zeros of the
    shape the sum has: every rank packs the same number of values)."""
    sent = {k: local[k] if k in local else torch.zeros(task.shapes.get(k, ()), dtype=torch.float64)
            for k in task.keys}
    total = hvd_utils.allreduce_sums(sent, name=name)
    return {k: total[k] for k in task.keys}  # in the task's order: records and log lines show them so
