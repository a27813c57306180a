"""Your model, your data, your task: plug-ins by import path, timm's models by name, and the examples/ projects
trained as their READMEs say, with real 2-rank launches."""
import inspect
import json
import math
import sys
import textwrap

import pytest
import torch

from conftest import QUIET, ROOT, assert_refused, launch, read_json, run_app
from conftest import elastic_run_losing_a_worker

EXAMPLES = ROOT / "examples"

# A user's project, as tests write it into the working directory of the run.
PLUGS = '''
import os

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset


def net(in_channels, num_classes, image_size, hidden=16):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))


def notamodel(num_classes):
    return 3


def blobs(data_dir, seed, count=96):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(count) % 3
    points = torch.randn(count, 2, generator=gen) * 0.3 + labels[:, None].float()
    return TensorDataset(points, labels), None, {"num_classes": 3, "features": 2}


def mlp(features, num_classes):
    return nn.Linear(features, num_classes)


def fetched(data_dir, seed):
    """blobs, as many as the file --download wrote says."""
    with open(os.path.join(data_dir, "count.txt")) as f:
        return blobs(data_dir, seed, count=int(f.read()))


def _fetch(data_dir):
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, "count.txt"), "w") as f:
        f.write("60")


fetched.download = _fetch


class View(Dataset):
    """Sample i is (i, 1) in the training view and (i, 0) in the evaluation view."""
    def __init__(self, train):
        self.train = train

    def __len__(self):
        return 50

    def __getitem__(self, i):
        return torch.tensor([float(i), float(self.train)]), i % 2


def views():
    return View(True), View(False), {"num_classes": 2, "held_out": True}


class Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(2), 0


def streamed():
    return Stream(), Stream(), {"num_classes": 3}


def lonely():
    return TensorDataset(torch.zeros(4, 2))


class NoBest:
    def loss(self, model, batch):
        return {"loss": model(batch[0]).sum()}, None


class WrongBest(NoBest):
    best_metric, best_mode = "val_iou", "max"


class Hits:
    """Classification of the blobs with a metric of one's own, in the forms a user gets wrong (per_sample)."""
    metrics = ("hits",)
    best_metric, best_mode = "val_loss", "min"

    def __init__(self, form="per_sample"):
        self.form = form

    def loss(self, model, batch):
        logits = model(batch[0])
        return {"loss": torch.nn.functional.cross_entropy(logits, batch[1])}, logits

    def metric_sums(self, logits, batch):
        hits = (logits.argmax(dim=1) == batch[1]).double()
        return {"hits": {"per_sample": hits, "list": hits.tolist()}[self.form]}


class Ratio(Hits):
    derived = ("misses_per_hit",)

    def metric_sums(self, logits, batch):
        return {"hits": torch.zeros(())}

    def derive(self, means):
        return {"misses_per_hit": (1 - torch.tensor(means["hits"])) / means["hits"]}
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder holding the user's plug-ins module `plugs`, made the working directory (as a user launches from
    their project)."""
    (tmp_path / "plugs.py").write_text(PLUGS)
    (tmp_path / "broken.py").write_text("import torch\nraise RuntimeError('the config server is down')\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("args,needles", [
    (["--model", "nosuch_module:net"], ["--model='nosuch_module:net'", "cannot import nosuch_module",
                                        "ModuleNotFoundError"]),
    (["--model", "broken:net"], ["cannot import broken", "RuntimeError: the config server is down", "broken.py:2"]),
    (["--model", "plugs:nett"], ["plugs", "has no 'nett'", "it defines:", "notamodel"]),
    (["--model", "plugs"], ["--model='plugs' is not known", "package.module:name"]),
    (["--model", "plugs:net", "--model-args", "depth=3"],
     ["--model-args", "takes no argument 'depth'", "in_channels, num_classes, image_size, hidden"]),
    (["--model", "small_cnn", "--model-args", "depth=3"], ["takes no argument 'depth'", "width"]),
    (["--model", "timm/no_such_net"], ["--model='timm/no_such_net' is not known", "timm/NAME"]),
    (["--model", "plugs:notamodel"], ["--model='plugs:notamodel'", "returned a int, not a torch.nn.Module"]),
    (["--dataset", "plugs:blobs"], ["small_cnn needs 'in_channels'", "features=2", "--model-args"]),
    (["--dataset", "plugs:streamed", "--model", "plugs:mlp"], ["training set (Stream) has no __len__", "map-style"]),
    (["--dataset", "plugs:lonely"], ["must return (train, val) or (train, val, facts)", "TensorDataset"]),
    (["--dataset", "digits", "--data-args", "count=3"], ["--data-args", "your own data set factory"]),
    (["--task", "plugs:NoBest"], ["--task plugs:NoBest", "declares no best_metric", "val_loss"]),
    (["--task", "plugs:WrongBest"], ["best_metric 'val_iou' is not a metric it reports", "val_loss, train_loss"]),
    (["--task", "plugs:NoBest", "--task-args", "weight=2"], ["takes no argument 'weight'"]),
    # Metric sums that cannot be added over batches and ranks, and a derived figure that is not finite, are refused
    # before training, from one training sample and from two (not after an epoch, in a stack error).
    (["--task", "plugs:Hits", "--dataset", "plugs:blobs", "--model", "plugs:mlp"],
     ["--task plugs:Hits", "'hits' has shape [2] on one batch and [1] on another", ".sum(dim=0)"]),
    (["--task", "plugs:Hits", "--task-args", "form=list", "--dataset", "plugs:blobs", "--model", "plugs:mlp"],
     ["'hits' is a list", "return a tensor (of any fixed shape) or a number"]),
    (["--task", "plugs:Ratio", "--dataset", "plugs:blobs", "--model", "plugs:mlp"],
     ["derive() gave misses_per_hit=inf on one training sample", "must be finite"]),
])
def test_a_bad_plugin_gets_one_message_before_training(project, app, args, needles):
    result = app("--output-dir", project / "run", *args)
    assert_refused(result, *needles)
    assert "epoch 1/" not in result.stdout
    assert not (project / "run").exists(), "a refused plug-in left a new output folder behind"


def test_a_users_model_and_data_set_train_with_the_facts_they_name(project, app):
    """blobs gives (features, num_classes) and no validation set: the app splits it (20%) and mlp gets both."""
    result = app("--output-dir", project / "run", "--dataset", "plugs:blobs", "--data-args", "count=120",
                 "--model", "plugs:mlp", "--epochs", "2", "--batch-size", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    # The factory's call as the app made it, --seed's default and --data-args by name.
    assert "data plugs:blobs(data_dir='datasets', seed=42, count=120): 96 train / 24 val samples (num_classes 3, " \
           "features 2)" in result.stdout, result.stdout
    summary = read_json(project / "run" / "summary.json")
    assert summary["model"] == "plugs:mlp" and summary["dataset"] == "plugs:blobs"
    assert summary["task"] == "classification" and summary["history"][-1]["val_count"] == 24


def test_a_users_data_set_is_fetched_by_download_and_split_across_two_views(project, app, monkeypatch):
    """The two hooks the data sets that ship use (data/catalog.py) work for a user's: download(data_dir) runs for
    --download; held_out cuts a training view and an evaluation view of the same samples by --data.val_fraction."""
    result = app("--output-dir", project / "run", "--dataset", "plugs:fetched", "--download", "--data-dir",
                 project / "data", "--model", "plugs:mlp", "--epochs", "1", "--batch-size", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "48 train / 12 val samples" in result.stdout and (project / "data" / "count.txt").read_text() == "60"

    from hvd_train.config import DataConfig
    from hvd_train.data import build_datasets

    monkeypatch.setattr(sys, "path", list(sys.path))  # the import of plugs below adds the project to the path
    monkeypatch.delitem(sys.modules, "plugs", raising=False)
    train, val, info = build_datasets(DataConfig(dataset="plugs:views"))
    monkeypatch.delitem(sys.modules, "plugs")
    trained, evaluated = [[sample.tolist() for sample, _ in split] for split in (train, val)]
    assert (len(trained), len(evaluated), info.num_val) == (40, 10, 10)
    assert {flag for _, flag in trained} == {1.0} and {flag for _, flag in evaluated} == {0.0}
    assert sorted(i for i, _ in trained + evaluated) == [float(i) for i in range(50)]


def test_resuming_with_another_plugin_is_refused_with_the_setting_named(project, app):
    common = ["--output-dir", project / "run", "--dataset", "plugs:blobs", "--model", "plugs:mlp",
              "--batch-size", "8"]
    assert app(*common, "--epochs", "1").returncode == 0
    (project / "other.py").write_text("from plugs import mlp as other_mlp\n")
    result = app(*common[:4], "--model", "other:other_mlp", "--batch-size", "8", "--epochs", "2", "--resume", "auto")
    assert_refused(result, "model_name='plugs:mlp'", "model_name='other:other_mlp'", "(--model)")


def test_timm_models_are_built_by_name_for_the_data(tmp_path, app):
    result = app("--output-dir", tmp_path / "run", "--model", "timm/resnet10t", "--dataset", "synthetic",
                 "--image-size", "32", "--data.synthetic_samples", "32", "--batch-size", "8", "--epochs", "1",
                 "--model-args", "drop_rate=0.1")
    assert result.returncode == 0, result.stdout + result.stderr
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["model_name"] == "timm/resnet10t" and ckpt["model"]["fc.weight"].shape == (10, 512)
    assert ckpt["config"]["model"]["args"] == {"drop_rate": 0.1}


def resume_matches_straight(launcher, folder, recipe, tmp_path, *args):
    """The example's recipe trained 2 epochs straight, and 1 epoch then resumed to 2, from the example's folder as
    its README says: the same weights, bit for bit, and the same records. Returns the straight run's summary."""
    common = ["--config", recipe, "--trust-code", "--lr-schedule", "constant", *args]
    run_app(launcher, 2, "--output-dir", tmp_path / "straight", "--epochs", "2", *common, cwd=folder)
    run_app(launcher, 2, "--output-dir", tmp_path / "resumed", "--epochs", "1", *common, cwd=folder)
    proc = run_app(launcher, 2, "--output-dir", tmp_path / "resumed", "--epochs", "2", "--resume", "auto", *common,
                   cwd=folder)
    assert "resuming after epoch 1" in proc.stdout, proc.stdout
    straight, resumed = (torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True)
                         for name in ("straight", "resumed"))
    for name, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][name]), f"{name} differs after resuming"
    summary = read_json(tmp_path / "straight" / "summary.json")
    assert read_json(tmp_path / "resumed" / "summary.json")["history"][1]["val_loss"] == \
        summary["history"][1]["val_loss"]
    assert summary["world_size"] == 2 and summary["params_in_sync"]
    return summary


@pytest.mark.distributed
@pytest.mark.extended
def test_the_segmentation_example_trains_its_two_losses_and_resumes_exactly(tmp_path):
    # 127 validation samples: 64 on one rank, 63 on the other.
    summary = resume_matches_straight("horovodrun-gloo", EXAMPLES / "shapes_segmentation", "shapes.yaml", tmp_path,
                                      "--data-args", "image_size=32,num_train=512,num_val=127", "--seed", "7")
    history = summary["history"]
    for record in history:
        for key in ("loss", "mask", "box", "miou", "box_iou"):
            assert math.isfinite(record[f"train_{key}"]) and math.isfinite(record[f"val_{key}"]), (key, record)
        assert record["train_loss"] == pytest.approx(record["train_mask"] + record["train_box"], rel=1e-6)
        assert record["val_count"] == 127 and record["train_count"] == 512
        assert "val_confusion" not in record  # a helper: in metrics.jsonl only
    assert history[-1]["val_loss"] < history[0]["val_loss"]
    assert summary["task"] == "shapes:FindTheRectangle" and summary["best_metric"] == "val_miou"
    assert summary["best_value"] == max(h["val_miou"] for h in history)
    assert set(summary["final_val"]) == {"loss", "mask", "box", "miou", "box_iou"}
    # The mIoU the two ranks reported from their summed confusion matrices is the one a single process computes
    # over the same validation set with the same weights.
    last = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()][-1]
    confusion, miou = one_process_miou(tmp_path / "straight", num_val=127, seed=7)
    assert torch.equal(torch.tensor(last["val_confusion"], dtype=torch.float64) * 127, confusion)
    assert abs(last["val_miou"] - miou) <= 1e-9
    assert last["val_miou"] == history[-1]["val_miou"]


def one_process_miou(run, num_val, seed):
    """(pixel confusion matrix, mIoU) of the segmentation example over its whole validation set, in this process,
    with the weights of `run`'s last checkpoint."""
    sys.path.insert(0, str(EXAMPLES / "shapes_segmentation"))
    try:
        import shapes

        _, val, facts = shapes.datasets(image_size=32, num_train=512, num_val=num_val, seed=seed)
        model = shapes.model(facts["in_channels"], facts["image_size"])
        model.load_state_dict(torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"])
        model.eval()
        confusion = torch.zeros(2, 2, dtype=torch.float64)
        with torch.no_grad():
            for start in range(0, len(val), 32):
                batch = torch.utils.data.default_collate([val[i] for i in range(start, min(start + 32, len(val)))])
                predicted, truth = (model(batch["image"])["mask"] > 0).long(), (batch["mask"] > 0.5).long()
                confusion += shapes.confusion_matrix(predicted, truth, 2)
        return confusion, float(shapes.mean_iou(confusion))
    finally:
        sys.path.remove(str(EXAMPLES / "shapes_segmentation"))
        sys.modules.pop("shapes", None)


@pytest.mark.distributed
def test_the_language_model_example_reports_perplexity_and_resumes_exactly(tmp_path):
    summary = resume_matches_straight("mpirun", EXAMPLES / "char_lm", "char_lm.yaml", tmp_path, "--data-args",
                                      "stride=16")
    for record in summary["history"]:
        assert record["val_ppl"] == pytest.approx(math.exp(record["val_loss"]), rel=1e-9)
        assert record["train_ppl"] == pytest.approx(math.exp(record["train_loss"]), rel=1e-9)
    # Better than a uniform guess over the characters of the text after one epoch, and better still after two.
    vocab = len(set(inspect.getsource(textwrap)))
    first, last = summary["history"][0], summary["history"][-1]
    assert last["val_loss"] < first["val_loss"] < math.log(vocab)
    assert summary["best_metric"] == "val_loss" and set(summary["final_val"]) == {"loss", "ppl"}


@pytest.mark.distributed
def test_the_language_model_example_survives_a_lost_worker_in_elastic_mode(tmp_path):
    """horovodrun --min-np 1 on two "hosts" (localhost and 127.0.0.1); the worker of one is killed in epoch 2, and
    the user's model, data and task finish on the other from the last commit."""
    elastic_run_losing_a_worker(tmp_path, "--config", "char_lm.yaml", "--trust-code", "--data-args", "stride=16",
                                "--output-dir", tmp_path / "run", cwd=EXAMPLES / "char_lm")
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["world_size"] == 1 and summary["elastic"]["resets"] >= 1
    assert summary["task"] == "char_lm:NextCharacter"
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3]
    assert all(h["val_ppl"] == pytest.approx(math.exp(h["val_loss"]), rel=1e-9) for h in summary["history"])


USERS_SCRIPT = '''
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import hvd_train


