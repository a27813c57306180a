"""Where each rank's step time goes, and which rank holds the job up.

Every training step is split into five phases at points it passes anyway:
  data            waiting for the loader's next batch (and the feed's copy and decode, which sit on that path)
  compute         forward and backward, until the last gradient is handed to Horovod
  allreduce_wait  waiting for Horovod's averaged gradients after backward (the synchronize)
  optimizer       unscaling, clipping, the optimizer's and the scaler's step, the weight average
  other           the rest of the step: metric sums, the progress line, checkpoints within the epoch
On the CPU each phase is a difference of host clock reads. On a GPU the host runs ahead of the device, so the host's
clock would put the device's compute into whatever waits for it first; there compute, allreduce_wait and optimizer
are read from CUDA events recorded on the step's stream and resolved once per epoch, when the epoch's metric sums
already wait for the device. No synchronization is added.

Once per epoch one collective gathers every rank's totals (five floats, a step count, its host name). In synchronous
data parallelism every rank waits for the slowest one in the allreduce, so the slow rank is the one that waits least:
its step time without its allreduce wait is the largest. That time, against the median rank's, names stragglers.
"""
import statistics
import time
from typing import Any, Iterable, Optional

import torch

from hvd_utils.comm import gather_objects
from hvd_utils.runtime import host_name

PHASES = ("data", "compute", "allreduce_wait", "optimizer", "other")
DATA, COMPUTE, WAIT, OPTIMIZER, OTHER = range(len(PHASES))
BUSY = ("data", "compute", "optimizer", "other")  # a step's own work: everything but waiting for the others
ON_DEVICE = (COMPUTE, WAIT, OPTIMIZER)  # read from CUDA events on a GPU

ADVICE = {
    "data": "the input pipeline of that rank: more --workers, --data.decode gpu for photos, or faster storage "
            "on its host",
    "compute": "the device of that rank: a throttled or slower GPU (nvidia-smi -q -d PERFORMANCE), or another "
               "job on its node",
    "optimizer": "the optimizer step of that rank: another job on its node, or a slower device",
    "other": "that rank's side work within steps: checkpoints within epochs, logging; rank 0 writes the run's files",
}
COMM_LEVERS = ("--bf16-allreduce (or --fp16-allreduce) to halve the bytes, --batches-per-allreduce N to allreduce "
               "every N batches, a larger --horovod.fusion_threshold_mb, or a larger --batch-size (docs/speed.md)")


