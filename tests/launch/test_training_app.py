"""train_hvd.py's features end to end, as users run them: 2 ranks under horovodrun or mpirun, or one process."""
import json
import re
import shlex
import subprocess

import pytest
import torch

from conftest import QUIET, ROOT, TRAIN, job_env, last_checkpoint, launch, launch_command, read_json, train_here
from formats import (write_cifar10, write_cifar100_binary, write_cifar_python, write_desktop_litter,
                     write_image_folder, write_mnist, write_stl10)


@pytest.mark.distributed
def test_checkpoints_hold_everything_and_evaluate_reproduces_the_validation(tmp_path):
    out = tmp_path / "run"
    launch("horovodrun-gloo", 2, TRAIN, "--output-dir", out, "--epochs", "3", "--checkpoint.keep_last", "2", *QUIET)
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["best.pt", "epoch_0002.pt", "epoch_0003.pt", "last.pt"]
    ckpt = last_checkpoint(out)
    for key in ("model", "optimizer", "scaler", "epoch", "step", "best_metric", "config", "rng"):
        assert key in ckpt, key
    assert len(ckpt["rng"]) == 2 and ckpt["config"]["optim"]["epochs"] == 3
    summary = read_json(out / "summary.json")
    best = torch.load(summary["best_checkpoint"], weights_only=True)
    assert best["epoch"] == summary["best_epoch"] and best["best_metric"] == summary["best_value"]

    launch("mpirun", 2, TRAIN, "--output-dir", tmp_path / "eval", "--evaluate", "--resume",
           out / "checkpoints" / "last.pt")
    evaluation = read_json(tmp_path / "eval" / "evaluation.json")
    last = summary["history"][-1]
    assert evaluation["count"] == 359 and evaluation["epoch"] == 3
    assert evaluation["acc1"] == pytest.approx(last["val_acc1"]) and evaluation["loss"] == pytest.approx(
        last["val_loss"], rel=1e-6)