class Regression:
    metrics = ("abs_err",)
    best_metric, best_mode = "val_abs_err", "min"

    def loss(self, model, batch):
        inputs, targets = batch
        predicted = model(inputs).squeeze(1)
        return {"loss": nn.functional.mse_loss(predicted, targets)}, predicted

    def metric_sums(self, predicted, batch):
        return {"abs_err": (predicted - batch[1]).abs().sum()}


if __name__ == "__main__":
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(320, 3, generator=gen)
    targets = inputs @ torch.tensor([1.0, -2.0, 0.5]) + 0.1
    sys.exit(hvd_train.train(model=nn.Linear(3, 1), train_set=TensorDataset(inputs, targets), task=Regression()))
'''


@pytest.mark.distributed
def test_a_users_own_script_gets_the_app_through_the_python_api(tmp_path):
    """A script that builds its model, data and task and calls hvd_train.train(), launched by horovodrun on 2 ranks;
    the settings come from its command line, and --resume auto continues it."""
    script = tmp_path / "my_train.py"
    script.write_text(USERS_SCRIPT)
    common = [*QUIET, "--output-dir", tmp_path / "run", "--batch-size", "16", "--lr", "0.05", "--lr-schedule",
              "constant"]
    launch("horovodrun-gloo", 2, script, *common, "--epochs", "1", cwd=tmp_path)
    proc = launch("horovodrun-gloo", 2, script, *common, "--epochs", "3", "--resume", "auto", cwd=tmp_path)
    assert "resuming after epoch 1" in proc.stdout, proc.stdout
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["model"] == "torch.nn.modules.linear:Linear" and summary["task"] == "__main__:Regression"
    assert summary["world_size"] == 2 and summary["params_in_sync"]
    history = summary["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3] and all(h["val_count"] == 64 for h in history)
    assert history[-1]["val_abs_err"] < history[0]["val_abs_err"]
    assert summary["best_metric"] == "val_abs_err" and summary["best_value"] == min(h["val_abs_err"] for h in history)
