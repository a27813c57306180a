"""Models beyond images: the text classifier example (examples/text_classifier) as its README runs it. Dict samples
{input_ids, attention_mask, label} go through the default task on 2 ranks under horovodrun and mpirun: the stated
accuracy, a bitwise resume within an epoch, ONNX export with both inputs by name, shards read back; HuggingFace's
BERT through the same plumbing; and the default task's refusals of samples and outputs it cannot take."""
import json
import os
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from conftest import QUIET, ROOT, WORKERS, assert_refused, last_checkpoint, launch, read_json, run_app

FOLDER = ROOT / "examples" / "text_classifier"
RECIPE = ("--config", "text_classifier.yaml", "--trust-code")
SMALL = ("--data-args", "num_train=1024,num_val=256")  # 16 steps an epoch on 2 ranks of 32

# Every test here reads the one trained run, or trains in the example's folder: one worker holds them.
pytestmark = pytest.mark.xdist_group("text_example")


def example():
    """The example's module, imported as the app imports it (its folder on the search path)."""
    if str(FOLDER) not in sys.path:
        sys.path.insert(0, str(FOLDER))
    import text_classifier

    return text_classifier


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The recipe as the README runs it: 2 ranks under horovodrun, 4 epochs."""
    out = tmp_path_factory.mktemp("text") / "run"
    proc = run_app("horovodrun-gloo", 2, *RECIPE, "--output-dir", out, cwd=FOLDER)
    return out, proc


@pytest.mark.distributed
def test_the_text_example_reaches_its_stated_accuracy_on_two_ranks(trained):
    out, proc = trained
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2 and summary["params_in_sync"] and summary["task"] == "classification"
    assert summary["best_val_acc1"] >= 99.0, summary["history"]  # the README's figure
    assert summary["history"][-1]["val_count"] == 1000
    # The default task's metrics by its own names; no augmentation line for tokens.
    assert "val loss" in proc.stdout and "top-1" in proc.stdout
    assert "augmentation:" not in proc.stdout


@pytest.mark.distributed
@pytest.mark.parametrize("fmt", ["onnx", "safetensors"])
def test_the_text_example_exports_with_both_inputs_by_name(trained, tool, fmt, tmp_path):
    out, _ = trained
    target = tmp_path / f"model.{fmt}"
    proc = tool("export", out, "--format", fmt, "--trust-code", "--out", target, cwd=FOLDER)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parity on 16 validation samples of text_classifier:datasets" in proc.stdout, proc.stdout
    assert "top-1 agrees on 16/16" in proc.stdout
    meta = json.loads((tmp_path / f"model.{fmt}.json").read_text())
    free = ["batch", "sequence"] if fmt == "onnx" else ["batch", 16]
    assert meta["inputs"] == [{"name": "input_ids", "shape": free, "dtype": "int64"},
                              {"name": "attention_mask", "shape": free, "dtype": "int64"}]
    if fmt != "onnx":
        return
    # The graph takes another batch size and a shorter sequence, and agrees with the checkpoint's model there.
    import onnxruntime

    tc = example()
    model = tc.model(vocab_size=len(tc.WORDS), num_classes=2, max_len=16)
    model.load_state_dict(torch.load(out / "checkpoints" / "best.pt", weights_only=True)["model"])
    samples = default_collate([tc.Reviews(3, 10, 5, 1, seed=7)[i] for i in range(3)])
    with torch.no_grad():
        expected = model.eval()(samples["input_ids"], samples["attention_mask"])
    session = onnxruntime.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    got = session.run(None, {k: samples[k].numpy() for k in ("input_ids", "attention_mask")})[0]
    assert got.shape == (3, 2)
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-4, rtol=1e-3)


@pytest.mark.distributed
def test_the_text_example_resumes_bitwise_within_an_epoch_under_mpirun(tmp_path):
    # Dropout in every layer, a loader worker per rank; killed (SIGKILL, every rank) right after the checkpoint of
    # run step 20, the 4th of epoch 2's 16.
    common = [*RECIPE, *SMALL, "--workers", "1", "--checkpoint.every_steps", "10", "--epochs", "2", *QUIET]
    launch("mpirun", 2, ROOT / "train_hvd.py", "--output-dir", tmp_path / "straight", *common, cwd=FOLDER)
    killed = launch("mpirun", 2, WORKERS / "killed_after_save.py", "20", "--", "--output-dir", tmp_path / "resumed",
                    *common, check=False, cwd=FOLDER)
    assert killed.returncode != 0
    within = last_checkpoint(tmp_path / "resumed")
    assert (within["step"], within["partial"]["epoch"], within["partial"]["steps"]) == (20, 2, 4)
    proc = launch("mpirun", 2, ROOT / "train_hvd.py", "--output-dir", tmp_path / "resumed", "--resume", "auto",
                  *common, cwd=FOLDER)
    assert "epoch 2 continues after its step 4" in proc.stdout, proc.stdout[-2000:]
    straight, resumed = last_checkpoint(tmp_path / "straight"), last_checkpoint(tmp_path / "resumed")
    for name, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][name]), f"{name} differs after resuming"
    for key, state in straight["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg"], resumed["optimizer"]["state"][key]["exp_avg"])
    history = [read_json(tmp_path / run / "summary.json")["history"] for run in ("straight", "resumed")]
    assert [h["val_loss"] for h in history[0]] == [h["val_loss"] for h in history[1]]


@pytest.mark.distributed
def test_bert_trains_with_the_default_task_resumes_evaluates_and_exports_to_onnx(tmp_path, app, tool, monkeypatch):
    # HuggingFace's BertForSequenceClassification: keyword inputs, an output object with .logits. The recipe's data
    # (4000 reviews); 0.0005 x 2 ranks, constant, as BERT's post-norm layers want a smaller rate than the recipe's.
    common = [*RECIPE, "--model", "text_classifier:bert", "--lr", "0.0005", "--lr-schedule", "constant"]
    run_app("horovodrun-mpi", 2, *common, "--epochs", "1", "--output-dir", tmp_path / "bert", cwd=FOLDER)
    proc = run_app("horovodrun-mpi", 2, *common, "--epochs", "2", "--resume", "auto", "--output-dir",
                   tmp_path / "bert", cwd=FOLDER)
    assert "resuming after epoch 1" in proc.stdout
    summary = read_json(tmp_path / "bert" / "summary.json")
    assert summary["model"] == "text_classifier:bert" and summary["world_size"] == 2
    history = summary["history"]
    assert history[1]["val_loss"] < history[0]["val_loss"] and history[1]["val_acc1"] > 65  # 52% at chance
    # Evaluated and exported by one process (the evaluation of 2 ranks: test_training_app).
    monkeypatch.chdir(FOLDER)
    result = app(*RECIPE, "--model", "text_classifier:bert", "--evaluate", "--resume", "auto", "--output-dir",
                 tmp_path / "bert")
    assert result.returncode == 0, result.stdout + result.stderr
    evaluation = read_json(tmp_path / "bert" / "evaluation.json")
    assert evaluation["epoch"] == 2 and evaluation["count"] == 1000
    last = tmp_path / "bert" / "checkpoints" / "last.pt"
    assert evaluation["loss"] == pytest.approx(history[1]["val_loss"], rel=1e-5)
    out = tool("export", last, "--format", "onnx", "--trust-code")
    assert out.returncode == 0 and "parity on 16 validation samples" in out.stdout, out.stdout + out.stderr
    meta = read_json(tmp_path / "bert" / "export" / "model.onnx.json")
    assert [(i["name"], i["dtype"]) for i in meta["inputs"]] == [("input_ids", "int64"), ("attention_mask", "int64")]


def test_shards_of_the_text_example_hold_no_image_facts_and_train(tmp_path, app, tool, monkeypatch):
    monkeypatch.chdir(FOLDER)
    out = tmp_path / "shards"
    proc = tool("shard", "--from", "text_classifier:datasets", *SMALL, "--out", out, "--shard-size", "256")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "train: 1024 samples in 4 shard(s)" in proc.stdout, proc.stdout + proc.stderr
    facts = read_json(out / "index.json")["facts"]
    assert not {"in_channels", "image_size"} & set(facts), facts  # absent, not null
    assert facts["structure"][0] == "dict" and facts["classes"] == ["negative", "positive"]
    # Read back, a sample is the one written.
    from hvd_train.data.shards import open_sets
    from hvd_train.data.shards import first_batch

    _, val, _ = open_sets(str(out / "train-{000000..000003}.tar"), str(out / "val-000000.tar"))
    written = example().datasets(num_train=1024, num_val=256)[1]
    read = first_batch(val, None, 5)
    expected = default_collate([written[i] for i in range(5)])
    assert all(torch.equal(read[k], expected[k]) for k in expected)
    result = app("--dataset", "shards", "--data.train_shards", str(out / "train-{000000..000003}.tar"),
                 "--data.val_shards", str(out / "val-000000.tar"), "--trust-code", "--model", "text_classifier:model",
                 "--epochs", "1", "--batch-size", "64", "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = read_json(tmp_path / "run" / "summary.json")["history"][0]
    assert record["val_count"] == 256 and record["train_count"] == 1024


# A user's variations on the example: what the default task cannot take is one refusal, before anything is written.
VARIANTS = '''
import torch
from torch import nn

import text_classifier as tc


class Renamed(torch.utils.data.Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        sample = dict(self.base[i])
        sample["target"] = sample.pop("label")
        return sample


def target_key(num_train, num_val):
    train, val, facts = tc.datasets(num_train=num_train, num_val=num_val)
    return Renamed(train), Renamed(val), facts


class Features(nn.Module):
    def __init__(self, vocab_size, num_classes, max_len):
        super().__init__()
        self.inner = tc.model(vocab_size, num_classes, max_len)

    def forward(self, input_ids, attention_mask):
        return {"features": self.inner(input_ids, attention_mask)}


class Flat(Features):
    def forward(self, input_ids, attention_mask):
        return self.inner(input_ids, attention_mask).flatten()
'''


@pytest.mark.parametrize("args,needles", [
    (["--dataset", "variants:target_key"], ["'label' or 'labels' key", "['attention_mask', 'input_ids', 'target']"]),
    (["--model", "variants:Features"], ["returned a dict with keys ['features']", ".logits"]),
    (["--model", "variants:Flat"], ["logits of shape (batch, classes)", "returned [2]"]),
    (["--mixup", "0.5"], ["--mixup mixes images", "are dicts (attention_mask, input_ids, label)"]),
])
def test_what_the_default_task_cannot_take_is_refused_before_anything_is_written(tmp_path, app, monkeypatch,
                                                                                 args, needles):
    (tmp_path / "variants.py").write_text(VARIANTS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", f"{FOLDER}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(FOLDER))
    result = app("--trust-code", "--dataset", "text_classifier:datasets", "--model", "text_classifier:model",
                 "--data-args", "num_train=256,num_val=64", *args, "--output-dir", tmp_path / "run")
    assert_refused(result, *needles)
    assert not (tmp_path / "run").exists()
