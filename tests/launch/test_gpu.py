"""On a GPU machine: device pinning, NCCL collectives, fp16 AMP, SyncBatchNorm, channels-last with bf16 and a full
training run to the CPU tests' accuracy bar, through the app and horovodrun. Skipped without CUDA;
scripts/gpu_check.sh runs them with `python -m pytest -m gpu`.

Ranks never share a GPU (NCCL does not support two ranks on one device): the multi-rank tests run one rank per GPU,
at most 2, so on a one-GPU machine they run one rank, whose CUDA tensors still go through Horovod's NCCL operations.
Launched with horovodrun --gloo, which works whether or not Horovod was built with MPI.
"""
import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import QUIET, ROOT, TRAIN, check_wire_formats, job_env, launch, read_json

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]
needs_torchvision = pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                                       reason="the ResNet tests need torchvision, which this environment lacks")

NP = max(1, min(2, torch.cuda.device_count()))  # one rank per GPU, at most 2
RANKS = pytest.mark.parametrize("np", [NP], ids=[f"{NP}rank"])


def _finite_history(summary):
    return all(math.isfinite(r[k]) for r in summary["history"] for k in ("train_loss", "val_loss"))


def _load_on_cpu(path):
    """A checkpoint read onto the CPU (the test process makes no CUDA context of its own)."""
    return torch.load(path, map_location="cpu", weights_only=True)


@RANKS
def test_each_rank_runs_on_the_gpu_of_its_local_rank(tmp_path, worker, np):
    launch("horovodrun-gloo", np, worker("gpu_model.py"), tmp_path, "--model", "small_cnn")
    records = [read_json(tmp_path / f"rank{r}.json") for r in range(np)]
    assert sorted(r["local_rank"] for r in records) == list(range(np))
    for r in records:
        assert r["device"] == f"cuda:{r['local_rank']}" and r["current_device"] == r["local_rank"], r
        assert r["param_devices"] == [r["device"]], r  # the model the app built lives on that GPU
        assert r["nccl_built"] and r["tensor_ops"] == "NCCL", r


@RANKS
def test_nccl_allreduce_broadcast_and_allgather_give_the_right_values_on_cuda_tensors(tmp_path, worker, np):
    launch("horovodrun-gloo", np, worker("nccl_collectives.py"), tmp_path)
    base = torch.arange(1000, dtype=torch.float64)
    total = np * base + np * (np + 1) / 2  # the sum of base + r + 1 over the ranks
    for rank in range(np):
        got = read_json(tmp_path / f"rank{rank}.json")
        assert got["nccl_built"] and got["size"] == np
        assert set(got["devices"].values()) == {f"cuda:{got['local_rank']}"}, got["devices"]
        v = {k: torch.tensor(x, dtype=torch.float64) for k, x in got["values"].items()}
        torch.testing.assert_close(v["sum"], total)
        torch.testing.assert_close(v["average"], total / np)
        torch.testing.assert_close(v["in_place_average"], total / np)
        torch.testing.assert_close(v["scaled_sum"], total * 2.0 * 0.25)
        assert got["dtypes"]["fp16_average"] == "torch.float16"
        torch.testing.assert_close(v["fp16_average"], total / np, rtol=1e-3, atol=0.5)  # fp16 steps by 0.5 at 1000
        assert torch.equal(v["broadcast_from_0"], torch.full((4, 5), 10.0, dtype=torch.float64))
        assert torch.equal(v["broadcast_from_last"], torch.full((3,), float(np - 1), dtype=torch.float64))
        expected = torch.cat([torch.full((r + 1, 2), float(r), dtype=torch.float64) for r in range(np)])
        assert torch.equal(v["allgather"], expected)


def test_the_default_recipe_on_the_gpu_reaches_the_cpu_tests_accuracy_bar(tmp_path):
    proc = launch("single", 1, TRAIN, "--device", "cuda", "--output-dir", tmp_path, *QUIET)
    assert "device cuda:0" in proc.stdout
    s = read_json(tmp_path / "summary.json")
    assert (s["device"], s["tensor_ops"], s["epochs"], len(s["history"])) == ("cuda:0", "NCCL", 15, 15)
    assert s["best_val_acc1"] >= 97.0 and s["final_val_acc1"] >= 97.0  # the bar of test_every_launcher_trains.py
    _continues_on_the_gpu(tmp_path, 16)


