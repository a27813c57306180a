"""--powersgd-rank (hvd_utils/powersgd.py) in real 2-rank jobs: it trains under horovodrun's MPI and Gloo
with gradient accumulation, clipping and a 16-bit wire; a run killed within an epoch resumes bitwise (Q and every
rank's residuals in the step checkpoint); on another number of ranks the residuals start again, said in one line;
under --amp fp16 a step with an inf on one rank is skipped on every rank. (The arithmetic:
unit/test_powersgd_arithmetic.py; bad settings: test_bad_settings.py.)"""
import json
import shutil

import pytest
import torch

from conftest import QUIET, TRAIN, WORKERS, last_checkpoint, launch, read_json, run_app

pytestmark = pytest.mark.distributed
# The digits on 2 ranks: 22 steps an epoch. Compression from step 5, so the step-30 checkpoint holds 25 steps of it.
FLAGS = ("--powersgd-rank", "2", "--powersgd-start-step", "5", "--checkpoint.every_steps", "10", "--opt", "sgd",
         "--optim.nesterov", "--weight-decay", "5e-4", *QUIET)


def test_a_run_killed_within_an_epoch_resumes_bitwise_and_on_three_ranks_restarts_the_residuals(tmp_path):
    launch("mpirun", 2, TRAIN, "--output-dir", tmp_path / "straight", "--epochs", "2", *FLAGS)
    killed = launch("mpirun", 2, WORKERS / "killed_after_save.py", "30", "--", "--output-dir", tmp_path / "resumed",
                    "--epochs", "2", *FLAGS, check=False)
    assert killed.returncode != 0
    assert ("PowerSGD rank 2 from optimizer step 5: 4 tensors compressed, 4 averaged as they are; a step sends "
            "0.0144 MB per rank instead of 0.605 MB (42.0x fewer bytes)") in killed.stdout
    saved = last_checkpoint(tmp_path / "resumed")["optimizer"]["powersgd"]
    assert saved["steps"] == 30 and saved["world_size"] == 2 and len(saved["residuals"]) == 2
    assert not torch.equal(saved["residuals"][0], saved["residuals"][1])  # each rank's own
    shutil.copytree(tmp_path / "resumed", tmp_path / "on-three")
    launch("mpirun", 2, TRAIN, "--output-dir", tmp_path / "resumed", "--epochs", "2", "--resume", "auto", *FLAGS)
    straight, resumed = last_checkpoint(tmp_path / "straight"), last_checkpoint(tmp_path / "resumed")
    for name, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][name]), f"{name} differs after resuming"
    a, b = straight["optimizer"]["powersgd"], resumed["optimizer"]["powersgd"]
    assert a["steps"] == b["steps"] == 44
    assert all(torch.equal(a["q"][i], b["q"][i]) for i in a["q"])
    assert all(torch.equal(x, y) for x, y in zip(a["residuals"], b["residuals"]))
    history = read_json(tmp_path / "straight" / "summary.json")["history"]
    assert [h["compression_ratio"] for h in history] == [42.03, 42.03]

    proc = launch("mpirun", 3, TRAIN, "--output-dir", tmp_path / "on-three", "--epochs", "2", "--resume", "auto",
                  *FLAGS)
    assert ("PowerSGD: the checkpoint was written by 2 ranks and 3 run now: each rank's PowerSGD residuals (its "
            "own) start again from zero; Q goes on") in proc.stdout
    assert last_checkpoint(tmp_path / "on-three")["optimizer"]["powersgd"]["world_size"] == 3


@pytest.mark.parametrize("launcher", [pytest.param("horovodrun-mpi", marks=pytest.mark.extended), "horovodrun-gloo"])
def test_trains_with_accumulation_clipping_and_a_bf16_wire_and_the_ranks_agree(tmp_path, launcher):
    # The ranks' weights are compared at the end: they differ (exit 1) unless every rank took the same average.
    proc = run_app(launcher, 2, "--output-dir", tmp_path, "--epochs", "2", "--powersgd-rank", "1",
                   "--batches-per-allreduce", "2", "--batch-size", "16", "--clip-grad", "0.5", "--bf16-allreduce")
    assert "PowerSGD rank 1 from optimizer step 4:" in proc.stdout  # 10% of 2 x 22 steps
    history = read_json(tmp_path / "summary.json")["history"]
    assert history[-1]["compression_ratio"] > 20 and history[-1]["val_acc1"] > 20


def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    proc = launch("horovodrun-gloo", 2, WORKERS / "powersgd_overflow.py")
    ranks = [json.loads(line.split(":", 1)[1]) for line in proc.stdout.splitlines() if '"rank"' in line]
    assert len(ranks) == 2
    for r in ranks:
        changed = [(s["weights"], s["q"], s["residuals"]) for s in r["steps"]]
        assert changed == [(True,) * 3, (False,) * 3, (True,) * 3], r  # the inf's step changed nothing anywhere
        assert [s["scale"] for s in r["steps"]] == [1024.0, 512.0, 512.0] and all(s["finite"] for s in r["steps"])
