"""Per-rank step time accounting on real 2-rank jobs: a plug-in of the test's own slows one rank on purpose (its
samples in the loader, or its forward), and the run names that rank and that phase, in the straggler line and in
summary.json; a run where no rank is slowed names none. (The arithmetic: tests/unit/test_timing_arithmetic.py; a
communication-bound job across two hosts: tests/cluster/test_multihost.py.)"""
import json
import re

import pytest

from conftest import read_json, run_app

pytestmark = pytest.mark.distributed

# Sleeping slows a rank without taking a core from the other (the suite runs several jobs on two cores).
SLOW = '''
import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset

SLOW_RANK = 1


def rank():
    """This process's rank as the launchers set it (horovodrun's Gloo, MPICH's and Open MPI's mpirun)."""
    for name in ("HOROVOD_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


class Points(Dataset):
    def __init__(self, count, seed, pause):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, 8, generator=gen)
        self.y = (self.x.sum(1) > 0).long()
        self.pause = pause

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.pause:
            time.sleep(self.pause)
        return self.x[i], self.y[i]


def points(data_dir, seed, pause=0.0):
    """pause: seconds per training sample on rank SLOW_RANK alone."""
    return (Points(256, seed, pause if rank() == SLOW_RANK else 0.0), Points(64, seed + 1, 0.0),
            {"num_classes": 2, "features": 8})


class Net(nn.Module):
    def __init__(self, features, num_classes, pause):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, num_classes))
        self.pause = pause

    def forward(self, x):
        if self.pause and self.training:
            time.sleep(self.pause)
        return self.body(x)


def net(features, num_classes, pause=0.0, everyone=0.0):
    """pause: seconds per training forward on rank SLOW_RANK alone; everyone: on every rank."""
    return Net(features, num_classes, everyone + (pause if rank() == SLOW_RANK else 0.0))
'''


def timed_run(tmp_path, launcher, data_pause=0.0, forward_pause=0.0, everyone=0.0):
    (tmp_path / "slow.py").write_text(SLOW)
    out = tmp_path / "run"
    proc = run_app(launcher, 2, "--output-dir", out, "--dataset", "slow:points", "--data-args", f"pause={data_pause}",
                   "--model", "slow:net", "--model-args", f"pause={forward_pause},everyone={everyone}",
                   "--epochs", "2", "--batch-size", "8", cwd=tmp_path)
    return proc.stdout, read_json(out / "summary.json"), [json.loads(line) for line in open(out / "metrics.jsonl")]


def lines_of(stdout, start):
    """rank 0's lines that begin with `start`, without the launcher's prefix ([0]<stdout>: or [0] )."""
    plain = (re.sub(r"^\[\d+\](<stdout>:| )", "", line) for line in stdout.splitlines())
    return [line for line in plain if line.startswith(start)]


def straggler_lines(stdout):
    return lines_of(stdout, "straggler:")


@pytest.mark.parametrize("launcher,slowed,phase", [
    ("horovodrun-gloo", "data", "data"),
    ("horovodrun-mpi", "forward", "compute"),
    pytest.param("mpirun", "data", "data", marks=pytest.mark.extended),
])
def test_a_rank_slowed_on_purpose_is_named_with_its_phase(tmp_path, launcher, slowed, phase):
    # rank 1: 8 samples x 20 ms in its loader, or 150 ms in its forward, every step; rank 0 takes a few ms.
    pauses = {"data": (0.02, 0.0), "forward": (0.0, 0.15)}[slowed]
    stdout, summary, records = timed_run(tmp_path, launcher, *pauses)
    lines = straggler_lines(stdout)
    assert len(lines) == 2, stdout  # one each epoch
    assert all(line.startswith("straggler: rank 1 (host ") and f"most of it in {phase} (" in line
               for line in lines), lines
    assert summary["timing"]["slowest"]["rank"] == 1 and summary["timing"]["slowest"]["phase"] == phase
    ranks = summary["timing"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["host"] and r["steps"] == 2 * 16 for r in ranks)
    # Every other rank waits for the slow one in the allreduce: rank 0 waits longer than rank 1 does.
    assert ranks[0]["allreduce_wait"] > ranks[1]["allreduce_wait"]
    assert ranks[1][phase] > 0.1
    for record in records:
        assert record["timing"]["slowest"] == {**record["timing"]["slowest"], "rank": 1, "phase": phase}
        assert record["time_slowest_rank"] == 1 and set(record["timing"]["ranks"][0]) >= {
            "data", "compute", "allreduce_wait", "optimizer", "other", "steps", "host", "rank"}
    # The epoch line's split, the mean over the ranks.
    epoch_lines = lines_of(stdout, "epoch ")
    assert len(epoch_lines) == 2, stdout
    assert all(" data " in line and " compute " in line and " comm " in line for line in epoch_lines), stdout


def test_a_run_where_no_rank_is_slowed_names_none(tmp_path):
    # Both ranks sleep alike in every forward, so each step's own work is large against what the machine's load
    # adds to one rank or the other (the suite runs several jobs on two cores).
    stdout, summary, _ = timed_run(tmp_path, "horovodrun-gloo", everyone=0.1)
    assert not straggler_lines(stdout), stdout
    assert "communication-bound" not in stdout, stdout
    assert [r["rank"] for r in summary["timing"]["ranks"]] == [0, 1]
