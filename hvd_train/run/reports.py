"""What rank 0 reports about a run: the setup lines before training, each epoch's record while it trains, and the
summary at its end.

Before training: the lines a user checks first in a log (who runs where, the data, the batch and learning-rate
arithmetic, augmentation, compression), and one line when a run resumes on another number of ranks. While training
(Reporter): each epoch's record as a line of metrics.jsonl and as TensorBoard events, and to the experiment trackers
(hvd_train/run/tracking.py). At the end: summary.json, with the ranks' weights compared, and a PNG of the curves.

Reporter's methods are no-ops on the other ranks, so callers need no `if rank == 0`.
"""
import dataclasses
import json
import logging
import math
import os
import secrets
import time
from typing import TYPE_CHECKING, Any, Iterable, Optional, Union, cast

import psutil

import hvd_utils
from hvd_train.errors import redact_text
from hvd_train.files import append_line, atomic_write, no_link_below, reported_write, write_json
from hvd_train.tasks import visible

if TYPE_CHECKING:
    import torch
    from torch.utils.tensorboard import SummaryWriter

    from hvd_train.config import Config
    from hvd_train.data import DataInfo
    from hvd_train.run.directory import RunDir
    from hvd_train.run.state import RunState
    from hvd_train.run.tracking import Tracker
    from hvd_train.tasks import RunTask
    from hvd_train.trainer import Batching, Trainer

log = logging.getLogger("hvd_train")


class Reporter:
    """resumed_history: the records of the checkpoint a run resumes from. metrics.jsonl is rewritten to hold
    exactly those (records of epochs after the checkpoint were lost with the run that wrote them, and are trained
    again), and TensorBoard hides its points after that epoch (purge_step), so each epoch has one record.
    hidden: the record keys of the task's helpers, which only metrics.jsonl shows (RunTask.hidden)."""
    writer: Optional["SummaryWriter"]
    purge_step: Optional[int]
    trackers: list["Tracker"]

    def __init__(self, run_dir: "RunDir", enabled: bool, tensorboard: bool = True,
                 resumed_history: Optional[list[dict[str, Any]]] = None, hidden: Iterable[str] = frozenset()) -> None:
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

    def set_enabled(self, enabled: bool) -> None:
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

    def track(self, trackers: Iterable["Tracker"]) -> None:
        """Experiment trackers (hvd_train/run/tracking.py) that get each epoch's record and, at the end, the summary."""
        self.trackers = list(trackers)

    def epoch(self, record: dict[str, Any], committed: bool = True) -> None:
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

    def plot(self, history: list[dict[str, Any]]) -> Optional[str]:
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

    def end_tracking(self, summary: Optional[dict[str, Any]], files: Iterable[Optional[str]],
                     status: str = "FINISHED") -> None:
        """The trackers' last records, the summary and the files; the run ends with `status` (FAILED, KILLED)."""
        for tracker in self.trackers:
            tracker.end_run(summary, files, status)
        self.trackers = []

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _line(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True) + "\n"


def seconds_since_start() -> float:
    """Seconds since this process started (imports and Horovod start-up included): what a user waits for."""
    return time.time() - psutil.Process().create_time()


