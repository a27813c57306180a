"""What a model is trained to do: its loss terms, its metrics, and which metric is best.

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

`batch` is whatever the data set's samples collate to (a tuple, a dict of tensors), already on the device. The
app multiplies each term by the batch's samples and adds the metric sums over batches and ranks; one division by
the number of samples at the end of an epoch gives exact means (hvd_train.run.best), whatever the shard sizes. A
metric sum may be a tensor of any fixed shape (per-class intersections, a confusion matrix): it is added and
divided as a whole, derive() gets it as a float64 tensor (means["count"] times it gives the sums back), and the
records hold it as a list, in metrics.jsonl only. A batch's samples are the length of its first tensor unless the
task has a `samples(batch)` method.
The two tasks that ship, classification and the VAE, are written against this same interface.
"""
import torch
import torch.nn.functional as F

from hvd_train.errors import ConfigError
from hvd_train.plugins import call
from hvd_train.run_task import RunTask


# The keys of a dict sample that hold its class, as HuggingFace's data sets and models name them.
LABEL_KEYS = ("label", "labels")


class Classification:
    """Cross-entropy on logits; top-1 and top-5 accuracy in percent (top-5 only with more than 5 classes, where it
    is not always 100%). batch: (inputs, class indices), or (mixed inputs, class indices, soft targets) under
    mixup/CutMix (hvd_train/regularize.py), whose accuracy counts against each input's own class; or a dict whose
    "label" (or "labels") holds the classes and whose other keys the model takes by keyword, as HuggingFace's
    models do. The model returns the logits, a tuple whose first item they are, or an object with .logits.

    Training follows timm's train.py: soft targets -> SoftTargetCrossEntropy, label smoothing ->
    LabelSmoothingCrossEntropy, and BinaryCrossEntropy for either with --bce-loss; evaluation (the model in eval
    mode) always reports plain cross-entropy, so validation losses compare across recipes."""
    metrics = ("acc1", "acc5")
    best_metric, best_mode = "val_acc1", "max"
    percent = ("acc1", "acc5")  # metrics in percent: a --stop-at above 100 can never be reached
    shown = {"acc1": "top-1", "acc5": "top-5"}  # what the epoch line and the summary call them

    def __init__(self, num_classes=None, smoothing=0.0, bce_loss=False):
        if num_classes is not None and num_classes <= 5:
            self.metrics = ("acc1",)
        self.train_loss, self.bce = training_loss(smoothing, bce_loss), bce_loss

    def loss(self, model, batch):
        args, kwargs, labels = split_batch(batch)
        logits = logits_of(model(*args, **kwargs))
        mixed = not isinstance(batch, dict) and len(batch) > 2
        if model.training and mixed:  # mixed: the targets carry the smoothing already
            return {"loss": (self.train_loss if self.bce else soft_cross_entropy)(logits, batch[2])}, logits
        if model.training and self.train_loss is not None:
            return {"loss": self.train_loss(logits, labels)}, logits
        return {"loss": F.cross_entropy(logits, labels)}, logits

    def metric_sums(self, logits, batch):
        labels = split_batch(batch)[2]
        # One topk serves both accuracies: its first column is the argmax.
        hits = logits.topk(min(5, logits.shape[1]), dim=1).indices == labels.unsqueeze(1)
        sums = {"acc1": 100.0 * hits[:, 0].sum(), "acc5": 100.0 * hits.any(dim=1).sum()}
        return {k: sums[k] for k in self.metrics}


def split_batch(batch):
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


def logits_of(output):
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


def training_loss(smoothing, bce):
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


def soft_cross_entropy(logits, targets):
    from timm.loss import SoftTargetCrossEntropy

    return SoftTargetCrossEntropy()(logits, targets)


class VAE:
    """Variational autoencoder: reconstruction (binary cross-entropy, summed over pixels) and KL divergence, both
    per sample, reported separately; the loss is their sum. batch: (images in [0, 1], anything)."""
    terms = ("recon", "kl")
    best_metric, best_mode = "val_loss", "min"

    def loss(self, model, batch):
        images = batch[0]
        recon, mu, logvar = model(images)
        n = images.shape[0]
        target = images.clamp(0.0, 1.0)
        recon_loss = F.binary_cross_entropy(recon.float(), target.float(), reduction="sum") / n
        kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / n
        return {"recon": recon_loss, "kl": kl}, None


TASKS = {"classification": Classification, "vae": VAE}
CHOICES = "choose classification or vae"


def find_task(name):
    """The task class that ships with this name, or None."""
    return TASKS.get(name)


def builtin_task(name):
    """A task that ships, ready for the training loop."""
    return RunTask(TASKS[name](), name)


def build_task(factory, name, args, facts=None, by_name_only=()):
    """The task a class (or a factory) makes with the data's facts it names (num_classes, ...) and the --task-args,
    checked (by_name_only: facts from a file, given only where named)."""
    return RunTask(call(factory, facts or {}, args, "--task-args", name, by_name_only), name)
