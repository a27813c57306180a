"""What rank 0 reports while training and at its end: metrics as JSON lines and TensorBoard events, then
summary.json and a PNG of the curves (the setup lines before training: setup_lines.py).

Reporter's methods are no-ops on the other ranks, so callers need no `if rank == 0`.
"""
import json
import logging
import math
import os
import secrets
import time

import psutil

import hvd_utils
from hvd_train.run.best import visible
from hvd_train.files import append_line, atomic_write, no_link_below, reported_write, write_json
from hvd_train.run.setup_lines import describe_augmentation

log = logging.getLogger("hvd_train")


class Reporter:
    """resumed_history: the records of the checkpoint a run resumes from. metrics.jsonl is rewritten to hold
    exactly those (records of epochs after the checkpoint were lost with the run that wrote them, and are trained
    again), and TensorBoard hides its points after that epoch (purge_step), so each epoch has one record.
    hidden: the record keys of the task's helpers, which only metrics.jsonl shows (RunTask.hidden)."""

    def __init__(self, run_dir, enabled, tensorboard=True, resumed_history=None, hidden=frozenset()):
        self.dir, self.enabled, self.tensorboard, self.writer = run_dir, False, tensorboard, None
        self.hidden = frozenset(hidden)
        self.jsonl = self.dir.metrics
        self.purge_step, self.trackers = None, []
        if enabled and resumed_history:
            with reported_write(self.jsonl):
                atomic_write(self.jsonl, lambda f: f.writelines(_line(r) for r in resumed_history),
                             root=self.dir.root)
            self.purge_step = resumed_history[-1]["epoch"] + 1
        elif enabled and os.path.lexists(self.jsonl):
            os.remove(self.jsonl)  # a fresh run starts a fresh record (a link planted there goes, not its target)
        self.set_enabled(enabled)

    def set_enabled(self, enabled):
        """Start or stop writing (in an elastic run the writing rank can change after a reset)."""
        if enabled and not self.enabled:
            os.makedirs(self.dir.root, exist_ok=True)
            if self.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                # A suffix no one can guess: TensorBoard names its event files by time, host and pid, which a
                # run directory prepared by someone else could hold links for; and tensorboard/ itself is no link.
                no_link_below(self.dir.root, self.dir.tensorboard)
                self.writer = SummaryWriter(self.dir.tensorboard, purge_step=self.purge_step,
                                            filename_suffix=f".{secrets.token_hex(8)}")
                self.purge_step = None  # once: a writer started later (elastic) must not hide newer points
        elif not enabled:
            self.close()
        self.enabled = enabled

    def track(self, trackers):
        """Experiment trackers (hvd_train/run/tracking.py) that get each epoch's record and, at the end, the summary."""
        self.trackers = list(trackers)

    def epoch(self, record, committed=True):
        """`committed`: the checkpoint that holds this epoch is written (trackers send committed records only)."""
        if not self.enabled:
            return
        figures = visible(record, self.hidden)
        for tracker in self.trackers:
            tracker.epoch(figures, committed)
        with reported_write(self.jsonl):
            append_line(self.jsonl, _line(record), root=self.dir.root)
        if self.writer is not None:
            for key, value in figures.items():
                if key != "epoch" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key.replace("_", "/", 1), value, record["epoch"])
            self.writer.flush()

    def plot(self, history):
        """Loss curves, and the validation metrics and loss terms where the task has any, per epoch, to
        curves.png; returns its path."""
        if not self.enabled or not history:
            return None
        history = [visible(r, self.hidden) for r in history]
        path = self.dir.curves
        import matplotlib

        matplotlib.use("Agg")  # no display on cluster nodes
        import matplotlib.pyplot as plt

        epochs = [r["epoch"] for r in history]
        accs = [k for k in history[0] if k.startswith("val_") and k not in ("val_loss", "val_count")]
        fig, axes = plt.subplots(1, 2 if accs else 1, figsize=(11 if accs else 6, 4), squeeze=False)
        for key in ("train_loss", "val_loss"):
            axes[0][0].plot(epochs, [r[key] for r in history], marker="o", label=key.replace("_", " "))
        axes[0][0].set(xlabel="epoch", ylabel="loss", title="loss")
        axes[0][0].legend()
        if accs:
            for key in accs:
                axes[0][1].plot(epochs, [r[key] for r in history], marker="o", label=key.replace("_", " "))
            percent = all(k.startswith("val_acc") for k in accs)
            axes[0][1].set(xlabel="epoch", ylabel="percent" if percent else "mean per sample",
                           title="validation accuracy" if percent else "validation metrics")
            axes[0][1].legend()
        fig.tight_layout()
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100), binary=True, root=self.dir.root)
        plt.close(fig)
        return path

    def end_tracking(self, summary, files, status="FINISHED"):
        """The trackers' last records, the summary and the files; the run ends with `status` (FAILED, KILLED)."""
        for tracker in self.trackers:
            tracker.finish(summary, files, status)
        self.trackers = []

    def close(self):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _line(record):
    return json.dumps(record, sort_keys=True) + "\n"


def seconds_since_start():
    """Seconds since this process started (imports and Horovod start-up included): what a user waits for."""
    return time.time() - psutil.Process().create_time()