def peak_rss_bytes() -> int:
    """This process's resident set's high-water mark."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KB on Linux


@dataclasses.dataclass(frozen=True)
class JobFacts:
    """Who ran a job and how: the part of summary.json that training and the benchmark share, made in one place."""
    config_name: str
    model: str
    compile: Union[str, bool]  # the torch.compile mode, or False for an eager model
    batch_size_per_rank: int
    world_size: int
    local_size: int
    device: str
    controller: str
    tensor_ops: str
    fusion_threshold_mb: float
    cycle_time_ms: float
    autotune: bool
    threads_per_rank: int

    @classmethod
    def of(cls, cfg: "Config", rt: hvd_utils.Runtime) -> "JobFacts":
        return cls(config_name=cfg.run.name or "default", model=cfg.model.name, compile=cfg.model.compiled_as,
                   batch_size_per_rank=cfg.optim.batch_size, world_size=rt.size, local_size=rt.local_size,
                   device=str(rt.device), controller=rt.controller, tensor_ops=rt.tensor_ops,
                   fusion_threshold_mb=rt.fusion_threshold_mb, cycle_time_ms=rt.cycle_time_ms,
                   autotune=rt.autotune, threads_per_rank=rt.threads)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_summary(cfg: "Config", rt: hvd_utils.Runtime, task: "RunTask", state: "RunState", lr: float,
                  fingerprints: list[int], run_dir: "RunDir", scaled: "Batching") -> dict[str, Any]:
    """The run's headline figures and its full history (without the task's helpers: metrics.jsonl has them), for
    summary.json. scaled: the run's Batching (the Trainer's) on rt.size ranks."""
    history = [visible(r, task.hidden()) for r in state.history]
    last = history[-1]
    summary = {
        **JobFacts.of(cfg, rt).as_dict(), "dataset": cfg.data.dataset, "task": task.name, "epochs": cfg.optim.epochs,
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


def write_summary(cfg: "Config", rt: hvd_utils.Runtime, trainer: "Trainer", state: "RunState",
                  reporter: Reporter) -> int:
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
        summary = build_summary(cfg, rt, task, state, lr, fingerprints, run_dir, cast("Batching", trainer.batching))
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


def regularisation(cfg: "Config", state: "RunState", averaged: Optional[list[int]]) -> dict[str, Any]:
    """The summary's account of augmentation and regularisation: what training samples went through, and under
    --model-ema which weights were best and the averages' fingerprints."""
    a = cfg.aug
    out: dict[str, Any] = {
        "augmentation": describe_augmentation(cfg),
        "regularisation": {"mixup": a.mixup, "cutmix": a.cutmix, "smoothing": a.smoothing, "bce_loss": a.bce_loss,
                           "drop_path": cfg.model.drop_path, "model_ema": cfg.model.ema}}
    if averaged is not None:
        out.update(best_weights=state.best_weights, ema_fingerprints=averaged, ema_in_sync=len(set(averaged)) == 1)
    if state.stopped_at is not None and cfg.run.patience:
        out["patience"] = cfg.run.patience
    return out


def log_setup(cfg: "Config", rt: hvd_utils.Runtime, info: "DataInfo", trainer: "Trainer",
              resumed_epoch: int) -> None:
    """The batch and learning-rate arithmetic, and who is running where: the first thing to check in a log."""
    scaled = cast("Batching", trainer.batching)
    log.info("hvd-train %s: %d rank(s), %d per host, device %s, %d CPU thread(s) per rank, controller %s, "
             "tensor ops %s, fusion %g MB, cycle %g ms", cfg.run.name or "default", rt.size, rt.local_size,
             rt.device, rt.threads, rt.controller, rt.tensor_ops, rt.fusion_threshold_mb, rt.cycle_time_ms)
    if rt.autotune:
        log.info("Horovod autotune is on: it tunes %s while training, from the values above%s",
                 " and ".join(name for name, var in (("the fusion threshold", "HOROVOD_FUSION_THRESHOLD"),
                                                     ("the cycle time", "HOROVOD_CYCLE_TIME"))
                              if var not in os.environ) or "nothing (both are fixed in the environment)",
                 f"; its log: {os.environ['HOROVOD_AUTOTUNE_LOG']}" if os.environ.get("HOROVOD_AUTOTUNE_LOG") else "")
    log.info("data %s: %d train / %d val samples%s; model %s (task %s, %.2fM parameters)",
             describe_call(cfg.data.dataset, info.called_with),
             info.num_train, info.num_val, describe_samples(info), cfg.model.name, trainer.task.name,
             sum(p.numel() for p in trainer.model.parameters()) / 1e6)
    log.info("batch %d per rank x %d ranks x %d per allreduce = %d global; lr %g base x %g = %g, %s schedule, "
             "%g warmup epochs; amp %s%s%s", cfg.optim.batch_size, rt.size, cfg.horovod.batches_per_allreduce,
             scaled.global_batch, cfg.optim.lr, scaled.lr_scale, scaled.lr,
             cfg.optim.lr_schedule, cfg.optim.warmup_epochs, cfg.optim.amp,
             ", channels-last" if cfg.model.channels_last else "",
             f"; resuming after epoch {resumed_epoch}" if resumed_epoch else "")
    extras = (("mixup", cfg.aug.mixup), ("cutmix", cfg.aug.cutmix), ("label smoothing", cfg.aug.smoothing),
              ("drop-path", cfg.model.drop_path))
    extra = "".join(f"; {name} {value:g}" for name, value in extras if value) + \
        (f"; EMA of the weights (decay {cfg.model.ema_decay:g})" if cfg.model.ema else "")
    if info.in_channels and info.image_size:  # images: what they go through
        log.info("augmentation: %s%s", describe_augmentation(cfg), extra)
    elif extra:  # tokens, tables, ...: the data set's samples as they are, and what training adds
        log.info("regularization:%s", extra[1:])
    if cfg.horovod.shard_optimizer and rt.size > 1:
        log.info("optimizer state sharded over %d ranks (ZeRO-1, --shard-optimizer): %s state for %.2fM "
                 "parameters on this rank; checkpoints hold it whole", rt.size, cfg.optim.optimizer,
                 sum(g.length for g in trainer.optimizer.groups) / 1e6)
    log_compression(cfg, rt, trainer.optimizer)
    if cfg.model.compile:
        log.info("torch.compile (mode %s): the first training step compiles the model (and the first validation "
                 "batch again, for eval mode), so epoch 1 takes longer", cfg.model.compile_mode)