class StepClock:
    """This rank's time per phase over one epoch's steps. mark(phase) gives the time since the previous mark to
    `phase`; begin() starts an epoch."""

    def __init__(self, device: Optional[torch.device] = None, enabled: bool = True) -> None:
        self.enabled = enabled
        self.cuda = enabled and device is not None and device.type == "cuda" and torch.cuda.is_available()
        self.begin()

    def begin(self) -> None:
        self.seconds = [0.0] * len(PHASES)
        self.steps = 0
        self.events: list[list] = []  # CUDA: per step, the events at a batch in hand and after each ON_DEVICE phase
        self.last = time.perf_counter()

    def mark(self, phase: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now
        if self.cuda and (phase == DATA or phase in ON_DEVICE):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            if phase == DATA:
                self.events.append([event])
            elif self.events:
                self.events[-1].append(event)

    def step_done(self) -> None:
        if self.enabled:
            self.mark(OTHER)
            self.steps += 1

    def totals(self) -> list[float]:
        """Seconds per phase over the epoch's steps so far (on a GPU, the device's share from its events)."""
        seconds = list(self.seconds)
        complete = [e for e in self.events if len(e) == 1 + len(ON_DEVICE)]
        if complete:
            complete[-1][-1].synchronize()  # already done: the epoch's sums were read back before this
            host = sum(seconds[p] for p in ON_DEVICE)
            for i, phase in enumerate(ON_DEVICE):
                seconds[phase] = sum(e[i].elapsed_time(e[i + 1]) for e in complete) / 1000.0
            # What the host spent between those marks beyond the device's time was the host's own: other.
            seconds[OTHER] += max(0.0, host - sum(seconds[p] for p in ON_DEVICE))
        return seconds


def gather(clock: StepClock) -> list[dict[str, Any]]:
    """Every rank's totals of the epoch (a collective: every rank calls it at the same point), as
    [{"rank", "host", <phase>: seconds per step, "steps"}] in rank order."""
    mine: dict[str, Any] = {"host": host_name(), "seconds": clock.totals(), "steps": clock.steps}
    ranks = []
    for rank, theirs in enumerate(gather_objects(mine, name="step_timing")):
        steps = max(1, theirs["steps"])
        ranks.append({"rank": rank, "host": theirs["host"],
                      **{p: s / steps for p, s in zip(PHASES, theirs["seconds"])}, "steps": theirs["steps"]})
    return ranks


def busy(rank: dict[str, Any]) -> float:
    """A rank's step time without its allreduce wait: its own work."""
    return sum(rank[p] for p in BUSY)


def slowest(acc: dict[str, Any]) -> dict[str, Any]:
    """The slowest rank's own entry of an account."""
    return next(r for r in acc["ranks"] if r["rank"] == acc["slowest"]["rank"])


def account(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """{"ranks": ranks, "slowest": {"rank", "host", "phase"}}: the rank whose own work per step is the largest,
    and its phase furthest above the median rank's."""
    slow = max(ranks, key=busy)
    median = {p: statistics.median(r[p] for r in ranks) for p in BUSY}
    phase = max(BUSY, key=lambda p: slow[p] - median[p])
    return {"ranks": ranks, "slowest": {"rank": slow["rank"], "host": slow["host"], "phase": phase}}


def over_run(accounts: Iterable[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The run's account from its epochs': each rank's seconds per step over all the steps it took."""
    by_rank: dict[int, dict[str, Any]] = {}
    for acc in accounts:
        for r in acc["ranks"]:
            mine = by_rank.setdefault(r["rank"], {"rank": r["rank"], "host": r["host"], "steps": 0,
                                                  **{p: 0.0 for p in PHASES}})
            for p in PHASES:
                mine[p] += r[p] * r["steps"]
            mine["steps"] += r["steps"]
            mine["host"] = r["host"]
    ranks = [by_rank[k] for k in sorted(by_rank)]
    for r in ranks:
        for p in PHASES:
            r[p] /= max(1, r["steps"])
    return account(ranks) if ranks else None


def compact(record: dict[str, Any]) -> dict[str, Any]:
    """An epoch's record as a checkpoint keeps it: its timing without the per-rank list (the slowest rank stays)."""
    if "ranks" not in record.get("timing", {}):
        return record
    return {**record, "timing": {"slowest": record["timing"]["slowest"]}}


def split(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """The mean share of each phase in a step over the ranks: {phase: fraction}."""
    shares = {p: 0.0 for p in PHASES}
    for r in ranks:
        total = sum(r[p] for p in PHASES) or 1.0
        for p in PHASES:
            shares[p] += r[p] / total / len(ranks)
    return shares


def split_line(ranks: list[dict[str, Any]]) -> str:
    """The epoch line's short split: data, compute, comm and the rest, in percent of a step (mean over ranks)."""
    s = split(ranks)
    return (f"data {s['data']:.0%} compute {s['compute']:.0%} comm {s['allreduce_wait']:.0%} "
            f"other {s['optimizer'] + s['other']:.0%}")


def figures(acc: dict[str, Any]) -> dict[str, float]:
    """Flat numbers for the trackers (MLflow, W&B, TensorBoard): the mean seconds per step of each phase and the
    slowest rank's own work per step."""
    ranks = acc["ranks"]
    out = {f"time_{p}": statistics.fmean(r[p] for r in ranks) for p in PHASES}
    slow = slowest(acc)
    out["time_slowest_rank"] = slow["rank"]
    out["time_slowest_busy"] = busy(slow)
    return out


def straggler(acc: dict[str, Any], pct: float) -> Optional[str]:
    """The line naming a rank whose own work per step is more than pct% above the median rank's; None if none
    is, or where there is one rank."""
    ranks = acc["ranks"]
    if len(ranks) < 2:
        return None
    median = statistics.median(busy(r) for r in ranks)
    slow = slowest(acc)
    if median <= 0 or busy(slow) <= median * (1 + pct / 100):
        return None
    phase = acc["slowest"]["phase"]
    typical = statistics.median(r[phase] for r in ranks if r is not slow)
    return (f"straggler: rank {slow['rank']} (host {slow['host']}) takes {busy(slow):.3f} s a step without its "
            f"allreduce wait, {busy(slow) / median - 1:.0%} above the median rank's {median:.3f} s, most of it in "
            f"{phase} ({slow[phase]:.3f} s against {typical:.3f} s on the other ranks); every other rank waits for "
            f"it in the allreduce (it waits least: {slow['allreduce_wait']:.3f} s). Look at {ADVICE[phase]}")


def comm_bound(acc: dict[str, Any]) -> Optional[str]:
    """The line saying the job is communication-bound: waiting for the allreduce is the largest phase on every
    rank; None otherwise."""
    ranks = acc["ranks"]
    if len(ranks) < 2 or not all(r["allreduce_wait"] >= max(r[p] for p in BUSY) for r in ranks):
        return None
    share = split(ranks)["allreduce_wait"]
    return (f"communication-bound: every rank spends most of its step waiting for the averaged gradients "
            f"({share:.0%} of a step on average), and no rank holds the others up. Levers: {COMM_LEVERS}")


OFF = StepClock(enabled=False)  # a Trainer built by hand, and --logging.step_timing false: nothing counted
