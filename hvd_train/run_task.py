"""How the training loop drives a task (the interface a task is written against: hvd_train/tasks.py): its
checks before training, one batch's loss and sums under the names the app reduces, an epoch's figures.
"""
import math
import numbers
import os
import traceback

import numpy as np
import torch

from hvd_train.errors import ConfigError
from hvd_train.run.best import averages


def first_tensor(batch):
    """The batch's first tensor with a batch dimension, depth first through tuples, lists and dicts; or None."""
    if torch.is_tensor(batch):
        return batch if batch.dim() else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    return next((t for t in map(first_tensor, values) if t is not None), None)


def samples_in(batch):
    """The number of samples in a batch: the length of its first tensor (1 where it holds no batched tensor)."""
    first = first_tensor(batch)
    return first.shape[0] if first is not None else 1


class RunTask:
    """A task as the training loop drives it: step() gives the loss to train and the batch's sums, under the
    names the app reduces and reports (count, loss, each term where there are several, each metric)."""

    def __init__(self, task, name):
        self.task, self.name = task, name
        self.terms = tuple(getattr(task, "terms", ("loss",)))
        self.metrics = tuple(getattr(task, "metrics", ()))
        self.derived = tuple(getattr(task, "derived", ()))
        self.helpers = tuple(getattr(task, "helpers", ()))
        check_task(task, name, self.terms, self.metrics, self.derived, self.helpers)
        self.shapes = {}  # each metric sum's shape, from its first batch: every later batch must give the same
        self.best_metric, self.best_mode = task.best_metric, task.best_mode
        # Metrics the task labels for people, shown in percent ({"acc1": "top-1"}); the others by their own names.
        self.shown = {k: v for k, v in dict(getattr(task, "shown", {})).items() if k in self.metrics}
        split = self.terms if self.terms != ("loss",) else ()  # terms reported beside their sum
        self.keys = ("count", "loss") + split + self.metrics

    def finish(self, means):
        """An epoch's means (from hvd_train.run.best.averages) with the task's derived figures added; a metric
        that is a tensor becomes a list (records are JSON)."""
        if self.derived:
            made = self.task.derive(dict(means))
            if not isinstance(made, dict) or set(made) != set(self.derived):
                shown = sorted(made) if isinstance(made, dict) else type(made).__name__
                raise ConfigError(f"--task {self.name}: derive() must return the figures it declares, "
                                  f"{list(self.derived)}; it returned {shown}")
            means.update({k: number(v, f"--task {self.name}: derive()'s {k!r}") for k, v in made.items()})
        return {k: v.tolist() if torch.is_tensor(v) else v for k, v in means.items()}

    def hidden(self):
        """The record keys of the helpers, kept out of the epoch line, the summary, the curves and the trackers
        (hvd_train.run.best.visible, which leaves out the metrics that are tensors as well)."""
        return {f"{split}_{h}" for split in ("train", "val", "val_ema") for h in self.helpers}

    def samples(self, batch):
        """The number of samples in a batch."""
        return self.task.samples(batch) if hasattr(self.task, "samples") else samples_in(batch)

    def step(self, model, batch):
        """(loss to backpropagate, {name: sum over this batch}) for one batch."""
        terms, outputs = self.task.loss(model, batch)
        if not isinstance(terms, dict) or set(terms) != set(self.terms):
            got = sorted(terms) if isinstance(terms, dict) else type(terms).__name__
            raise ConfigError(f"--task {self.name}: loss() must return ({{term: loss}}, outputs) with the terms it "
                              f"declares, {list(self.terms)}; it returned {got}")
        loss = sum(terms[t] for t in self.terms)
        n = self.samples(batch)
        sums = {"count": n, "loss": loss.detach() * n}
        if self.terms != ("loss",):
            sums.update({t: terms[t].detach() * n for t in self.terms})
        if self.metrics:
            with torch.no_grad():
                got = self.task.metric_sums(outputs.detach() if torch.is_tensor(outputs) else outputs, batch)
            if not isinstance(got, dict) or set(got) != set(self.metrics):
                shown = sorted(got) if isinstance(got, dict) else type(got).__name__
                raise ConfigError(f"--task {self.name}: metric_sums() must return the metrics it declares, "
                                  f"{list(self.metrics)}; it returned {shown}")
            sums.update({k: self.checked_sum(k, v) for k, v in got.items()})
        return loss, sums

    def checked_sum(self, name, value):
        """A metric sum that can be added over batches and ranks: a tensor (of the shape its first batch gave)
        or a number."""
        if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in "biuf":
            value = torch.as_tensor(value)  # NumPy's arrays and numbers add as tensors do
        if isinstance(value, bool) or not (torch.is_tensor(value) or isinstance(value, numbers.Real)):
            raise ConfigError(f"--task {self.name}: metric_sums()'s {name!r} is a {type(value).__name__}; return "
                              f"a tensor (of any fixed shape) or a number, summed over the batch's samples")
        shape = tuple(value.shape) if torch.is_tensor(value) else ()
        if self.shapes.setdefault(name, shape) != shape:
            raise ConfigError(f"--task {self.name}: metric_sums()'s {name!r} has shape {list(shape)} on one batch "
                              f"and {list(self.shapes[name])} on another; a sum must have the same shape on every "
                              f"batch to be added over batches and ranks (sum over the batch's samples, e.g. "
                              f".sum(dim=0))")
        return value

    def check_sums(self, sums):
        """The one-sample check of a task's figures (hvd_train.build.try_the_metrics): `sums` of one batch, as
        hvd_utils.allreduce_sums hands an epoch's over, made into its figures; a best_metric that is not a number,
        or a derived figure that is not finite, is refused before training."""
        vectors = [k for k, shape in self.shapes.items() if shape]
        best = self.best_metric.split("_", 1)[1]
        if best in vectors:
            raise ConfigError(f"--task {self.name}: best_metric {self.best_metric!r} is a tensor of shape "
                              f"{list(self.shapes[best])}, and best.pt and --stop-at compare numbers; name a "
                              f"derived figure made from it (derived = (...) and derive())")
        try:
            figures = self.finish(averages(sums))
        except (ArithmeticError, ValueError) as e:  # a division by zero, math.sqrt(-1e-18): found after an epoch
            where = traceback.extract_tb(e.__traceback__)[-1]
            raise ConfigError(f"--task {self.name}: derive() raised {type(e).__name__}: {e} on one training "
                              f"sample ({os.path.basename(where.filename)}:{where.lineno}); a figure must be "
                              f"finite on any batch (guard its divisions)") from None
        bad = next((k for k in self.derived if not math.isfinite(figures[k])), None)
        if bad is not None:
            raise ConfigError(f"--task {self.name}: derive() gave {bad}={figures[bad]} on one training sample; a "
                              f"figure must be finite on any batch, as an epoch's figure is made the same way "
                              f"(guard its divisions, e.g. union.clamp(min=1))")


