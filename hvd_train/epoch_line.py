"""An epoch's flat record (metrics.jsonl, the history, TensorBoard) and its one line in the log."""
from hvd_train import timing
from hvd_train.run.best import visible


def epoch_record(epoch, lr, epoch_seconds, train, val):
    """The flat record written to metrics.jsonl, the history and TensorBoard: train_* and val_* terms."""
    record = {"epoch": epoch, "lr": lr, "epoch_seconds": epoch_seconds,
              "samples_per_sec": train["count"] / epoch_seconds}
    record.update({f"train_{k}": v for k, v in train.items()})
    record.update({f"val_{k}": v for k, v in val.items()})
    return record


def format_record(epoch, epochs, train, val, record, shown=None, helpers=()):
    """One line per epoch: train and validation terms and metrics as the task names them (shown: {metric: label}
    for those it shows in percent, as classification's top-1 and top-5), rate and time. Helpers and metrics that
    are tensors (lists in the record) are left for metrics.jsonl."""
    shown = shown or {}

    def terms(metrics):
        # The task's order: loss, its terms, its metrics, its derived figures.
        names = [k for k in visible(metrics, helpers) if k != "count"]
        return " ".join(f"{shown[k]} {metrics[k]:.2f}%" if k in shown else f"{k} {metrics[k]:.4f}" for k in names)

    ema = {k[8:]: v for k, v in record.items() if k.startswith("val_ema_")}
    averaged = f"  val(ema) {terms(ema)}" if ema else ""
    split = f"  {timing.split_line(record['timing']['ranks'])}" if "timing" in record else ""
    return (f"epoch {epoch}/{epochs}  train {terms(train)}  val {terms(val)}{averaged}  lr {record['lr']:.4g}  "
            f"{record['samples_per_sec']:.0f} samples/s  {record['epoch_seconds']:.2f}s{split}")
