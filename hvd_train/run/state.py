"""The run state: what a run has done so far (RunState, the one owner of the history and the best metric), and what
follows each epoch on every rank (AfterEpoch: the run state, the reports, the checkpoint).

RunState is written by AfterEpoch (and by a checkpoint when a run resumes: hvd_train/run/checkpoint.py), read by the
checkpoint and by summary.json; nothing else keeps a copy. The best metric and which weights reached it come from
the task's rules (hvd_train/tasks.py). Outputs gathers where a run's results go: the run directory, rank 0's
checkpointer and reporter, and the fields a checkpoint must match to be loaded into the run.
"""
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import psutil
import torch

import hvd_utils
from hvd_train.guards import interrupt
from hvd_train.run.checkpoint import VERSION, Checkpointer, checkpoint_fits, rng_state
from hvd_train.run.directory import RunDir
from hvd_train.run.model_card import card_for
from hvd_train.run.reports import Reporter, seconds_since_start
from hvd_train.tasks import candidate, improved, reached
from hvd_train.timing import compact, over_run

if TYPE_CHECKING:
    from hvd_train.config import Config
    from hvd_train.data import DataInfo
    from hvd_train.tasks import RunTask
    from hvd_train.trainer import Trainer

log = logging.getLogger("hvd_train")


