"""What rank 0 writes while training: metrics as JSON lines, TensorBoard events and, at the end, a PNG of the curves.

Every method is a no-op on the other ranks, so callers need no `if rank == 0`.
"""
import json
import math
import os


class Reporter:
    def __init__(self, output_dir, enabled, tensorboard=True, resume=False):
        self.output_dir, self.enabled, self.writer = output_dir, enabled, None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.jsonl = os.path.join(output_dir, "metrics.jsonl")
        if not resume and os.path.exists(self.jsonl):
            os.remove(self.jsonl)  # a fresh run starts a fresh record; a resumed one continues it
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))

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
