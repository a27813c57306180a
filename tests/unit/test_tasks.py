"""The default task's batches and outputs (tuples, dicts with a label, HuggingFace-style output objects) and the epoch
line's names for a task's metrics."""
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from hvd_train.trainer import format_record
from hvd_train.errors import ConfigError
from hvd_train.tasks import RunTask
from hvd_train.tasks import Classification, logits_of, split_batch


class Keywords(nn.Module):
    """A model called by keyword, as HuggingFace's are."""

    def __init__(self, out="tensor"):
        super().__init__()
        self.embed, self.head, self.out = nn.Embedding(10, 4), nn.Linear(4, 3), out

    def forward(self, input_ids, attention_mask):
        logits = self.head((self.embed(input_ids) * attention_mask.unsqueeze(-1)).mean(1))
        return {"tensor": logits, "tuple": (logits, None), "object": Output(logits)}[self.out]


@dataclass
class Output:
    logits: torch.Tensor


def text_batch(key="label"):
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 10, (6, 5), generator=g), "attention_mask": torch.ones(6, 5),
            key: torch.randint(0, 3, (6,), generator=g)}


@pytest.mark.parametrize("out", ["tensor", "tuple", "object"])
@pytest.mark.parametrize("key", ["label", "labels"])
def test_dict_samples_go_to_the_model_by_keyword_and_every_output_form_gives_the_same_figures(out, key):
    torch.manual_seed(0)
    model, batch = Keywords(out), text_batch(key)
    task = RunTask(Classification(num_classes=3), "classification")
    loss, sums = task.step(model, batch)
    torch.manual_seed(0)
    reference = Keywords("tensor")(batch["input_ids"], batch["attention_mask"])
    assert loss.item() == pytest.approx(nn.functional.cross_entropy(reference, batch[key]).item())
    hits = (reference.argmax(1) == batch[key]).sum().item()
    assert sums["count"] == 6 and sums["acc1"].item() == pytest.approx(100.0 * hits)


def test_a_tuple_batch_still_takes_inputs_then_classes():
    args, kwargs, labels = split_batch((torch.zeros(2, 3), torch.tensor([0, 1])))
    assert len(args) == 1 and kwargs == {} and labels.tolist() == [0, 1]


@pytest.mark.parametrize("batch,needle", [
    ({"input_ids": torch.zeros(2, 3), "target": torch.zeros(2)}, "samples have keys ['input_ids', 'target']"),
    ((torch.zeros(2, 3),), "the samples are a tuple of 1"),
    (torch.zeros(2, 3), "the samples are a Tensor"),
])
def test_a_batch_without_classes_is_refused_naming_what_it_holds(batch, needle):
    with pytest.raises(ConfigError, match="classification task") as e:
        split_batch(batch)
    assert needle in str(e.value)


@pytest.mark.parametrize("output,needle", [
    ({"features": torch.zeros(2, 3)}, "a dict with keys ['features']"),
    ([], "a list"),
    ("logits", "a str"),
])
def test_an_output_without_logits_is_refused_naming_what_it_is(output, needle):
    with pytest.raises(ConfigError, match=".logits") as e:
        logits_of(output)
    assert needle in str(e.value)


def test_the_epoch_line_names_metrics_as_the_task_does():
    train, val = {"count": 8, "loss": 0.5, "acc1": 75.0}, {"count": 4, "loss": 0.25, "acc1": 50.0}
    record = {"lr": 0.1, "samples_per_sec": 100.0, "epoch_seconds": 1.0}
    # The default task shows its accuracy as top-1, in percent; a task of one's own that calls a metric acc1 sees acc1.
    shown = RunTask(Classification(num_classes=3), "classification").shown
    assert "top-1 75.00%" in format_record(1, 2, train, val, record, shown)
    mine = format_record(1, 2, train, val, record, {})
    assert "acc1 75.0000" in mine and "top-1" not in mine


class Confusion:
    """Per-class counts as a helper, the mean of their ratios derived from them."""
    metrics, helpers, derived = ("confusion", "hits"), ("confusion",), ("mean_recall",)
    best_metric, best_mode = "val_mean_recall", "max"

    def loss(self, model, batch):
        return {"loss": batch[0].mean()}, batch[0]

    def metric_sums(self, outputs, batch):
        classes = batch[1]
        confusion = torch.bincount(classes * 2 + (outputs[:, 0] > 0).long(), minlength=4).view(2, 2)
        return {"confusion": confusion, "hits": (confusion.diagonal().sum())}

    def derive(self, means):
        return {"mean_recall": (means["confusion"].diagonal() / means["confusion"].sum(dim=1)).mean()}


