"""Every rank's stack on demand while a job runs: SIGUSR2 to horovodrun --gloo reaches its ranks; SIGUSR2 to one rank
under MPICH's mpirun (which dies of SIGUSR2 itself) reaches the others through the watchdog's heartbeat; and each
time the job then finishes normally, exit 0. (A rank stuck in its own work printing its stack after
--freeze-timeout: test_failures.py.)"""
import os
import re
import signal
import subprocess

import psutil
import pytest

from conftest import QUIET, TRAIN, epochs_in, job_env, launch_command, wait_for

pytestmark = pytest.mark.distributed

HEADER = (r"train_hvd.py: rank (\d) \(host [^,]+, pid (\d+)\): every thread's Python stack, as (SIGUSR2 to this "
          r"process|SIGUSR2 to rank (\d), passed on to every rank) asked; the job goes on:")


# The test's own data set: once epoch 1's record is written, rank 1 waits at its next training sample until the test
# creates the file `go`, so the signals reach a job that is surely running (rank 0 then waits for it in the
# gradients' allreduce, in C++), and the job then finishes as it would have.
HELD = '''
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset


class Points(Dataset):
    def __init__(self, count, seed, held):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, 8, generator=gen)
        self.y = (self.x.sum(1) > 0).long()
        self.held = held

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        while self.held and Path("run/metrics.jsonl").exists() and not Path("go").exists():
            time.sleep(0.05)
        return self.x[i], self.y[i]


def points(data_dir, seed):
    held = os.environ.get("HOROVOD_RANK", os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))) == "1"
    return Points(256, seed, held), Points(64, seed + 1, False), {"num_classes": 2, "features": 8}


def net(features, num_classes):
    return nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, num_classes))
'''


def start(launcher, tmp_path, log):
    """A two-rank run of 2 epochs of the test's own data set, held at epoch 2 until `go` exists."""
    (tmp_path / "held.py").write_text(HELD)
    cmd = launch_command(launcher, 2, [str(TRAIN), "--output-dir", str(tmp_path / "run"), *QUIET, "--epochs", "2",
                                       "--dataset", "held:points", "--model", "held:net", "--batch-size", "8",
                                       "--workers", "0"])
    return subprocess.Popen(cmd, cwd=tmp_path, env=job_env(), stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def epochs(run):
    return epochs_in(run) if (run / "metrics.jsonl").exists() else []


def headers(log):
    return re.findall(HEADER, log.read_text())


def ranks_of(run):
    """{rank: psutil.Process} of the job writing to `run` (the launchers' environment variables say which)."""
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if argv and "python" in os.path.basename(argv[0]) and str(TRAIN) in argv and str(run) in argv:
            env = proc.environ()
            rank = env.get("HOROVOD_RANK") or env.get("PMI_RANK") or env.get("OMPI_COMM_WORLD_RANK")
            if rank is not None:
                found[int(rank)] = proc
    return found


def released_and_finished(proc, tmp_path, log):
    """The held rank let go: the job must finish both epochs and exit 0; returns its output."""
    (tmp_path / "go").touch()
    try:
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert proc.returncode == 0, output[-3000:]
    assert epochs_in(tmp_path / "run") == [1, 2]
    return output


def check_dumps(output):
    """Each header is followed by the stacks of that rank's threads, its main thread's in the app's recipe."""
    for header in re.finditer(HEADER, output):
        after = output[header.end():header.end() + 20000]
        assert re.search(r"Thread 0x[0-9a-f]+", after) and "train_hvd.py" in after, after[:3000]


def test_sigusr2_to_horovodrun_has_every_rank_write_its_stacks_and_the_job_finishes(tmp_path):
    run, log = tmp_path / "run", tmp_path / "log"
    with open(log, "w") as out:
        proc = start("horovodrun-gloo", tmp_path, out)
        wait_for(lambda: epochs(run) or proc.poll() is not None, "an epoch")
        proc.send_signal(signal.SIGUSR2)
        wait_for(lambda: len(headers(log)) >= 2 or proc.poll() is not None, lambda: log.read_text()[-3000:])
        output = released_and_finished(proc, tmp_path, log)
    assert "horovodrun: SIGUSR2 passed on to 2 process(es) of the job on this host" in output, output[-3000:]
    found = headers(log)
    assert sorted(int(rank) for rank, *_ in found) == [0, 1], found
    check_dumps(output)


def test_sigusr2_to_one_rank_reaches_every_rank_and_the_job_finishes(tmp_path):
    run, log = tmp_path / "run", tmp_path / "log"
    with open(log, "w") as out:
        proc = start("mpirun", tmp_path, out)
        wait_for(lambda: epochs(run) or proc.poll() is not None, "an epoch")
        ranks = ranks_of(run)
        assert sorted(ranks) == [0, 1], ranks
        ranks[0].send_signal(signal.SIGUSR2)  # MPICH's mpirun would die of it: to one rank
        # Rank 1 hears of the request in rank 0's next heartbeat and writes its own stacks.
        wait_for(lambda: len(headers(log)) >= 2 or proc.poll() is not None, lambda: log.read_text()[-3000:])
        output = released_and_finished(proc, tmp_path, log)
    found = headers(log)
    assert [(int(rank), cause) for rank, _, cause, _ in found] == [
        (0, "SIGUSR2 to this process"), (1, "SIGUSR2 to rank 0, passed on to every rank")], found
    assert {int(pid) for _, pid, _, _ in found} == {p.pid for p in ranks.values()}
    check_dumps(output)
    # Rank 1 was held in its data set's __getitem__ when it wrote its stacks.
    rank_1 = output[output.index("rank 1 (host"):]
    assert "in __getitem__" in rank_1[:20000], rank_1[:3000]