def _continues_on_the_gpu(run, epochs, *args):
    """The weights trained on the GPU come back onto it: `--resume auto` to `epochs` trains one more epoch there.
    (The checkpoint's tensors themselves are host copies: the background writer copies them off the GPU so that
    training goes on while it writes.)"""
    before = read_json(run / "summary.json")
    launch("single", 1, TRAIN, "--device", "cuda", "--output-dir", run, "--resume", "auto", "--epochs", epochs,
           *args, *QUIET)
    s = read_json(run / "summary.json")
    assert s["device"] == "cuda:0" and len(s["history"]) == epochs and _finite_history(s)
    # It continued the run, not a new one: the epochs before are the first run's.
    assert [(h["epoch"], h["val_loss"]) for h in s["history"][:-1]] == [(h["epoch"], h["val_loss"])
                                                                        for h in before["history"]]
    assert s["resumes"] and s["resumes"][-1]["epoch"] == epochs - 1


def test_fp16_amp_with_the_gradient_scaler_and_clipping_trains_the_digits(tmp_path):
    proc = launch("single", 1, TRAIN, "--amp", "fp16", "--clip-grad", "1.0", "--epochs", "5", "--output-dir",
                  tmp_path, *QUIET)
    assert "amp fp16" in proc.stdout
    s = read_json(tmp_path / "summary.json")
    assert s["device"] == "cuda:0" and _finite_history(s)
    # A scaler whose gradients reached the clipping still scaled would barely move the weights.
    assert s["final_val_acc1"] >= 85.0
    scaler = _load_on_cpu(tmp_path / "checkpoints" / "last.pt")["scaler"]
    assert scaler and scaler["scale"] > 0 and scaler["_growth_tracker"] >= 0  # the scaler ran and was saved


@pytest.mark.skipif(NP < 2, reason="a sharded optimizer needs 2 ranks, and ranks need a GPU each")
def test_a_sharded_optimizer_with_fp16_amp_and_clipping_trains_the_digits(tmp_path):
    # The scaler finds overflows in each rank's slice; every rank must skip the same steps (params_in_sync).
    proc = launch("horovodrun-gloo", NP, TRAIN, "--amp", "fp16", "--clip-grad", "1.0", "--epochs", "5", "--opt",
                  "adamw", "--lr", "0.002", "--shard-optimizer", "--output-dir", tmp_path, *QUIET)
    assert f"optimizer state sharded over {NP} ranks" in proc.stdout
    s = read_json(tmp_path / "summary.json")
    assert _finite_history(s) and s["params_in_sync"] and s["final_val_acc1"] >= 85.0


@pytest.mark.skipif(NP < 2, reason="an allreduce between GPUs needs 2 ranks, and ranks need a GPU each")
def test_nccl_carries_bf16_gradients_that_overflow_fp16(tmp_path, worker):
    # NCCL's bfloat16 and the CUDA kernels that scale an average (Horovod's core patched for bfloat16).
    launch("horovodrun-gloo", NP, worker("wire_formats.py"), tmp_path / "grads.pt", "--gpu")
    got = torch.load(tmp_path / "grads.pt")
    assert got["device"].startswith("cuda")
    check_wire_formats(got, NP)


@needs_torchvision
@RANKS
def test_sync_bn_layers_are_horovods_and_compute_statistics_over_all_ranks(tmp_path, worker, np):
    (tmp_path / "model").mkdir()
    launch("horovodrun-gloo", np, worker("gpu_model.py"), tmp_path / "model", "--model", "resnet18", "--sync-bn")
    records = [read_json(tmp_path / "model" / f"rank{r}.json") for r in range(np)]
    for r in records:
        assert r["norm_classes"] == ["horovod.torch.sync_batch_norm.SyncBatchNorm"], r["norm_classes"]
        assert r["sync_bn_layers"] == r["norm_layers"] == 20
    # Each rank's batch differs; the running mean is that of all ranks' samples together (equal batch sizes).
    local = torch.tensor([r["local_input_mean"] for r in records])
    expected = records[0]["momentum"] * local.mean(dim=0)
    for r in records:
        torch.testing.assert_close(torch.tensor(r["running_mean"]), expected, rtol=1e-4, atol=1e-5)

    launch("horovodrun-gloo", np, TRAIN, "--model", "resnet18", "--image-size", "16", "--sync-bn", "--epochs", "2",
           "--output-dir", tmp_path / "run", *QUIET)
    s = read_json(tmp_path / "run" / "summary.json")
    assert s["world_size"] == np and s["params_in_sync"] and _finite_history(s)
    assert s["best_val_acc1"] >= 80.0