def log_compression(cfg: "Config", rt: hvd_utils.Runtime, optimizer: "torch.optim.Optimizer") -> None:
    """--powersgd-rank: the rank, the start step, which tensors it compresses and a step's bytes with and without."""
    plan = hvd_utils.describe_compression(optimizer)
    if plan is None:
        if cfg.horovod.powersgd_rank:
            log.info("PowerSGD: off on one rank (there is nothing to average)")
        return
    log.info("PowerSGD rank %d from optimizer step %d: %d tensors compressed, %d averaged as they are; a step "
             "sends %.3g MB per rank instead of %.3g MB (%.1fx fewer bytes)", plan["rank"], plan["start_step"],
             plan["compressed"], plan["plain"], plan["bytes_powersgd"] / 1e6, plan["bytes_plain"] / 1e6,
             plan["ratio"])
    if plan["restarted"]:
        log.info("PowerSGD: %s", plan["restarted"])


def log_rescale(cfg: "Config", resumed: dict[str, Any], steps_per_epoch: int, now: "Batching",
                before: Optional["Batching"]) -> None:
    """One line when a run resumes on another number of ranks than it was checkpointed on (`resumed`: the
    state's last resume record; `now`: the run's Batching on the ranks it has; `before`: the arithmetic of the run
    that wrote the checkpoint, on its number of ranks, or None where unknown): the learning rate and the global
    batch scale with the ranks, and the schedule, which runs by epochs, goes on from the same epoch with another
    number of steps per epoch."""
    old, new = resumed.get("previous_world_size"), resumed["world_size"]
    if not old or old == new or before is None:
        return
    log.info("resuming on %d rank(s) a run checkpointed on %d: learning rate %g -> %g, global batch %d -> %d (both "
             "follow the ranks); the schedule goes on by epochs from epoch %d/%d, now of %d steps", new, old, before.lr,
             now.lr, before.global_batch, now.global_batch, resumed["epoch"] + 1, cfg.optim.epochs, steps_per_epoch)


SHORT_REPR = 80  # characters of a list's, a tuple's or a dict's repr that the data line shows; longer: its length


def describe_call(name: str, kwargs: Optional[dict[str, Any]]) -> str:
    """'mydata:sets(seed=42, image_size=64)': factory `name` with the keyword arguments the run passed it, on one
    line, URIs redacted; just the name where they are not known (None). Numbers, strings (whole: a path is worth
    reading), None and short containers of them as repr shows them; tensors and other objects by their type."""
    if kwargs is None:
        return name
    return redact_text(f"{name}({', '.join(f'{key}={_shown_argument(value)}' for key, value in kwargs.items())})")


def _shown_argument(value: object) -> str:
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, int):
        return repr(int(value))
    if isinstance(value, float):
        return repr(float(value))
    if isinstance(value, (list, tuple, dict)):
        items = list(value.keys()) + list(value.values()) if isinstance(value, dict) else list(value)
        shown = repr(value)
        if all(v is None or isinstance(v, (bool, int, float, str)) for v in items) and len(shown) <= SHORT_REPR:
            return shown
        return f"<{type(value).__name__} of {len(value)}>"
    return f"<{type(value).__name__}>"


def describe_samples(info: "DataInfo") -> str:
    """' of 3x32x32, 10 classes' for images; the facts a user's data set gave otherwise."""
    if info.in_channels and info.image_size:
        shape = f" of {info.in_channels}x{info.image_size}x{info.image_size}"
        return shape + (f", {info.num_classes} classes" if info.num_classes else "")
    facts = {k: v for k, v in info.facts().items() if isinstance(v, (int, float, str, bool))}
    return f" ({', '.join(f'{k} {v}' for k, v in facts.items())})" if facts else ""


def describe_augmentation(cfg: "Config") -> str:
    """What training samples go through, in one line."""
    from hvd_train.data.augment import Augmentation
    from hvd_train.data.catalog import KIND_OF

    return Augmentation.from_config(cfg.aug).describe(KIND_OF.get(cfg.data.dataset, "own"))