@pytest.mark.distributed
def test_a_non_finite_loss_stops_every_rank_together(tmp_path):
    proc = launch("horovodrun-gloo", 2, TRAIN, "--output-dir", tmp_path, "--lr", "1e12", "--logging.log_every", "5",
                  *QUIET, check=False)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert output.count("the loss became NaN or infinite") == 1, output[-3000:]
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.distributed
def test_a_run_that_diverges_but_stays_finite_stops_every_rank_together(tmp_path):
    # Adam at a rate of 10 drives the digits' loss to ~1e7 within the first epoch, finite all along.
    proc = launch("mpirun", 2, TRAIN, "--output-dir", tmp_path / "out", "--optimizer", "adam", "--lr", "10",
                  "--epochs", "3", *QUIET, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 3 or "Exit code: 3" in output, output[-3000:]
    lines = [line for line in output.splitlines() if "training diverged" in line]
    assert len(lines) == 1 and "the train loss of epoch 1" in lines[0] and "--run.divergence_factor 0" in lines[0]
    assert not (tmp_path / "out" / "summary.json").exists()
    assert not (tmp_path / "out" / "checkpoints" / "last.pt").exists()


def test_the_divergence_rule_can_be_turned_off(tmp_path, app):
    result = app("--output-dir", tmp_path / "out", "--optimizer", "adam", "--lr", "10", "--epochs", "1",
                 "--run.divergence_factor", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_json(tmp_path / "out" / "summary.json")["history"][0]["train_loss"] > 1000


@pytest.mark.distributed
def test_vae_reports_reconstruction_and_kl_reduced_over_ranks(tmp_path):
    write_mnist(tmp_path / "data", n_train=96, n_test=40)
    launch("horovodrun-mpi", 2, TRAIN, "--output-dir", tmp_path / "out", "--config",
           ROOT / "configs" / "mnist_vae.yaml", "--data-dir", tmp_path / "data", "--epochs", "2", "--batch-size", "16",
           *QUIET)
    summary = read_json(tmp_path / "out" / "summary.json")
    assert summary["task"] == "vae" and summary["config_name"] == "mnist_vae" and summary["best_metric"] == "val_loss"
    for record in summary["history"]:
        assert record["val_count"] == 40
        assert record["val_loss"] == pytest.approx(record["val_recon"] + record["val_kl"], rel=1e-6)
        assert record["train_recon"] > 0 and record["train_kl"] >= 0
    assert summary["history"][1]["train_loss"] < summary["history"][0]["train_loss"]


@pytest.mark.distributed
def test_torchvision_resnet_on_cifar10_files_with_every_precision_and_horovod_option(tmp_path):
    write_cifar10(tmp_path / "data", per_batch=16, n_test=12)
    launch("horovodrun-gloo", 2, TRAIN, "--output-dir", tmp_path / "out", "--dataset", "cifar10", "--data-dir",
           tmp_path / "data", "--model", "resnet18", "--image-size", "16", "--epochs", "2", "--batch-size", "4",
           "--optimizer", "adamw", "--lr", "0.001", "--amp", "bf16", "--clip-grad", "1.0",
           "--batches-per-allreduce", "2", "--fp16-allreduce", "--warmup-epochs", "1", "--lr-schedule",
           "exponential", *QUIET)
    summary = read_json(tmp_path / "out" / "summary.json")
    assert summary["params_in_sync"] and summary["global_batch_size"] == 4 * 2 * 2
    assert summary["lr"] == pytest.approx(0.001 * 4)
    assert all(h["val_count"] == 12 and h["train_loss"] == h["train_loss"] for h in summary["history"])


def litter_around(root):
    write_image_folder(root, per_class=10, size=12)  # 30 images: 6 held out, 24 for training (12 per rank)
    write_desktop_litter(root)


# Each layout as its publisher writes it: (data set, writer, samples for training and validation, extra flags).
LAYOUTS = {
    "cifar10-python": ("cifar10", lambda d: write_cifar_python(d, per_batch=8, n_test=10), (40, 10), []),
    "cifar10-binary": ("cifar10", lambda d: write_cifar10(d, per_batch=8, n_test=10), (40, 10), []),
    "cifar100-python": ("cifar100", lambda d: write_cifar_python(d, classes=100, per_batch=8, n_test=10), (40, 10),
                        []),
    "cifar100-binary": ("cifar100", lambda d: write_cifar100_binary(d, n_train=40, n_test=10), (40, 10), []),
    "mnist-gz-torchvision": ("mnist", lambda d: write_mnist(d, n_train=40, n_test=10, gz=True), (40, 10), []),
    "fashion-mnist-as-published": ("fashion_mnist", lambda d: write_mnist(d, n_train=40, n_test=10, folder="",
                                                                          gz=True), (40, 10), []),
    "stl10-binary": ("stl10", lambda d: write_stl10(d, n_train=12, n_test=8), (12, 8), ["--image-size", "32"]),
    "imagefolder-with-litter": ("imagefolder", litter_around, (24, 6), ["--image-size", "12"]),
}


def write_layout(tmp_path, layout):
    """Writes `layout`'s files under tmp_path/data; returns the flags that train one epoch on them."""
    dataset, write, _, extra = LAYOUTS[layout]
    write(tmp_path / "data")
    return ["--dataset", dataset, "--data-dir", tmp_path / "data", "--epochs", "1", "--batch-size", "4",
            "--data.drop_last", "false", *extra]


def assert_every_sample_once(run, layout, world_size):
    dataset, _, (n_train, n_val), _ = LAYOUTS[layout]
    summary = read_json(run / "summary.json")
    assert summary["dataset"] == dataset and summary["world_size"] == world_size and summary["params_in_sync"]
    record = summary["history"][0]
    assert (record["train_count"], record["val_count"]) == (n_train, n_val)  # every sample once, litter none


# What a layout's reader finds does not depend on the number of ranks: one rank in this process reads each (a launch
# costs each rank seconds of start-up); the 2-rank run below deals one layout's samples out between ranks.
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_published_layout_trains_on_each_of_its_samples(tmp_path, app, layout):
    train_here(app, tmp_path / "out", *write_layout(tmp_path, layout))
    assert_every_sample_once(tmp_path / "out", layout, world_size=1)


@pytest.mark.distributed
def test_a_published_layout_trains_on_2_ranks_each_sample_once(tmp_path):
    launch("mpirun", 2, TRAIN, "--output-dir", tmp_path / "out", *write_layout(tmp_path, "imagefolder-with-litter"),
           *QUIET)
    assert_every_sample_once(tmp_path / "out", "imagefolder-with-litter", world_size=2)


@pytest.mark.distributed
def test_what_people_see_and_what_rank_0_writes(tmp_path):
    out = tmp_path / "run"
    proc = launch("horovodrun-gloo", 2, TRAIN, "--output-dir", out, "--epochs", "2",
                  "--config", ROOT / "configs" / "digits_cnn.yaml", "--logging.progress_every=0.001")
    start = proc.stdout
    for needle in ("2 rank(s), 2 per host", "device cpu", "controller Gloo", "tensor ops Gloo",
                   "batch 32 per rank x 2 ranks x 1 per allreduce = 64 global", "lr 0.025 base x 2 = 0.05"):
        assert needle in start, needle
    lines = [line for line in start.splitlines() if re.search(r"epoch \d/2 ", line)]
    assert len(lines) == 2 and all("val loss" in line and "top-1" in line and "top-5" in line and "samples/s"
                                   in line for line in lines)
    # Progress (on stderr) comes from rank 0 only; the output is a pipe here, as in a log: whole lines, no bar.
    progress = [line for line in proc.stderr.splitlines() if "epoch 1/2:" in line]
    assert progress and all(re.fullmatch(r"\[0\]<stderr>:epoch 1/2: step \d+/22 \(\d+%\), \d+s.*", line)
                            for line in progress), progress  # (a bar's redraws would be lines of bars here)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [1, 2] and "val_acc5" in metrics[0]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    summary = read_json(out / "summary.json")
    assert summary["config_name"] == "digits_cnn" and summary["curves_png"] == str(out / "curves.png")
    assert read_json(out / "config.json")["optim"]["epochs"] == 2


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["horovodrun-gloo", pytest.param("mpirun", marks=pytest.mark.extended)])
def test_a_terminal_gets_a_progress_bar_under_the_launcher(tmp_path, launcher):
    # `script` runs the launcher on a pseudo-terminal, as a person's shell does; the ranks' own output is a pipe.
    args = [str(TRAIN), "--output-dir", str(tmp_path), "--epochs", "1"]
    command = " ".join(shlex.quote(str(a)) for a in launch_command(launcher, 2, args))
    proc = subprocess.run(["script", "-qec", command, "/dev/null"], cwd=ROOT, env=job_env(), capture_output=True,
                          timeout=300)  # bytes: text mode would turn the bar's carriage returns into newlines
    output = re.sub(r"\[[\d,]+\]<std(?:out|err)>:", "", proc.stdout.decode(errors="replace"))
    assert proc.returncode == 0, output[-3000:]
    assert re.search(r"\repoch 1/1: +\d+%\|.*\| \d+/22 \[", output), output[-3000:]  # tqdm redrawing in place


def test_one_process_runs_a_recipe_with_overrides(tmp_path, app):
    result = app("--config", ROOT / "configs" / "digits_cnn.yaml", "--output-dir", tmp_path, "--epochs", "1",
                 "--optimizer", "adam", "--lr", "0.002", "--optim.weight_decay", "0.01")
    assert result.returncode == 0, result.stderr[-3000:]
    summary, config = read_json(tmp_path / "summary.json"), read_json(tmp_path / "config.json")
    assert summary["world_size"] == 1 and summary["epochs"] == 1 and summary["final_val_acc1"] > 50
    # The overrides won over the recipe, and what the command line left alone kept the recipe's value.
    assert (config["optim"]["optimizer"], config["optim"]["lr"], config["optim"]["weight_decay"]) == \
        ("adam", 0.002, 0.01)
    assert (config["optim"]["batch_size"], config["optim"]["lr_schedule"]) == (32, "cosine")
    assert summary["lr"] == 0.002 and summary["config_name"] == "digits_cnn"
    assert "lr 0.002 base x 1 = 0.002, cosine schedule" in result.stdout