@dataclass
class RunState:
    epoch: int = 0                       # the last epoch finished
    step: int = 0                        # optimizer steps done
    best_metric: Optional[float] = None  # the best value of the task's best_metric so far
    best_epoch: Optional[int] = None     # and the epoch that reached it
    best_weights: str = "model"          # which weights reached it: the model's, or their average's (--model-ema)
    history: list = field(default_factory=list)  # one record per epoch (as in metrics.jsonl)
    stopped_at: Optional[int] = None     # the epoch --stop-at ended the run at
    elastic: Optional[dict] = None       # an elastic run's resets and redone steps, for the summary
    wall_before: float = 0.0             # seconds the run had taken up to the checkpoint this process resumed
    resumes: list = field(default_factory=list)  # where the run was resumed: epoch, step, ranks, time
    saved_epoch: Optional[int] = None    # the epoch of the newest checkpoint (what --resume auto continues from)
    closed_epoch: int = 0                # the last epoch whose record (and checkpoint, where due) is written
    in_epoch: int = 0                    # the epoch being trained (once its first step is under way)
    epoch_first_step: int = 0            # the value of `step` when it began
    first_loss: Optional[float] = None   # the run's first step's loss (all ranks), what divergence is measured by
    tracking: dict = field(default_factory=dict)  # the experiment trackers' run ids (hvd_train/run/tracking.py)
    # A checkpoint taken within an epoch: {"epoch", "steps" (of it done), "world_size", "sums" (each rank's metric
    # sums of those steps), "seconds" (spent on them)}. `partial`: the one this process resumed from (where the
    # epoch continues); `saved_within`: the newest one this run wrote, or None when the newest is an epoch's end.
    partial: Optional[dict] = None
    saved_within: Optional[dict] = None
    epoch_began: float = 0.0             # time.perf_counter() at the start of the epoch in progress
    saves: Optional[dict] = None         # checkpoints within epochs: how many, and how long training waited
    training_rss: Optional[int] = None   # this process's resident bytes after its first epoch's steps
    # Every rank's step time over the epochs before the checkpoint this process resumed from (hvd_train/timing.py);
    # the epochs since are in the history's records.
    timing_before: Optional[dict] = None

    CHECKPOINTED = ("epoch", "step", "best_metric", "best_epoch", "best_weights", "history",
                    "resumes", "first_loss", "tracking")

    def load(self, meta: dict[str, Any]) -> None:
        """Take the counters, best metric, history and resume points a checkpoint holds."""
        self.epoch, self.step = meta["epoch"], meta.get("step") or 0
        self.best_metric, self.best_epoch, self.history = meta["best_metric"], meta["best_epoch"], list(meta["history"])
        self.best_weights = meta.get("best_weights") or "model"
        self.resumes = list(meta.get("resumes") or [])
        self.first_loss = meta.get("first_loss")
        self.tracking = dict(meta.get("tracking") or {})
        self.wall_before = meta.get("wall_seconds") or (self.history[-1].get("wall_seconds", 0.0) if self.history
                                                        else 0.0)
        self.saved_epoch = self.closed_epoch = self.epoch
        self.partial = self.saved_within = meta.get("partial")
        self.timing_before = meta.get("timing")

    def wall_seconds(self) -> float:
        """Seconds the whole run has taken: the parts before each resume, and this process since it started."""
        return self.wall_before + seconds_since_start()

    def where(self, epochs: int, last_checkpoint: str) -> str:
        """Where training stands, for the message of an interruption (read from another thread)."""
        # An epoch ends when its record and checkpoint are written: a signal that stops a rank before then (its
        # peer stopped first and ended their collective) leaves that epoch to be trained again.
        if self.in_epoch > self.closed_epoch:
            position = f"at epoch {self.in_epoch}/{epochs}, after {self.step - self.epoch_first_step} step(s) of it"
        else:
            position = f"at the end of epoch {self.closed_epoch}/{epochs}"
        if self.saved_within is not None:
            saved = self.saved_within
            return (f"{position}; --resume auto continues from {last_checkpoint} (epoch {saved['epoch']}, after step "
                    f"{saved['steps']} of it)")
        if self.saved_epoch is None:
            return f"{position}; no checkpoint was written yet, so --resume auto starts afresh"
        return f"{position}; --resume auto continues from {last_checkpoint} (the end of epoch {self.saved_epoch})"

    def carried(self, epoch: int, rank: int, world_size: int) -> tuple[int, dict[str, Any]]:
        """(steps of `epoch` done, this rank's metric sums of them) where this process resumed from a checkpoint
        taken within `epoch`, else (0, {}). On as many ranks as wrote it, each rank takes its own sums; on another
        number, rank 0 takes them all (the epoch's figures are sums over every rank, so they come out the same)."""
        p = self.partial
        if not p or p["epoch"] != epoch:
            return 0, {}
        if p["world_size"] == world_size:
            return p["steps"], dict(p["sums"][rank])
        if rank != 0:
            return p["steps"], {}
        return p["steps"], {key: sum(torch.as_tensor(s.get(key, 0.0), dtype=torch.float64) for s in p["sums"])
                            for key in p["sums"][0]}

    def carried_seconds(self, epoch: int) -> float:
        """Seconds spent on the steps of `epoch` that a checkpoint taken within it holds (0 for a fresh epoch)."""
        return self.partial["seconds"] if self.partial and self.partial["epoch"] == epoch else 0.0

    # Every change to the run state is one of these methods (or load and add): the loop, the modes and AfterEpoch
    # say what happened, and RunState alone writes its fields.
    def begin_epoch(self, epoch: int) -> None:
        self.in_epoch, self.epoch_first_step = epoch, self.step - self.carried(epoch, 0, 1)[0]
        self.epoch_began = time.perf_counter() - self.carried_seconds(epoch)  # its steps before a resume included

    def count_step(self) -> None:
        self.step += 1

    def set_steps(self, steps: int) -> None:
        """An elastic run's own count of optimizer steps, which survives its resets."""
        self.step = steps

    def keep_first_loss(self, loss: float) -> None:
        """The run's first step's loss (every rank's), kept once: the value divergence is measured against."""
        if self.first_loss is None:
            self.first_loss = loss

    def stop(self, epoch: int) -> None:
        self.stopped_at = epoch

    def closed(self, epoch: int, saved: bool) -> None:
        """Epoch `epoch`'s record is written, and its checkpoint where `saved`."""
        self.closed_epoch = epoch
        if saved:
            self.saved_epoch, self.saved_within = epoch, None

    def restart_epoch(self) -> None:
        """The epoch a checkpoint was taken within starts over (its loader cannot continue it)."""
        self.partial = None

    def set_saves(self, figures: dict[str, Any]) -> None:
        """The checkpoints taken within epochs and the training thread's wait for them, for the summary."""
        self.saves = figures

    def saved_step(self, position: dict[str, Any]) -> None:
        """A checkpoint within an epoch is written: `position` as `partial` describes it."""
        self.saved_within = position

    def note_training_memory(self) -> None:
        """An epoch's steps are done: this process's resident memory then, kept for the first such epoch (training's
        own, before any validation or checkpoint has added to it; freed memory is kept by malloc, so later it only
        grows)."""
        if self.training_rss is None:
            self.training_rss = psutil.Process().memory_info().rss

    def set_elastic(self, figures: dict[str, Any]) -> None:
        self.elastic = figures

    def resumed(self, checkpoint: str, world_size: int, previous_world_size: Optional[int]) -> None:
        """A resume point, for the summary: where the run continued from a checkpoint, on how many ranks."""
        self.resumes.append({"epoch": self.epoch, "step": self.step, "world_size": world_size,
                             "previous_world_size": previous_world_size, "checkpoint": checkpoint,
                             "time": time.time()})

    def tracked_as(self, ids: dict[str, str]) -> None:
        """The experiment trackers' run ids (hvd_train/run/tracking.py), which the checkpoints keep."""
        self.tracking.update(ids)

    def checkpoint_fields(self) -> dict[str, Any]:
        fields = {name: getattr(self, name) for name in self.CHECKPOINTED}
        # The records keep their epoch's slowest rank; every rank's figures, a list as long as the job is wide,
        # go into one account of the run, so a checkpoint grows with the epochs by a few values only.
        fields["history"] = [compact(record) for record in self.history]
        fields["timing"] = self.run_timing()
        return fields

    def run_timing(self) -> Optional[dict[str, Any]]:
        """Every rank's step time by phase over the whole run (resumes included), and the slowest rank."""
        accounts = [r["timing"] for r in self.history if "ranks" in r.get("timing", {})]
        return over_run([a for a in (self.timing_before, *accounts) if a])

    def add(self, task: "RunTask", record: dict[str, Any]) -> bool:
        """Record a finished epoch; returns whether it set a new best. An elastic reset rolls training back to its
        last commit, which may lie before the end of an epoch that was already closed: that epoch then ends again
        and replaces its first record (and the best metric, where that came from it)."""
        epoch = record["epoch"]
        if self.history and self.history[-1]["epoch"] >= epoch:
            self.history = [h for h in self.history if h["epoch"] < epoch]
            if self.best_epoch is not None and self.best_epoch >= epoch:
                self.best_metric = self.best_epoch = None
                for h in self.history:
                    self._consider(task, h)
        self.history.append(record)
        self.epoch = epoch
        return self._consider(task, record)

    def _consider(self, task: "RunTask", record: dict[str, Any]) -> bool:
        value, weights = candidate(task, record)
        better = improved(task, value, self.best_metric)
        if better:
            self.best_metric, self.best_epoch, self.best_weights = value, record["epoch"], weights
        return better

    def waited(self) -> int:
        """Epochs since the best one (for --patience)."""
        return self.epoch - self.best_epoch if self.best_epoch is not None else 0

    def best_epochs(self, task: "RunTask", count: int) -> list[int]:
        """The `count` best epochs of the history by the task's best metric, best first (--checkpoint-hist)."""
        ranked = sorted(self.history, key=lambda r: candidate(task, r)[0], reverse=task.best_mode == "max")
        return [r["epoch"] for r in ranked[:count]]


