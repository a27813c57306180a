"""A user's own project on day one, as a new user meets it: a project folder with data/ and models/ directories, a
lazy plug-in, dict samples through export, the benchmark and shards, 16-bit images, settings that cannot apply or
cannot be reached, evaluate and resume without repeating flags, a wrong --init-from, --freeze with BatchNorm, and a
refused setting under horovodrun without the launcher's traceback."""
import json
import socket

import numpy as np
import pytest
import torch

from conftest import BIN, QUIET, ROOT, launch, read_json
from formats import write_image_folder

from hvd_train.config import parse_config

EXAMPLES = ROOT / "examples"
SHAPES = EXAMPLES / "shapes_segmentation"

LAZY_PROJECT = '''
import sys
import hvd_train
from torch import nn


class LazyNet(nn.Module):
    """The usual way to avoid computing a flattened size: nn.LazyLinear takes it from the first batch."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten())
        self.head = nn.LazyLinear(10)

    def forward(self, x):
        return self.head(self.features(x))


if __name__ == "__main__":
    sys.exit(hvd_train.train(model=LazyNet()))
'''


@pytest.fixture
def project(tmp_path):
    """A user's project folder holding the two most common folder names of ML projects: data/ (their own package,
    which fails if anything imports it) and models/ (a folder of weights, a namespace package to Python)."""
    root = tmp_path / "myproject"
    (root / "data" / "images").mkdir(parents=True)
    (root / "data" / "__init__.py").write_text("raise ImportError('the project's own data package was imported')\n")
    (root / "models").mkdir()
    (root / "models" / "weights.txt").write_text("not a package\n")
    (root / "hostfiles").mkdir()
    (root / "train_lazy.py").write_text(LAZY_PROJECT)
    return root


@pytest.mark.distributed
def test_the_apps_modules_are_not_shadowed_by_a_projects_data_and_models_folders(project, tmp_path):
    # hvd-train, the console script, under horovodrun with a loader worker (started by forkserver).
    proc = launch("horovodrun-gloo", 2, BIN / "hvd-train", *QUIET, "--output-dir", tmp_path / "a", "--epochs", "1",
                  "--workers", "1", cwd=project)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert read_json(tmp_path / "a" / "summary.json")["world_size"] == 2


