"""Metrics from a task's sums: exact averages over every sample of every rank, and comparisons with the best.

Keys ending in `_sum` become means per sample; `correct1`/`correct5` become percentages.
"""


def improved(task, value, best):
    """Whether `value` of the task's best_metric beats `best` (None: nothing yet)."""
    return best is None or (value > best if task.best_mode == "max" else value < best)


def reached(task, value, target):
    """Whether `value` of the task's best_metric meets a --stop-at target (0: no target)."""
    return target > 0 and (value >= target if task.best_mode == "max" else value <= target)


def averages(totals):
    """Global sums -> per-sample means and accuracies in percent. With no samples, means are NaN and counts 0."""
    count = totals.get("count", 0.0)
    out = {"count": int(count)}
    for key, value in totals.items():
        if key.endswith("_sum"):
            out[key[:-4]] = value / count if count else float("nan")
        elif key.startswith("correct"):
            out["acc" + key[len("correct"):]] = 100.0 * value / count if count else 0.0
    return out