def number(value, what):
    """A derived figure as a float; anything else (a tensor of several values, a string) is refused."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        shown = f"a tensor of shape {list(value.shape)}" if torch.is_tensor(value) else f"a {type(value).__name__}"
        raise ConfigError(f"{what} is {shown}; a derived figure is one number (a helper metric may be a tensor: "
                          f"keep it in metrics and helpers)") from None


def check_task(task, name, terms, metrics, derived=(), helpers=()):
    """A task that cannot be driven is refused before training, with what to add."""
    if not callable(getattr(task, "loss", None)):
        raise ConfigError(f"--task {name}: has no loss(self, model, batch) method returning ({{term: loss}}, outputs)")
    if metrics and not callable(getattr(task, "metric_sums", None)):
        raise ConfigError(f"--task {name}: declares metrics {list(metrics)} but has no metric_sums(self, outputs, "
                          f"batch) method returning their sums over the batch")
    if derived and not callable(getattr(task, "derive", None)):
        raise ConfigError(f"--task {name}: declares derived figures {list(derived)} but has no derive(self, means) "
                          f"method that makes them from the epoch's means")
    names = ("loss",) + (tuple(terms) if tuple(terms) != ("loss",) else ()) + tuple(metrics) + tuple(derived)
    clash = next((n for n in names if names.count(n) > 1 or n == "count" or not n.isidentifier()), None)
    if clash or not terms:
        raise ConfigError(f"--task {name}: terms {list(terms)}, metrics {list(metrics)} and derived figures "
                          f"{list(derived)} must be distinct names, not 'count', with at least one term")
    stray = [h for h in helpers if h not in metrics]
    if stray:
        raise ConfigError(f"--task {name}: helpers {stray} are not among its metrics {list(metrics)}; a helper is "
                          f"a metric sum kept out of sight (for derive()), so declare it in metrics too")
    choices = ", ".join(f"{split}_{n}" for split in ("val", "train") for n in names if n not in helpers)
    best = getattr(task, "best_metric", None)
    if best is None:
        raise ConfigError(f"--task {name}: declares no best_metric (what best.pt and --stop-at compare); add e.g. "
                          f"best_metric = 'val_loss' and best_mode = 'min'. It can be one of: {choices}")
    if best not in [f"{split}_{n}" for split in ("val", "train") for n in names if n not in helpers]:
        raise ConfigError(f"--task {name}: best_metric {best!r} is not a metric it reports; choose one of: {choices}")
    if getattr(task, "best_mode", None) not in ("min", "max"):
        raise ConfigError(f"--task {name}: best_mode must be 'min' or 'max' (whether a lower or a higher "
                          f"{best} is better), not {getattr(task, 'best_mode', None)!r}")
