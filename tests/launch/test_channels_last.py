"""--channels-last on the CPU: the layout of the weights and batches, real runs with one and two ranks (training,
--evaluate, --benchmark, resuming), Horovod's collectives on channels-last tensors, and the bare loop's switches."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, assert_refused, job_env, read_json, run_app


def _conv_weights(state_dict):
    """The 4-D weights whose layout channels-last changes (a single input channel looks the same either way)."""
    return {k: v for k, v in state_dict.items() if v.dim() == 4 and v.shape[1] > 1}


def test_weights_and_every_batch_are_channels_last_and_the_outputs_unchanged():
    from hvd_train.models import build_model, is_channels_last, to_channels_last

    torch.manual_seed(0)
    plain = build_model("small_cnn", 3, 10, 12).eval()
    model = build_model("small_cnn", 3, 10, 12).eval()
    model.load_state_dict(plain.state_dict())
    assert not is_channels_last(model)
    to_channels_last(model)
    assert is_channels_last(model) and _conv_weights(model.state_dict())
    seen = []
    model.features[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    images = torch.rand(4, 3, 12, 12)  # NCHW, as a DataLoader gives them
    torch.testing.assert_close(model(images), plain(images), rtol=1e-4, atol=1e-5)
    assert seen[0].is_contiguous(memory_format=torch.channels_last) and not seen[0].is_contiguous()
    with pytest.raises(ValueError, match="no convolution"):
        to_channels_last(build_model("vae", 1, 10, 8))


def test_one_process_trains_evaluates_and_benchmarks_channels_last(tmp_path, app):
    def run(*args):
        result = app(*args)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result

    assert "amp off, channels-last" in run("--channels-last", "--epochs", "3", "--output-dir", tmp_path / "run").stdout
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["best_val_acc1"] > 50.0 and summary["params_in_sync"]
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    weights = _conv_weights(ckpt["model"])  # torch.save keeps the strides the weights trained in
    assert weights and all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
                           for w in weights.values())
    momentum = [s["momentum_buffer"] for s in ckpt["optimizer"]["state"].values()]
    assert sum(m.dim() == 4 and m.is_contiguous(memory_format=torch.channels_last) for m in momentum) == 2
    run("--channels-last", "--evaluate", "--resume", tmp_path / "run" / "checkpoints" / "last.pt", "--output-dir",
        tmp_path / "eval")
    evaluation = read_json(tmp_path / "eval" / "evaluation.json")
    assert evaluation["acc1"] == pytest.approx(summary["final_val_acc1"])
    # Continued in the default layout: its channels-last momentum from the checkpoint is laid out like the weights.
    run("--epochs", "4", "--resume", "auto", "--channels-last=false", "--output-dir", tmp_path / "run")
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["epoch"] == 4 and all(w.is_contiguous() for w in _conv_weights(ckpt["model"]).values())

    bench = ["--benchmark", "--model", "small_cnn", "--image-size", "12", "--batch-size", "8", "--num-warmup-batches",
             "1", "--num-iters", "2", "--num-batches-per-iter", "2"]
    run(*bench, "--channels-last", "--amp", "bf16", "--output-dir", tmp_path / "b1")
    run(*bench, "--output-dir", tmp_path / "b0")
    on, off = read_json(tmp_path / "b1" / "summary.json"), read_json(tmp_path / "b0" / "summary.json")
    assert (on["channels_last"], on["amp"], off["channels_last"]) == (True, "bf16", False)
    assert on["img_per_sec_total"] > 0


@pytest.mark.distributed
def test_two_ranks_train_and_resume_channels_last_and_end_identical(tmp_path):
    # Adam's moments are channels-last like the weights, and --fp16-allreduce compresses channels-last gradients:
    # both travel through Horovod, which takes contiguous tensors only. Ranks start from different seeds, so ending
    # identical needs the initial broadcast as well as the averaged gradients.
    args = ["--channels-last", "--optimizer", "adam", "--lr", "0.002", "--fp16-allreduce", "--output-dir", tmp_path]
    run_app("horovodrun-gloo", 2, "--epochs", "1", *args)
    proc = run_app("horovodrun-gloo", 2, "--epochs", "2", "--resume", "auto", *args)  # fails on any mismatch
    assert "resuming after epoch 1" in proc.stdout
    summary = read_json(tmp_path / "summary.json")
    assert summary["world_size"] == 2 and summary["params_in_sync"] and len(set(summary["params_fingerprints"])) == 1
    assert summary["final_val_acc1"] > 50.0


@pytest.mark.distributed
def test_a_channels_last_step_on_2_ranks_equals_1_rank_with_double_batch(grad_steps):
    two_ranks, one_rank = (torch.load(folder / "channels-last.pt") for folder in grad_steps)
    assert _conv_weights(two_ranks)["features.2.weight"].is_contiguous(memory_format=torch.channels_last)
    for name, value in one_rank.items():
        torch.testing.assert_close(two_ranks[name], value, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("args, message", [
    (["--model", "vae", "--channels-last"], "model.channels_last (--channels-last): vae: the model has no convolution"),
    (["--elastic", "--channels-last"], "cannot be combined with --elastic"),
])
def test_channels_last_where_it_cannot_apply_is_refused(tmp_path, app, args, message):
    assert_refused(app(*args, "--epochs", "1", "--output-dir", tmp_path / "run"), message)


def test_bare_loop_runs_the_apps_step_with_bf16_and_channels_last_on_the_cpu(tmp_path):
    cmd = [sys.executable, "bench/bare_loop.py", "--model", "small_cnn", "--image-size", "12", "--batch-size", "8",
           "--num-warmup-batches", "1", "--num-iters", "2", "--num-batches-per-iter", "2", "--threads", "1"]
    out = tmp_path / "bare.json"
    proc = subprocess.run(cmd + ["--amp", "bf16", "--channels-last", "--out", str(out)], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert (result["amp"], result["channels_last"], result["device"]) == ("bf16", True, "cpu")
    assert len(result["img_per_sec_by_rank"][0]) == 2 and result["img_per_sec_total"] > 0
    proc = subprocess.run(cmd + ["--amp", "fp16"], cwd=ROOT, env=job_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "--amp fp16 needs --device cuda" in proc.stderr