@pytest.mark.distributed
def test_a_lazy_plug_in_trains_from_a_script_in_such_a_folder_under_mpirun(project, tmp_path):
    # hvd_train.train() from the user's own script, whose folder comes first on the module search path.
    launch("mpirun", 2, project / "train_lazy.py", *QUIET, "--output-dir", tmp_path / "b", "--epochs", "2",
           "--workers", "1", cwd=project)
    summary = read_json(tmp_path / "b" / "summary.json")
    assert summary["params_in_sync"] and summary["world_size"] == 2
    assert summary["history"][-1]["val_acc1"] > summary["history"][0]["val_acc1"] - 5  # it trains
    ckpt = torch.load(tmp_path / "b" / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["model"]["head.weight"].shape == (10, 8 * 8 * 8)  # the lazy layer took its size from the data


# --------------------------------------------------------------------------------------------------------------------
# Dict samples: export, the benchmark and shards take any sample structure the training loop takes


@pytest.fixture(scope="module")
def shapes_run(tmp_path_factory):
    """The segmentation example (dict samples, two outputs) trained one epoch on one process."""
    out = tmp_path_factory.mktemp("shapes") / "run"
    launch("single", 1, ROOT / "train_hvd.py", *QUIET, "--config", "shapes.yaml", "--trust-code", "--epochs", "1",
           "--output-dir", out, cwd=SHAPES)
    return out


@pytest.mark.parametrize("fmt", ["safetensors", "onnx"])
def test_a_model_trained_on_dict_samples_exports_and_passes_its_parity_check(shapes_run, tool, fmt):
    proc = tool("export", shapes_run, "--format", fmt, "--trust-code", "--overwrite", cwd=SHAPES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parity on 16 validation samples of shapes:datasets" in proc.stdout, proc.stdout + proc.stderr
    meta = json.loads(next((shapes_run / "export").glob(f"*.{fmt}.json")).read_text())
    assert meta["input"]["shape"] == ["batch", 1, 32, 32] and meta["parity"]["max_abs_diff"] < 1e-3


def test_predict_on_a_model_of_ones_own_task_says_it_needs_an_image_classifier(shapes_run, tmp_path, tool):
    from PIL import Image

    Image.new("L", (32, 32)).save(tmp_path / "shape.png")
    proc = tool("predict", shapes_run, tmp_path / "shape.png", "--trust-code", cwd=SHAPES)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "needs an image classifier" in proc.stderr and "--task shapes:FindTheRectangle" in proc.stderr, proc.stderr


def test_the_benchmark_times_a_task_whose_batches_are_dicts(tmp_path, app, monkeypatch):
    monkeypatch.chdir(SHAPES)
    result = app("--benchmark", "--model", "shapes:model", "--task", "shapes:FindTheRectangle", "--dataset",
                 "shapes:datasets", "--num-warmup-batches", "1", "--num-iters", "2", "--num-batches-per-iter", "2",
                 "--output-dir", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_json(tmp_path / "summary.json")
    assert summary["mode"] == "benchmark" and summary["img_per_sec_total"] > 0


def test_a_users_data_set_of_dict_samples_becomes_shards_and_trains_from_them(tmp_path, app, tool, monkeypatch):
    monkeypatch.chdir(SHAPES)
    out = tmp_path / "shards"
    proc = tool("shard", "--from", "shapes:datasets", "--data-args", "num_train=96,num_val=32", "--out", out,
                "--shard-size", "40")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "train: 96 samples in 3 shard(s)" in proc.stdout, proc.stdout + proc.stderr
    index = read_json(out / "index.json")
    assert index["facts"]["structure"][0] == "dict" and index["facts"]["transform"] == "samples"
    result = app("--dataset", "shards", "--data.train_shards", str(out / "train-{000000..000002}.tar"),
                 "--data.val_shards", str(out / "val-000000.tar"), "--model", "shapes:model", "--task",
                 "shapes:FindTheRectangle", "--epochs", "1", "--batch-size", "16", "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stdout + result.stderr
    record = read_json(tmp_path / "run" / "summary.json")["history"][0]
    assert record["val_count"] == 32 and np.isfinite(record["val_miou"])


# --------------------------------------------------------------------------------------------------------------------
# Images of any bit depth


def test_a_16_bit_png_is_scaled_not_clipped_to_white(tmp_path):
    from PIL import Image

    from hvd_train.data.folders import read_image
    from hvd_train.data.images import Preprocessing

    ramp = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000)  # 0 to 63000 of 65535
    Image.fromarray(ramp).save(tmp_path / "mask16.png")
    assert Image.open(tmp_path / "mask16.png").mode == "I;16"
    pixels = np.asarray(read_image(str(tmp_path / "mask16.png")))[..., 0]
    assert pixels.min() == 0 and pixels.max() == round(63000 / 257) and len(np.unique(pixels)) == 64
    grey = Preprocessing(1, 8, (0.0,), (1.0,)).load(str(tmp_path / "mask16.png"))
    assert abs(float(grey.max()) - 63000 / 65535) < 0.01


def test_an_image_of_unknown_range_is_refused_by_name(tmp_path):
    from PIL import Image

    from hvd_train.errors import BadSampleError
    from hvd_train.data.folders import read_image

    Image.fromarray(np.ones((4, 4), dtype=np.float32) * 3.5).save(tmp_path / "depth.tiff")
    with pytest.raises(BadSampleError, match=r"depth.tiff: cannot read this image \(a floating-point image"):
        read_image(str(tmp_path / "depth.tiff"))


# --------------------------------------------------------------------------------------------------------------------
# What the data holds is said (bad settings: test_bad_settings.py)


def test_top5_is_reported_only_with_more_than_five_classes_and_a_lonely_class_is_named(tmp_path, app):
    write_image_folder(tmp_path / "photos", per_class=6, size=12)
    (tmp_path / "photos" / "emu").mkdir()
    (tmp_path / "photos" / "emu" / "0.png").write_bytes((tmp_path / "photos" / "owl" / "0.png").read_bytes())
    result = app("--dataset", "imagefolder", "--data-dir", tmp_path / "photos", "--image-size", "12", "--epochs",
                 "1", "--batch-size", "4", "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr
    assert "class(es) emu have fewer than 2 images" in result.stdout
    assert "top-5" not in result.stdout
    record = read_json(tmp_path / "run" / "summary.json")["history"][0]
    assert "val_acc1" in record and "val_acc5" not in record


# --------------------------------------------------------------------------------------------------------------------
# Evaluate and resume take the run's recorded settings


def test_evaluate_and_resume_need_no_flag_again_and_a_changed_one_is_said(tmp_path, app):
    run = tmp_path / "run"
    assert app("--output-dir", run, "--epochs", "2", "--lr", "0.05", "--model-args", "width=8").returncode == 0
    result = app("--output-dir", run, "--evaluate", "--resume", "auto")
    assert result.returncode == 0 and "evaluated" in result.stdout, result.stderr
    result = app("--output-dir", run, "--resume", "auto", "--epochs", "3")
    assert result.returncode == 0, result.stderr
    assert f"optim.epochs: 2 -> 3 (recorded in {run / 'config.json'})" in result.stdout
    assert "the cosine schedule now decays to 0 over 3 epochs" in result.stdout
    config = read_json(run / "config.json")
    assert config["optim"]["lr"] == 0.05 and config["model"]["args"] == {"width": 8}
    # The run's config.json is a recipe too.
    assert parse_config(["--config", str(run / "config.json")]).model.args == {"width": 8}


def test_a_recorded_plug_in_is_code_and_needs_trust_code_or_the_flag(tmp_path, app, monkeypatch):
    (tmp_path / "mynet_recorded.py").write_text(
        "from hvd_train.models.small_cnn import SmallCNN\n\n\n"
        "def net(in_channels, num_classes):\n    return SmallCNN(in_channels, num_classes, 8)\n")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert app("--output-dir", run, "--epochs", "1", "--model", "mynet_recorded:net").returncode == 0
    result = app("--output-dir", run, "--evaluate", "--resume", "auto")
    assert result.returncode == 2 and "model.name='mynet_recorded:net' is an import path" in result.stderr
    assert app("--output-dir", run, "--evaluate", "--resume", "auto", "--trust-code").returncode == 0


# --------------------------------------------------------------------------------------------------------------------
# Fine-tuning


def test_init_from_another_network_is_refused_unless_a_partial_load_is_asked(tmp_path, app):
    from torchvision.models import resnet18

    torch.save(resnet18(num_classes=10).state_dict(), tmp_path / "resnet18.pt")
    result = app("--output-dir", tmp_path / "a", "--epochs", "1", "--init-from", tmp_path / "resnet18.pt")
    assert result.returncode == 2 and "none of its 122 tensors fits this model" in result.stderr, result.stderr
    assert not (tmp_path / "a").exists()  # nothing left behind
    # Three-channel weights of the same network: the first layer is named for what it is, not a head.
    from hvd_train.models.small_cnn import SmallCNN

    other = SmallCNN(in_channels=3, num_classes=4).state_dict()
    torch.save(other, tmp_path / "rgb4.pt")
    result = app("--output-dir", tmp_path / "b", "--epochs", "1", "--init-from", tmp_path / "rgb4.pt")
    assert result.returncode == 0, result.stderr
    assert "features.0.weight [32, 3, 3, 3] -> [32, 1, 3, 3] (3 inputs in the file, 1 here: a first layer for " \
           "another number of input channels)" in result.stdout
    assert "head.4.weight [4, 128] -> [10, 128] (4 outputs in the file, 10 here: a head for another number of " \
           "classes)" in result.stdout
    # Fewer than half fit: refused, and loaded when asked.
    few = {k: v for k, v in other.items() if k.startswith("features.2")}
    torch.save({**few, "features.0.weight": other["features.0.weight"]}, tmp_path / "few.pt")
    result = app("--output-dir", tmp_path / "c", "--epochs", "1", "--init-from", tmp_path / "few.pt")
    assert result.returncode == 2 and "only 2 of the model's 8 tensors fit (fewer than 50%)" in result.stderr
    assert "--model.init_partial" in result.stderr
    result = app("--output-dir", tmp_path / "c", "--epochs", "1", "--init-from", tmp_path / "few.pt",
                 "--model.init_partial")
    assert result.returncode == 0 and "loaded 2 of the model's 8 tensors" in result.stdout, result.stderr


BN_NET = '''
from torch import nn


def net(in_channels, num_classes):
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, num_classes))
'''


@pytest.mark.parametrize("keep_updating", [False, True])
def test_freeze_also_freezes_the_running_statistics_of_frozen_batch_norm(
        tmp_path, app, monkeypatch, keep_updating):
    (tmp_path / "bnnet_freeze.py").write_text(BN_NET)
    monkeypatch.chdir(tmp_path)
    common = ["--model", "bnnet_freeze:net", "--epochs", "1"]
    assert app("--output-dir", tmp_path / "base", *common).returncode == 0
    base = tmp_path / "base" / "checkpoints" / "last.pt"
    flags = ["--model.freeze_bn_stats=false"] if keep_updating else []
    result = app("--output-dir", tmp_path / "tuned", *common, "--init-from", base, "--freeze", "0.*,1.*", *flags)
    assert result.returncode == 0, result.stderr
    before = torch.load(base, weights_only=True)["model"]
    after = torch.load(tmp_path / "tuned" / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert torch.equal(before["1.weight"], after["1.weight"])  # the frozen parameters
    same = torch.equal(before["1.running_mean"], after["1.running_mean"])
    assert same != keep_updating


# --------------------------------------------------------------------------------------------------------------------
# A shard server that is down


def test_a_shard_server_that_is_down_is_named(tmp_path, app):
    from hvd_train.data.shards import FORMAT

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    facts = {"num_classes": 10, "in_channels": 1, "image_size": 8, "transform": "arrays", "mean": [0.0],
             "std": [1.0]}
    index = {"format": FORMAT, "version": 1, "facts": facts, "shards": {"train-000000.tar": 64, "val-000000.tar": 16}}
    (tmp_path / "index.json").write_text(json.dumps(index))
    result = app("--dataset", "shards", "--data.shard_index", tmp_path / "index.json", "--data.train_shards",
                 f"http://127.0.0.1:{port}/train-000000.tar", "--data.val_shards",
                 f"http://127.0.0.1:{port}/val-000000.tar", "--epochs", "1", "--output-dir", tmp_path / "run")
    assert result.returncode == 5, result.stdout + result.stderr
    assert f"the server 127.0.0.1:{port} does not answer" in result.stderr, result.stderr
    assert "(empty file)" not in result.stderr
