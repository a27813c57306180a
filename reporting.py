"""What rank 0 writes while training: metrics as JSON lines, TensorBoard events and, at the end, a PNG of the curves.

Every method is a no-op on the other ranks, so callers need no `if rank == 0`.
"""
import json
import math
import os
import time

import psutil


class Reporter:
    def __init__(self, output_dir, enabled, tensorboard=True, resume=False):
        self.output_dir, self.enabled, self.tensorboard, self.writer = output_dir, False, tensorboard, None
        self.jsonl = os.path.join(output_dir, "metrics.jsonl")
        if enabled and not resume and os.path.exists(self.jsonl):
            os.remove(self.jsonl)  # a fresh run starts a fresh record; a resumed one continues it
        self.set_enabled(enabled)

    def set_enabled(self, enabled):
        """Start or stop writing (in an elastic run the writing rank can change after a reset)."""
        if enabled and not self.enabled:
            os.makedirs(self.output_dir, exist_ok=True)
            if self.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(os.path.join(self.output_dir, "tensorboard"))
        elif not enabled:
            self.close()
        self.enabled = enabled

    def epoch(self, record):
        if not self.enabled:
            return
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "epoch" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key.replace("_", "/", 1), value, record["epoch"])
            self.writer.flush()

    def plot(self, history, path):
        """Loss curves (and accuracy, where the task has one) per epoch, to a PNG."""
        if not self.enabled or not history:
            return None
        import matplotlib

        matplotlib.use("Agg")  # no display on cluster nodes
        import matplotlib.pyplot as plt

        epochs = [r["epoch"] for r in history]
        accs = [k for k in history[0] if k.startswith("val_acc")]
        fig, axes = plt.subplots(1, 2 if accs else 1, figsize=(11 if accs else 6, 4), squeeze=False)
        for key in ("train_loss", "val_loss"):
            axes[0][0].plot(epochs, [r[key] for r in history], marker="o", label=key.replace("_", " "))
        axes[0][0].set(xlabel="epoch", ylabel="loss", title="loss")
        axes[0][0].legend()
        if accs:
            for key in accs:
                axes[0][1].plot(epochs, [r[key] for r in history], marker="o", label=key.replace("_", " "))
            axes[0][1].set(xlabel="epoch", ylabel="percent", title="validation accuracy")
            axes[0][1].legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def seconds_since_start():
    """Seconds since this process started (imports and Horovod start-up included): what a user waits for."""
    return time.time() - psutil.Process().create_time()


def read_json_or_none(path):
    """The JSON object in `path`, or None where there is no such file or it is not valid JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path, obj):
    """Write via a temporary file and rename, so a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def build_summary(cfg, rt, task, state, lr, fingerprints):
    """The run's headline figures and its full history, for summary.json."""
    history, last = state["history"], state["history"][-1]
    summary = {
        "config_name": cfg.run.name or "default", "world_size": rt.size, "local_size": rt.local_size,
        "device": str(rt.device), "controller": rt.controller, "tensor_ops": rt.tensor_ops,
        "fusion_threshold_mb": rt.fusion_threshold_mb, "cycle_time_ms": rt.cycle_time_ms,
        "threads_per_rank": rt.threads, "dataset": cfg.data.dataset, "model": cfg.model.name, "task": task.name,
        "epochs": cfg.optim.epochs, "batch_size_per_rank": cfg.optim.batch_size,
        "global_batch_size": cfg.optim.batch_size * rt.size * cfg.horovod.batches_per_allreduce,
        "base_lr": cfg.optim.lr, "lr": lr, "lr_schedule": cfg.optim.lr_schedule,
        "best_metric": task.best_metric, "best_value": state["best_metric"], "best_epoch": state["best_epoch"],
        "best_checkpoint": os.path.join(cfg.run.output_dir, "checkpoints", "best.pt"),
        "final_val_loss": last["val_loss"],
        "train_samples_per_sec": sum(r["train_count"] for r in history) / sum(r["epoch_seconds"] for r in history),
        "params_in_sync": len(set(fingerprints)) == 1, "params_fingerprints": fingerprints,
        "wall_seconds": seconds_since_start(), "process_start_time": psutil.Process().create_time(),
        "history": history,
    }
    if "stopped_at" in state:  # --stop-at ended the run early
        summary["stopped_at_epoch"] = state["stopped_at"]
    if "elastic" in state:
        summary["elastic"] = state["elastic"]
    if "val_acc1" in last:
        summary["best_val_acc1"] = max(r["val_acc1"] for r in history)
        summary["final_val_acc1"] = last["val_acc1"]
    return summary
