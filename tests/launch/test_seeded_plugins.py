"""--seed seeds every generator a user's code may draw from: a data set (its factory and its samples) and a task
(its loss) that draw from Python's `random` and NumPy's global generator as well as torch's train the same twice,
bit for bit, on 2 ranks (the factory draws the same on every rank), and a run killed within an epoch resumes those
draws where they were. The data line of the log names the arguments the factory was called with, the seed among
them."""
import pytest
import torch

from conftest import QUIET, WORKERS, launch, last_checkpoint, read_json, run_app

pytestmark = pytest.mark.distributed

# A user's project: every draw below comes from a generator the app seeds (and checkpoints) for the user.
NOISY = '''
import os
import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class Jittered(Dataset):
    def __init__(self, points, labels):
        self.points, self.labels = points, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.points[i] + random.random() * 1e-3 + float(np.random.rand()) * 1e-3, self.labels[i]


def sets(seed, count=80, features=4):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(count) % 2
    points = torch.randn(count, features, generator=gen) + labels[:, None].float()
    shift = random.random() + float(np.random.rand())  # the same on every rank: the factory draws seeded by seed
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    with open(f"shift-{rank}.txt", "w") as f:
        f.write(repr(shift))
    return Jittered(points + shift, labels), None, {"num_classes": 2, "features": features}


def net(features, num_classes):
    return nn.Sequential(nn.Linear(features, 8), nn.ReLU(), nn.Linear(8, num_classes))


class NoisyLoss:
    best_metric, best_mode = "val_loss", "min"

    def loss(self, model, batch):
        logits = model(batch[0])
        noise = random.random() * 1e-3 + float(np.random.rand()) * 1e-3
        return {"loss": F.cross_entropy(logits, batch[1]) * (1 + noise)}, logits
'''

# 64 training samples, 8 a rank a step on 2 ranks: 4 steps an epoch, a checkpoint every 2 (run steps 2, 6).
COMMON = ["--dataset", "noisy:sets", "--data-args", "count=80", "--model", "noisy:net", "--task", "noisy:NoisyLoss",
          "--batch-size", "8", "--epochs", "2", "--seed", "7", "--checkpoint.every_steps", "2"]


def ended_the_same(run, other):
    """The weights of two runs' last checkpoints equal bit for bit, and their records equal too."""
    first, second = last_checkpoint(run), last_checkpoint(other)
    assert first["step"] == second["step"] == 8
    for name, value in first["model"].items():
        assert torch.equal(value, second["model"][name]), f"{name} differs between {run.name} and {other.name}"
    records = [[{k: v for k, v in h.items() if k.startswith(("train_", "val_")) or k in ("epoch", "lr")}
                for h in read_json(r / "summary.json")["history"]] for r in (run, other)]
    assert records[0] == records[1]


def test_a_plugins_draws_from_random_and_numpy_repeat_and_resume_bitwise_on_two_ranks(tmp_path):
    (tmp_path / "noisy.py").write_text(NOISY)
    first = run_app("mpirun", 2, "--output-dir", tmp_path / "first", *COMMON, cwd=tmp_path)
    # The factory's call, every argument by name: --seed reached its `seed`.
    assert "data noisy:sets(seed=7, count=80): 64 train / 16 val samples (num_classes 2, features 4)" in \
        first.stdout, first.stdout
    # Both ranks built the same data set: the factory's draws are seeded by the shared seed, not seed + rank.
    assert (tmp_path / "shift-0.txt").read_text() == (tmp_path / "shift-1.txt").read_text()
    run_app("mpirun", 2, "--output-dir", tmp_path / "second", *COMMON, cwd=tmp_path)
    ended_the_same(tmp_path / "first", tmp_path / "second")

    # Killed (SIGKILL, every rank) just after the checkpoint of run step 6, the 2nd of epoch 2's 4; resumed.
    killed = launch("mpirun", 2, WORKERS / "killed_after_save.py", "6", "--", *QUIET, "--output-dir",
                    tmp_path / "resumed", *COMMON, check=False, cwd=tmp_path)
    assert killed.returncode != 0
    within = last_checkpoint(tmp_path / "resumed")
    assert (within["step"], within["partial"]["epoch"], within["partial"]["steps"]) == (6, 2, 2)
    assert {"torch", "python", "numpy"} <= set(within["rng"][1]), within["rng"][1].keys()
    proc = run_app("mpirun", 2, "--output-dir", tmp_path / "resumed", "--resume", "auto", *COMMON, cwd=tmp_path)
    assert "epoch 2 continues after its step 2, each rank where it was" in proc.stdout, proc.stdout
    ended_the_same(tmp_path / "first", tmp_path / "resumed")