def peak_rss_bytes():
    """This process's resident set's high-water mark."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KB on Linux


def build_summary(cfg, rt, task, state, lr, fingerprints, run_dir, scaled):
    """The run's headline figures and its full history (without the task's helpers: metrics.jsonl has them), for
    summary.json. scaled: the run's Batching (the Trainer's) on rt.size ranks."""
    history = [visible(r, task.hidden()) for r in state.history]
    last = history[-1]
    summary = {
        "config_name": cfg.run.name or "default", "world_size": rt.size, "local_size": rt.local_size,
        "device": str(rt.device), "controller": rt.controller, "tensor_ops": rt.tensor_ops,
        "fusion_threshold_mb": rt.fusion_threshold_mb, "cycle_time_ms": rt.cycle_time_ms, "autotune": rt.autotune,
        "compile": cfg.model.compiled_as,
        "threads_per_rank": rt.threads, "dataset": cfg.data.dataset, "model": cfg.model.name, "task": task.name,
        "epochs": cfg.optim.epochs, "batch_size_per_rank": cfg.optim.batch_size,
        "global_batch_size": scaled.global_batch,
        "base_lr": cfg.optim.lr, "lr": lr, "lr_schedule": cfg.optim.lr_schedule,
        "best_metric": task.best_metric, "best_value": state.best_metric, "best_epoch": state.best_epoch,
        "best_checkpoint": run_dir.best_checkpoint,
        "final_val_loss": last["val_loss"],
        "final_val": {k[4:]: v for k, v in last.items() if k.startswith("val_") and k != "val_count"},
        "train_samples_per_sec": sum(r["train_count"] for r in history) / sum(r["epoch_seconds"] for r in history),
        "params_in_sync": len(set(fingerprints)) == 1, "params_fingerprints": fingerprints,
        # The whole run's time (each part up to the checkpoint the next one resumed from), and this process's.
        "wall_seconds": state.wall_seconds(), "process_wall_seconds": seconds_since_start(),
        "process_start_time": psutil.Process().create_time(), "resumes": state.resumes,
        "history": history,
    }
    # Where every rank's step time went over the run, and the slowest rank (hvd_train/timing.py).
    summary["timing"] = state.run_timing()
    if state.stopped_at is not None:  # --stop-at ended the run early
        summary["stopped_at_epoch"] = state.stopped_at
    if state.elastic is not None:
        summary["elastic"] = state.elastic
    # Where the newest checkpoint was taken, and the ones within epochs (--checkpoint.every_steps, every_minutes,
    # a signal or a time limit): how many, and how long the training thread waited for each.
    summary["last_checkpoint"] = ({"epoch": state.saved_within["epoch"], "after_step": state.saved_within["steps"],
                                   "end_of_epoch": False} if state.saved_within else
                                  {"epoch": state.saved_epoch, "end_of_epoch": True})
    if state.saves is not None:
        summary["checkpoints_within_epochs"] = state.saves
    if task.shown.get("acc1") and "val_acc1" in last:  # the built-in task's top-1 (a task of one's own: final_val)
        summary["best_val_acc1"] = max(r["val_acc1"] for r in history)
        summary["final_val_acc1"] = last["val_acc1"]
    return summary


def finish(cfg, rt, trainer, state, reporter):
    """End of training on every rank: compare the ranks' weights (a collective), then rank 0 writes summary.json
    and the curves. Returns the exit code: 1 when the ranks' weights differ."""
    # Every rank must end with the same weights; a difference means gradients were not averaged.
    fingerprints = hvd_utils.fingerprints_by_rank(trainer.model)
    # The weights' average (--model-ema) too: the same updates of the same weights on every rank.
    averaged = hvd_utils.fingerprints_by_rank(trainer.ema.module) if trainer.ema is not None else None
    memory = hvd_utils.gather_floats([peak_rss_bytes(), state.training_rss or 0], name="memory_by_rank")
    task, lr = trainer.task, cfg.optim.lr * trainer.schedule.lr_scale
    if rt.is_main:
        run_dir = reporter.dir
        summary = build_summary(cfg, rt, task, state, lr, fingerprints, run_dir, trainer.batching)
        summary.update(regularisation(cfg, state, averaged))
        summary["params_in_sync"] = summary["params_in_sync"] and summary.get("ema_in_sync", True)
        # Each rank's resident memory: its high-water mark, and what it held after its first epoch's steps.
        summary["memory_by_rank"] = [{"peak_rss_bytes": int(peak), "training_rss_bytes": int(steady) or None}
                                     for peak, steady in memory]
        path = run_dir.summary
        with reported_write(run_dir.curves):
            summary["curves_png"] = reporter.plot(state.history) if cfg.logging.plot else None
        with reported_write(path):
            write_json(path, summary, root=run_dir.root)
        reporter.end_tracking(summary, [path, run_dir.metrics, run_dir.config, summary["curves_png"]])
        log.info("done: best %s %.4g (epoch %s), %.0f train samples/s, %.1fs wall; summary in %s",
                 task.best_metric, state.best_metric, state.best_epoch, summary["train_samples_per_sec"],
                 summary["wall_seconds"], path)
    if len(set(fingerprints)) != 1:
        log.error("ranks ended with different parameters (fingerprints %s): gradients were not averaged",
                  fingerprints)
        return 1
    if averaged is not None and len(set(averaged)) != 1:
        log.error("ranks ended with different weight averages (--model-ema; fingerprints %s)", averaged)
        return 1
    return 0


def regularisation(cfg, state, averaged):
    """The summary's account of augmentation and regularisation: what training samples went through, and under
    --model-ema which weights were best and the averages' fingerprints."""
    a = cfg.aug
    out = {"augmentation": describe_augmentation(cfg),
           "regularisation": {"mixup": a.mixup, "cutmix": a.cutmix, "smoothing": a.smoothing, "bce_loss": a.bce_loss,
                              "drop_path": cfg.model.drop_path, "model_ema": cfg.model.ema}}
    if averaged is not None:
        out.update(best_weights=state.best_weights, ema_fingerprints=averaged, ema_in_sync=len(set(averaged)) == 1)
    if state.stopped_at is not None and cfg.run.patience:
        out["patience"] = cfg.run.patience
    return out
