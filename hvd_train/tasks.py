"""Tasks: what a model is trained to do (its loss terms, its metrics, which metric is best), and its exact figures.

A task is a class with

    terms = ("loss",)              # the names of the loss terms loss() returns; training follows their sum
    metrics = ()                   # the names of the metric sums metric_sums() returns
    best_metric = "val_loss"       # what best.pt and --stop-at compare: val_ or train_ + "loss", a term or a metric
    best_mode = "min"              # or "max"

    def loss(self, model, batch):  # -> ({term: mean over the batch's samples}, outputs)
    def metric_sums(self, outputs, batch):  # -> {metric: sum over the batch's samples}; optional without metrics

    derived = ()                   # optional: names of figures made from an epoch's means (perplexity from loss)
    def derive(self, means):       # -> {name: number}, from the means of the loss, the terms and the metrics
    helpers = ()                   # optional: metrics only derive() needs, kept out of the line, summary, curves

`batch` is whatever the data set's samples collate to (a tuple, a dict of tensors), already on the device. A batch's
samples are the length of its first tensor unless the task has a `samples(batch)` method. The two tasks that ship,
classification and the VAE, are written against this same interface.

RunTask is a task as the training loop (hvd_train/trainer.py) drives it: its checks before training, one batch's
loss and sums under the names the app reduces (count, loss, each term, each metric), an epoch's figures. The app
multiplies each term by the batch's samples and adds the metric sums over batches and ranks; averages() divides every
sum but `count` by the number of samples once, at the end of an epoch, which gives exact means over every sample of
every rank whatever the shard sizes (a task reports accuracies as sums of 100 per hit: percentages). A metric sum may
be a tensor of any fixed shape (per-class intersections, a confusion matrix): it is added and divided as a whole,
derive() gets it as a float64 tensor (means["count"] times it gives the sums back), and the records hold it as a
list, in metrics.jsonl only. improved(), candidate() and reached() compare an epoch's figure with the best so far and
with --stop-at.
"""
import math
import numbers
import os
import traceback
from typing import Any, Callable, Collection, Optional, Sequence, Union, cast

import numpy as np
import torch
import torch.nn.functional as F

from hvd_train.errors import ConfigError
from hvd_train.registry import call

# The keys of a dict sample that hold its class, as HuggingFace's data sets and models name them.
LABEL_KEYS = ("label", "labels")


