"""What a run has done so far, and what happens after each epoch: the one owner of the history and the best metric.

RunState is written by AfterEpoch (and by a checkpoint when a run resumes), read by the checkpoint and by
summary.json; nothing else keeps a copy.
"""
import logging
from dataclasses import dataclass, field
from typing import Optional

import hvd_utils
from hvd_train.checkpoint import VERSION, Checkpointer
from hvd_train.metrics import improved, reached
from hvd_train.reporting import Reporter, seconds_since_start
from hvd_train.run_dir import RunDir

log = logging.getLogger("hvd_train")


@dataclass
class RunState:
    epoch: int = 0                       # the last epoch finished
    step: int = 0                        # optimizer steps done
    best_metric: Optional[float] = None  # the best value of the task's best_metric so far
    best_epoch: Optional[int] = None     # and the epoch that reached it
    history: list = field(default_factory=list)  # one record per epoch (as in metrics.jsonl)
    stopped_at: Optional[int] = None     # the epoch --stop-at ended the run at
    elastic: Optional[dict] = None       # an elastic run's resets and redone steps, for the summary

    CHECKPOINTED = ("epoch", "step", "best_metric", "best_epoch", "history")

    def load(self, meta):
        """Take the counters, best metric and history a checkpoint holds."""
        self.epoch, self.step = meta["epoch"], meta.get("step") or 0
        self.best_metric, self.best_epoch, self.history = meta["best_metric"], meta["best_epoch"], list(meta["history"])

    def checkpoint_fields(self):
        return {name: getattr(self, name) for name in self.CHECKPOINTED}

    def add(self, task, record):
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

    def _consider(self, task, record):
        better = improved(task, record[task.best_metric], self.best_metric)
        if better:
            self.best_metric, self.best_epoch = record[task.best_metric], record["epoch"]
        return better


@dataclass
class Outputs:
    """Where a run's results go: the run directory, rank 0's checkpointer and reporter (no-ops on the other ranks),
    and the fields a checkpoint must match to be loaded into this run (model_name, task, num_classes)."""
    run_dir: RunDir
    checkpointer: Checkpointer
    reporter: Reporter
    fits: dict


class AfterEpoch:
    """What follows each epoch on every rank: the run state, the reports, and the checkpoint (a collective).
    Called with the epoch's record; returns true when the --stop-at target is reached, which ends training."""

    def __init__(self, cfg, trainer, state, outputs):
        self.cfg, self.trainer, self.state, self.out = cfg, trainer, state, outputs

    def __call__(self, epoch, record):
        cfg, task = self.cfg, self.trainer.task
        record["wall_seconds"] = seconds_since_start()  # time to accuracy, counted from process start
        better = self.state.add(task, record)
        stop = reached(task, record[task.best_metric], cfg.run.stop_at)
        if stop:
            self.state.stopped_at = epoch
            log.info("--stop-at %g: %s reached %.4g at epoch %d; stopping", cfg.run.stop_at, task.best_metric,
                     record[task.best_metric], epoch)
        self.out.reporter.epoch(record)
        if epoch % cfg.checkpoint.every_epochs == 0 or epoch == cfg.optim.epochs or stop:
            self.save(epoch, better)
        return stop

    def save(self, epoch, is_best):
        t = self.trainer
        rng = hvd_utils.gather_rng_states()  # a collective: every rank, every checkpoint
        self.out.checkpointer.save({
            "version": VERSION, "model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(),
            "scaler": t.scaler.state_dict() if t.scaler else None, "config": self.cfg.to_dict(),
            "world_size": hvd_utils.world_size(), "rng": rng, **self.out.fits, **self.state.checkpoint_fields()},
            epoch, is_best=is_best)


def outputs_for(cfg, info, task, is_main, resume=False):
    """Outputs of a run of `task` on data `info`: rank 0 writes, the others' writers are off."""
    run_dir = RunDir(cfg.run.output_dir)
    return Outputs(run_dir, Checkpointer(run_dir.checkpoints, cfg.checkpoint.keep_last, enabled=is_main),
                   Reporter(run_dir.root, is_main, cfg.logging.tensorboard, resume=resume),
                   checkpoint_fits(cfg, info, task))


def checkpoint_fits(cfg, info, task):
    """The fields a checkpoint must have to be loaded into this run."""
    return {"model_name": cfg.model.name, "task": task.name, "num_classes": info.num_classes}


def resume(path, trainer, state, fits):
    """Continue from checkpoint `path`: weights, optimizer and scaler state on every rank, each rank's RNG states
    where the number of ranks is unchanged, and the run state (the learning rate follows from its epoch)."""
    meta = hvd_utils.load_checkpoint(path, trainer.model, fits, optimizer=trainer.optimizer)
    if trainer.scaler is not None and meta.get("scaler"):
        trainer.scaler.load_state_dict(meta["scaler"])
    hvd_utils.restore_rng(meta)
    state.load(meta)