@dataclass
class Outputs:
    """Where a run's results go: the run directory, rank 0's checkpointer and reporter (no-ops on the other ranks),
    and the fields a checkpoint must match to be loaded into this run (model_name, task, num_classes)."""
    run_dir: RunDir
    checkpointer: Checkpointer
    reporter: Reporter
    fits: dict
    card: dict  # what rebuilds and feeds the model outside the app (hvd_train/run/model_card.py)


class AfterEpoch:
    """What follows each epoch on every rank: the run state, the reports, and the checkpoint (a collective).
    Called with the epoch's record; returns true when the --stop-at target is reached, which ends training."""

    def __init__(self, cfg: "Config", trainer: "Trainer", state: RunState, outputs: Outputs) -> None:
        self.cfg, self.trainer, self.state, self.out = cfg, trainer, state, outputs

    def __call__(self, epoch: int, record: dict[str, Any]) -> bool:
        # An epoch whose steps are done is closed whole: a Ctrl-C or SIGTERM from here on takes effect once its
        # record and checkpoint are written, so "at the end of epoch N" always names epoch N's checkpoint.
        with interrupt.protected():
            stop = self.close(epoch, record)
        interrupt.check()  # a signal that came meanwhile
        return stop

    def close(self, epoch: int, record: dict[str, Any]) -> bool:
        cfg, task = self.cfg, self.trainer.task
        # Time to accuracy, counted from the start of the first process of the run (resumes included).
        record["wall_seconds"] = self.state.wall_seconds()
        compression = hvd_utils.describe_compression(self.trainer.optimizer)
        if compression is not None:  # --powersgd-rank: bytes a plain average sends per byte sent (1 before start)
            record["compression_ratio"] = round(compression["ratio"], 2) if compression["compressing"] else 1.0
        better = self.state.add(task, record)
        value, weights = candidate(task, record)
        if self.trainer.ema is not None:
            record["weights"] = weights  # which weights this epoch's checkpoint offers predict and export
        stop = reached(task, value, cfg.run.stop_at)
        if stop:
            self.state.stop(epoch)
            log.info("--stop-at %g: %s reached %.4g at epoch %d; stopping", cfg.run.stop_at, task.best_metric,
                     value, epoch)
        elif cfg.run.patience and self.state.waited() >= cfg.run.patience:
            # The record is reduced over every rank, so every rank decides the same, at the same epoch.
            stop = True
            self.state.stop(epoch)
            log.info("--patience %d: %s has not improved for %d epochs (best %.4g at epoch %d); stopping",
                     cfg.run.patience, task.best_metric, self.state.waited(), self.state.best_metric,
                     self.state.best_epoch)
        due = epoch % cfg.checkpoint.every_epochs == 0 or epoch == cfg.optim.epochs or stop
        payload = self.payload(record.get("weights")) if due else None  # gathers every rank's RNG states: a
        # collective, on every rank
        # Rank 0 writes the checkpoint, then the epoch's record: a record never describes an epoch whose
        # checkpoint failed. Every rank learns how the writing went, so a full disk stops them all together (a
        # background write's failure is learned at a later step, at the next save or at the end).
        hvd_utils.decide_on_root(lambda: self.write(epoch, record, payload, better), "epoch_outputs")
        self.state.closed(epoch, saved=payload is not None)
        return stop

    def payload(self, weights: Optional[str] = None, partial: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """The checkpoint: everything to continue the run; under --model-ema also the average ("ema": its state
        with its update count) and which of the two this epoch's validation preferred ("weights"), which the
        card repeats for predict and export. partial: where the epoch stands, for a checkpoint taken within one
        (hvd_train/run/checkpoint.py)."""
        t = self.trainer
        rng = hvd_utils.gather_objects(rng_state(), "rng_states")  # every rank's, in rank order
        payload = {"version": VERSION, "model": t.model.state_dict(),
                   "optimizer": hvd_utils.checkpoint_state(t.optimizer),
                   "scaler": t.scaler.state_dict() if t.scaler else None, "config": self.cfg.to_dict(),
                   "world_size": hvd_utils.world_size(), "rng": rng, "wall_seconds": self.state.wall_seconds(),
                   "model_card": self.out.card, "partial": partial, **self.out.fits, **self.state.checkpoint_fields()}
        if t.ema is not None:
            payload.update(ema=t.ema.state_dict(), weights=weights or "model",
                           model_card={**self.out.card, "weights": weights or "model"})
        if partial is not None:  # within an epoch the ranks' BatchNorm statistics are each their own (a collective)
            payload["rank_buffers"] = {"model": hvd_utils.buffers_by_rank(t.model, "model_buffers"),
                                       "ema": hvd_utils.buffers_by_rank(t.ema.module, "ema_buffers")
                                       if t.ema is not None else []}
        return payload

    def write(self, epoch: int, record: dict[str, Any], payload: Optional[dict[str, Any]], is_best: bool) -> None:
        if payload is None:
            self.out.checkpointer.wait()  # an earlier epoch's record, which its checkpoint's writer adds, first
            self.out.reporter.epoch(record, committed=False)
            return
        hist = self.cfg.checkpoint.hist
        kept = self.state.best_epochs(self.trainer.task, hist) if hist > 1 else []
        self.out.checkpointer.save(payload, epoch, is_best=is_best, best_epochs=kept,
                                   then=lambda: self.out.reporter.epoch(record, committed=True))


def outputs_for(cfg: "Config", info: "DataInfo", task: "RunTask", is_main: bool, state: Optional[RunState] = None,
                run_dir: Optional[RunDir] = None) -> Outputs:
    """Outputs of a run of `task` on data `info` into run_dir (the output directory's): rank 0 writes, the others'
    writers are off. `state`: the run state of a resumed run, whose records the reporter keeps (and those after its
    checkpoint it drops)."""
    run_dir = run_dir or RunDir(cfg.run.output_dir)
    return Outputs(run_dir, Checkpointer(run_dir.checkpoints, cfg.checkpoint.keep_last, enabled=is_main,
                                         background=cfg.checkpoint.background),
                   Reporter(run_dir, is_main, cfg.logging.tensorboard,
                            resumed_history=state.history if state is not None and state.saved_epoch else None,
                            hidden=task.hidden()),
                   checkpoint_fits(cfg, info, task), card_for(cfg, info, task).to_dict())