class Classification:
    """Cross-entropy on logits; top-1 and top-5 accuracy in percent (top-5 only with more than 5 classes, where it
    is not always 100%). batch: (inputs, class indices), or (mixed inputs, class indices, soft targets) under
    mixup/CutMix (hvd_train/trainer.py), whose accuracy counts against each input's own class; or a dict whose
    "label" (or "labels") holds the classes and whose other keys the model takes by keyword, as HuggingFace's
    models do. The model returns the logits, a tuple whose first item they are, or an object with .logits.

    Training follows timm's train.py: soft targets -> SoftTargetCrossEntropy, label smoothing ->
    LabelSmoothingCrossEntropy, and BinaryCrossEntropy for either with --bce-loss; evaluation (the model in eval
    mode) always reports plain cross-entropy, so validation losses compare across recipes."""
    metrics: tuple[str, ...] = ("acc1", "acc5")
    best_metric, best_mode = "val_acc1", "max"
    percent = ("acc1", "acc5")  # metrics in percent: a --stop-at above 100 can never be reached
    shown = {"acc1": "top-1", "acc5": "top-5"}  # what the epoch line and the summary call them

    def __init__(self, num_classes: Optional[int] = None, smoothing: float = 0.0, bce_loss: bool = False) -> None:
        if num_classes is not None and num_classes <= 5:
            self.metrics = ("acc1",)
        self.train_loss, self.bce = training_loss(smoothing, bce_loss), bce_loss

    def loss(self, model: torch.nn.Module, batch: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        args, kwargs, labels = split_batch(batch)
        logits = logits_of(model(*args, **kwargs))
        mixed = not isinstance(batch, dict) and len(batch) > 2
        if model.training and mixed:  # mixed: the targets carry the smoothing already
            return {"loss": (cast(torch.nn.Module, self.train_loss) if self.bce else soft_cross_entropy)(
                logits, batch[2])}, logits
        if model.training and self.train_loss is not None:
            return {"loss": self.train_loss(logits, labels)}, logits
        return {"loss": F.cross_entropy(logits, labels)}, logits

    def metric_sums(self, logits: torch.Tensor, batch: Any) -> dict[str, torch.Tensor]:
        labels = split_batch(batch)[2]
        # One topk serves both accuracies: its first column is the argmax.
        hits = logits.topk(min(5, logits.shape[1]), dim=1).indices == labels.unsqueeze(1)
        sums = {"acc1": 100.0 * hits[:, 0].sum(), "acc5": 100.0 * hits.any(dim=1).sum()}
        return {k: sums[k] for k in self.metrics}


def split_batch(batch: Any) -> tuple[tuple[torch.Tensor, ...], dict[str, Any], torch.Tensor]:
    """(positional inputs, keyword inputs, class indices) of a classifier's batch: a tuple (inputs, classes, ...) or
    a dict with a "label" or "labels" key, whose other keys are the model's keyword inputs."""
    if isinstance(batch, dict):
        key = next((k for k in LABEL_KEYS if k in batch), None)
        if key is None:
            raise ConfigError(f"the classification task takes the classes of a dict sample from its 'label' or "
                              f"'labels' key, and the samples have keys {sorted(batch)}; name the class key "
                              f"'label', or give your own --task")
        return (), {k: v for k, v in batch.items() if k != key}, batch[key]
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        found = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else \
            f"a {type(batch).__name__}"
        raise ConfigError(f"the classification task takes samples (inputs, class) or dicts with a 'label' key, and "
                          f"the samples are {found}; give samples of that form, or your own --task")
    return (batch[0],), {}, batch[1]


def logits_of(output: Any) -> torch.Tensor:
    """A classifier's logits from what its forward returned: the tensor itself, the first item of a tuple, or the
    .logits of an output object (HuggingFace's SequenceClassifierOutput)."""
    if torch.is_tensor(output):
        return output
    logits = getattr(output, "logits", None)
    if torch.is_tensor(logits):
        return logits
    if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
        return output[0]
    found = f"a {type(output).__name__}" + (f" with keys {sorted(output)}" if isinstance(output, dict) else "")
    raise ConfigError(f"the classification task takes the model's logits as a tensor, the first item of a tuple, "
                      f"or an output's .logits, and the model returned {found}; return the logits, or give your "
                      f"own --task")


def training_loss(smoothing: float, bce: bool) -> Optional[torch.nn.Module]:
    """timm's training loss for label smoothing and --bce-loss (its BCE takes soft targets too), or None for plain
    cross-entropy."""
    # timm is imported only where one of them is asked for: a plain run needs none (an offline install against an
    # existing torch may not have it).
    if bce:
        from timm.loss import BinaryCrossEntropy

        return BinaryCrossEntropy(smoothing=smoothing)
    if smoothing:
        from timm.loss import LabelSmoothingCrossEntropy

        return LabelSmoothingCrossEntropy(smoothing=smoothing)
    return None


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from timm.loss import SoftTargetCrossEntropy

    return SoftTargetCrossEntropy()(logits, targets)


class VAE:
    """Variational autoencoder: reconstruction (binary cross-entropy, summed over pixels) and KL divergence, both
    per sample, reported separately; the loss is their sum. batch: (images in [0, 1], anything)."""
    terms = ("recon", "kl")
    best_metric, best_mode = "val_loss", "min"

    def loss(self, model: torch.nn.Module, batch: Any) -> tuple[dict[str, torch.Tensor], None]:
        images = batch[0]
        recon, mu, logvar = model(images)
        n = images.shape[0]
        target = images.clamp(0.0, 1.0)
        recon_loss = F.binary_cross_entropy(recon.float(), target.float(), reduction="sum") / n
        kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / n
        return {"recon": recon_loss, "kl": kl}, None


TASKS: dict[str, type] = {"classification": Classification, "vae": VAE}
CHOICES = "choose classification or vae"


def find_task(name: str) -> Optional[type]:
    """The task class that ships with this name, or None."""
    return TASKS.get(name)


def builtin_task(name: str) -> "RunTask":
    """A task that ships, ready for the training loop."""
    return RunTask(TASKS[name](), name)


def build_task(factory: Callable[..., Any], name: str, args: dict[str, Any], facts: Optional[dict[str, Any]] = None,
               by_name_only: tuple[str, ...] = ()) -> "RunTask":
    """The task a class (or a factory) makes with the data's facts it names (num_classes, ...) and the --task-args,
    checked (by_name_only: facts from a file, given only where named)."""
    return RunTask(call(factory, facts or {}, args, "--task-args", name, by_name_only), name)


def first_tensor(batch: Any) -> Optional[torch.Tensor]:
    """The batch's first tensor with a batch dimension, depth first through tuples, lists and dicts; or None."""
    if torch.is_tensor(batch):
        return batch if batch.dim() else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    return next((t for t in map(first_tensor, values) if t is not None), None)


def samples_in(batch: Any) -> int:
    """The number of samples in a batch: the length of its first tensor (1 where it holds no batched tensor)."""
    first = first_tensor(batch)
    return first.shape[0] if first is not None else 1


class RunTask:
    """A task as the training loop drives it: step() gives the loss to train and the batch's sums, under the
    names the app reduces and reports (count, loss, each term where there are several, each metric)."""

    def __init__(self, task: Any, name: str) -> None:
        self.task, self.name = task, name
        self.terms = tuple(getattr(task, "terms", ("loss",)))
        self.metrics = tuple(getattr(task, "metrics", ()))
        self.derived = tuple(getattr(task, "derived", ()))
        self.helpers = tuple(getattr(task, "helpers", ()))
        check_task(task, name, self.terms, self.metrics, self.derived, self.helpers)
        self.shapes: dict[str, tuple[int, ...]]
        self.shapes = {}  # each metric sum's shape, from its first batch: every later batch must give the same
        self.best_metric, self.best_mode = task.best_metric, task.best_mode
        # Metrics the task labels for people, shown in percent ({"acc1": "top-1"}); the others by their own names.
        self.shown = {k: v for k, v in dict(getattr(task, "shown", {})).items() if k in self.metrics}
        split = self.terms if self.terms != ("loss",) else ()  # terms reported beside their sum
        self.keys = ("count", "loss") + split + self.metrics

    def epoch_figures(self, means: dict[str, Any]) -> dict[str, Any]:
        """An epoch's means (from hvd_train.tasks.averages) with the task's derived figures added; a metric
        that is a tensor becomes a list (records are JSON)."""
        if self.derived:
            made = self.task.derive(dict(means))
            if not isinstance(made, dict) or set(made) != set(self.derived):
                shown = sorted(made) if isinstance(made, dict) else type(made).__name__
                raise ConfigError(f"--task {self.name}: derive() must return the figures it declares, "
                                  f"{list(self.derived)}; it returned {shown}")
            means.update({k: number(v, f"--task {self.name}: derive()'s {k!r}") for k, v in made.items()})
        return {k: v.tolist() if torch.is_tensor(v) else v for k, v in means.items()}

    def hidden(self) -> set[str]:
        """The record keys of the helpers, kept out of the epoch line, the summary, the curves and the trackers
        (hvd_train.tasks.visible, which leaves out the metrics that are tensors as well)."""
        return {f"{split}_{h}" for split in ("train", "val", "val_ema") for h in self.helpers}

    def samples(self, batch: Any) -> int:
        """The number of samples in a batch."""
        return self.task.samples(batch) if hasattr(self.task, "samples") else samples_in(batch)

    def step(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
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

    def checked_sum(self, name: str, value: Any) -> Union[torch.Tensor, float]:
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

    def check_sums(self, sums: dict[str, Any]) -> None:
        """The one-sample check of a task's figures (hvd_train.training.try_the_metrics): `sums` of one batch, as
        hvd_utils.allreduce_sums hands an epoch's over, made into its figures; a best_metric that is not a number,
        or a derived figure that is not finite, is refused before training."""
        vectors = [k for k, shape in self.shapes.items() if shape]
        best = self.best_metric.split("_", 1)[1]
        if best in vectors:
            raise ConfigError(f"--task {self.name}: best_metric {self.best_metric!r} is a tensor of shape "
                              f"{list(self.shapes[best])}, and best.pt and --stop-at compare numbers; name a "
                              f"derived figure made from it (derived = (...) and derive())")
        try:
            figures = self.epoch_figures(averages(sums))
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


def number(value: Any, what: str) -> float:
    """A derived figure as a float; anything else (a tensor of several values, a string) is refused."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        shown = f"a tensor of shape {list(value.shape)}" if torch.is_tensor(value) else f"a {type(value).__name__}"
        raise ConfigError(f"{what} is {shown}; a derived figure is one number (a helper metric may be a tensor: "
                          f"keep it in metrics and helpers)") from None


def check_task(task: Any, name: str, terms: Sequence[str], metrics: Sequence[str], derived: Sequence[str] = (),
               helpers: Sequence[str] = ()) -> None:
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


def improved(task: "RunTask", value: float, best: Optional[float]) -> bool:
    """Whether `value` of the task's best_metric beats `best` (None: nothing yet)."""
    return best is None or (value > best if task.best_mode == "max" else value < best)


def candidate(task: "RunTask", record: dict[str, Any]) -> tuple[float, str]:
    """(value of the task's best metric, which weights reach it) for an epoch's record: the better of the model's
    and, under --model-ema, its average's ("model" or "ema")."""
    value = record[task.best_metric]
    key = "val_ema_" + task.best_metric[4:] if task.best_metric.startswith("val_") else None
    if key in record and improved(task, record[key], value):
        return record[key], "ema"
    return value, "model"


def reached(task: "RunTask", value: float, target: float) -> bool:
    """Whether `value` of the task's best_metric meets a --stop-at target (0: no target)."""
    return target > 0 and (value >= target if task.best_mode == "max" else value <= target)


def averages(totals: dict[str, Any]) -> dict[str, Any]:
    """Global sums -> per-sample means (a task's loss, its terms and its metrics). With no samples: NaN, count 0."""
    count = totals.get("count", 0.0)
    out = {"count": int(count)}
    out.update({key: value / count if count else value * float("nan") for key, value in totals.items()
                if key != "count"})
    return out


def visible(figures: dict[str, Any], hidden: Collection[str]) -> dict[str, Any]:
    """Figures without the task's helpers (`hidden`: their names, or their record keys) and without the metrics
    that are tensors (lists once made figures) and the ranks' step timing (a dict): what the epoch line, the
    summary, the curves and the trackers show; metrics.jsonl keeps them all."""
    return {k: v for k, v in figures.items() if k not in hidden and not isinstance(v, (list, dict))}
