"""Metrics from a task's sums: exact averages over every sample of every rank, and comparisons with the best.

Every sum but `count` becomes a mean per sample (a task reports accuracies as sums of 100 per hit: percentages);
a sum that is a tensor (per-class counts, a confusion matrix) is divided as a whole.
"""


def improved(task, value, best):
    """Whether `value` of the task's best_metric beats `best` (None: nothing yet)."""
    return best is None or (value > best if task.best_mode == "max" else value < best)


def candidate(task, record):
    """(value of the task's best metric, which weights reach it) for an epoch's record: the better of the model's
    and, under --model-ema, its average's ("model" or "ema")."""
    value = record[task.best_metric]
    key = "val_ema_" + task.best_metric[4:] if task.best_metric.startswith("val_") else None
    if key in record and improved(task, record[key], value):
        return record[key], "ema"
    return value, "model"


def reached(task, value, target):
    """Whether `value` of the task's best_metric meets a --stop-at target (0: no target)."""
    return target > 0 and (value >= target if task.best_mode == "max" else value <= target)


def averages(totals):
    """Global sums -> per-sample means (a task's loss, its terms and its metrics). With no samples: NaN, count 0."""
    count = totals.get("count", 0.0)
    out = {"count": int(count)}
    out.update({key: value / count if count else value * float("nan") for key, value in totals.items()
                if key != "count"})
    return out


def visible(figures, hidden):
    """Figures without the task's helpers (`hidden`: their names, or their record keys) and without the metrics
    that are tensors (lists once made figures) and the ranks' step timing (a dict): what the epoch line, the
    summary, the curves and the trackers show; metrics.jsonl keeps them all."""
    return {k: v for k, v in figures.items() if k not in hidden and not isinstance(v, (list, dict))}