@needs_torchvision
def test_channels_last_with_bf16_trains_resnet18_and_benchmarks(tmp_path):
    proc = launch("single", 1, TRAIN, "--model", "resnet18", "--image-size", "16", "--amp", "bf16", "--channels-last",
                  "--epochs", "2", "--output-dir", tmp_path / "run", *QUIET)
    assert "amp bf16, channels-last" in proc.stdout
    s = read_json(tmp_path / "run" / "summary.json")
    assert s["device"] == "cuda:0" and _finite_history(s) and s["best_val_acc1"] >= 80.0
    ckpt = _load_on_cpu(tmp_path / "run" / "checkpoints" / "last.pt")
    # Kernels of more than one input channel and pixel: a 1x1 kernel (ResNet's downsample) is contiguous in both
    # layouts at once, so only the others tell channels-last apart.
    convs = [w for w in ckpt["model"].values() if w.dim() == 4 and w.shape[1] > 1 and w.shape[2] * w.shape[3] > 1]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() for w in convs)

    _continues_on_the_gpu(tmp_path / "run", 3, "--model", "resnet18", "--image-size", "16", "--amp", "bf16",
                          "--channels-last")

    launch("single", 1, TRAIN, "--benchmark", "--model", "resnet18", "--image-size", "64", "--batch-size", "32",
           "--amp", "bf16", "--channels-last", "--num-warmup-batches", "2", "--num-iters", "3",
           "--num-batches-per-iter", "2", "--output-dir", tmp_path / "bench", *QUIET)
    b = read_json(tmp_path / "bench" / "summary.json")
    assert (b["device"], b["amp"], b["channels_last"]) == ("cuda:0", "bf16", True) and b["img_per_sec_total"] > 0


def test_bare_loop_runs_the_apps_fp16_step_channels_last_on_the_gpu(tmp_path):
    out = tmp_path / "bare.json"
    cmd = [sys.executable, "bench/bare_loop.py", "--device", "cuda", "--model", "small_cnn", "--image-size", "32",
           "--batch-size", "32", "--amp", "fp16", "--channels-last", "--num-warmup-batches", "2", "--num-iters", "3",
           "--num-batches-per-iter", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert (r["device"], r["amp"], r["channels_last"]) == ("cuda:0", "fp16", True)
    assert len(r["img_per_sec_by_rank"][0]) == 3 and min(r["img_per_sec_by_rank"][0]) > 0


@needs_torchvision
def test_photos_decoded_on_the_gpu_match_the_workers_crops(tmp_path, worker):
    from formats import NVJPEG_MEAN_LEVELS, NVJPEG_P99_LEVELS, photo

    for i in range(8):
        (tmp_path / "photos" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "photos" / f"c{i % 2}" / f"{i}.jpg").write_bytes(photo(500, 375, i))
    subprocess.run([sys.executable, str(worker("gpu_photos.py")), str(tmp_path / "photos"), str(tmp_path / "d.json")],
                   cwd=ROOT, env=job_env(), check=True, timeout=300)
    got = read_json(tmp_path / "d.json")
    for split in ("train", "val"):
        assert got[split]["device"] == "cuda:0", got
        assert got[split]["mean"] < NVJPEG_MEAN_LEVELS and got[split]["p99"] < NVJPEG_P99_LEVELS, got


@needs_torchvision
@pytest.mark.parametrize("source", ["folder", "shards"])
def test_resnet18_trains_from_jpegs_decoded_on_the_gpu(tmp_path, source):
    from formats import write_image_folder

    write_image_folder(tmp_path / "photos", per_class=40, size=96, ext="jpg")
    data = ["--dataset", "imagefolder", "--data-dir", tmp_path / "photos"]
    if source == "shards":
        subprocess.run([sys.executable, "-m", "hvd_train.tools.shard", "--from", "imagefolder", "--data-dir",
                        str(tmp_path / "photos"), "--out", str(tmp_path / "shards"), "--shard-size", "16"],
                       cwd=ROOT, env=job_env(), check=True, timeout=300)
        data = ["--dataset", "shards", "--data.train_shards", f"{tmp_path}/shards/train-{{000000..000005}}.tar",
                "--data.val_shards", f"{tmp_path}/shards/val-{{000000..000000}}.tar"]
    proc = launch("single", 1, TRAIN, *data, "--model", "resnet18", "--image-size", "64", "--batch-size", "8",
                  "--epochs", "6", "--workers", "2", "--data.decode", "gpu", "--reprob", "0.25", "--output-dir",
                  tmp_path / "run", *QUIET)
    assert "photos are decoded, cropped and flipped on cuda:0" in proc.stdout, proc.stdout[-2000:]
    s = read_json(tmp_path / "run" / "summary.json")
    assert s["device"] == "cuda:0" and _finite_history(s) and s["best_val_acc1"] >= 80.0, s["history"]