def test_a_tensor_sum_is_added_whole_derived_from_and_kept_out_of_sight():
    from hvd_train.tasks import averages
    from hvd_train.tasks import visible

    task = RunTask(Confusion(), "mine:Confusion")
    batches = [(torch.tensor([[1.0], [-1.0], [2.0]]), torch.tensor([1, 0, 0])),
               (torch.tensor([[-3.0]]), torch.tensor([1]))]
    sums = [task.step(None, b)[1] for b in batches]
    total = {k: torch.as_tensor(sums[0][k], dtype=torch.float64) + torch.as_tensor(sums[1][k]) for k in sums[0]}
    figures = task.epoch_figures(averages({k: float(v) if v.dim() == 0 else v for k, v in total.items()}))
    # truth 0: one right, one wrong; truth 1: one right, one wrong
    assert figures["confusion"] == [[0.25, 0.25], [0.25, 0.25]] and figures["mean_recall"] == 0.5
    record = {"epoch": 1, **{f"val_{k}": v for k, v in figures.items()}}
    assert set(visible(record, task.hidden())) == {"epoch", "val_count", "val_loss", "val_hits", "val_mean_recall"}
    line = format_record(1, 1, figures, figures, {"lr": 0.1, "samples_per_sec": 1.0, "epoch_seconds": 1.0},
                         helpers=task.helpers)
    assert "confusion" not in line and "mean_recall 0.5000" in line


def test_a_sum_whose_shape_changes_with_the_batch_is_refused_naming_both_shapes():
    task = RunTask(Confusion(), "mine:Confusion")
    task.shapes["confusion"] = (3, 3)
    with pytest.raises(ConfigError, match=r"'confusion' has shape \[2, 2\] on one batch and \[3, 3\] on another"):
        task.step(None, (torch.tensor([[1.0]]), torch.tensor([1])))


def test_a_helper_that_is_no_metric_or_the_best_metric_is_refused():
    class Stray(Confusion):
        helpers = ("confusion", "recall")

    class HiddenBest(Confusion):
        best_metric = "val_confusion"

    with pytest.raises(ConfigError, match=r"helpers \['recall'\] are not among its metrics"):
        RunTask(Stray(), "mine:Stray")
    with pytest.raises(ConfigError, match="best_metric 'val_confusion' is not a metric it reports"):
        RunTask(HiddenBest(), "mine:HiddenBest")


def test_a_checkpoint_within_an_epoch_carries_tensor_sums_to_another_number_of_ranks():
    from hvd_train.run.state import RunState

    state = RunState()
    state.partial = {"epoch": 2, "steps": 3, "world_size": 2,
                     "sums": [{"count": 4.0, "confusion": [[1.0, 2.0], [3.0, 4.0]]},
                              {"count": 2.0, "confusion": [[0.0, 1.0], [0.0, 1.0]]}]}
    steps, sums = state.carried(2, 0, 1)
    assert steps == 3 and float(sums["count"]) == 6.0
    assert torch.equal(torch.as_tensor(sums["confusion"]), torch.tensor([[1.0, 3.0], [3.0, 5.0]], dtype=torch.float64))


def test_numpy_sums_add_as_tensors_and_other_objects_are_refused():
    import numpy as np

    class NumPySums(Confusion):
        metrics, helpers, derived, best_metric = ("hits",), (), (), "val_loss"

        def metric_sums(self, outputs, batch):
            return {"hits": np.float64(outputs.shape[0]) if outputs.shape[0] else "two"}

    task = RunTask(NumPySums(), "mine:NumPySums")
    _, sums = task.step(None, (torch.tensor([[1.0], [2.0]]), torch.tensor([0, 1])))
    assert torch.is_tensor(sums["hits"]) and float(sums["hits"]) == 2.0
    with pytest.raises(ConfigError, match="'hits' is a str; return a tensor"):
        task.step(None, (torch.zeros(0, 1), torch.zeros(0, dtype=torch.long)))
