"""The default task's batches and outputs (tuples, dicts with a label, HuggingFace-style output objects) and the epoch
line's names for a task's metrics."""
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from hvd_train.engine import format_record
from hvd_train.errors import ConfigError
from hvd_train.tasks import Classification, RunTask, logits_of, split_batch


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
