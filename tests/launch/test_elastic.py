"""Elastic training on one machine: two workers on two "hosts" (two names of this machine, localhost and
127.0.0.1, which Horovod treats as separate hosts and starts without ssh); one is killed mid-epoch and the job
finishes on the survivor."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import BIN, ROOT, app_output, job_env, read_json, worker_on

pytestmark = pytest.mark.distributed
COMMIT_EVERY = 5


@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=pytest.mark.extended)],
                         ids=["", "shard-optimizer"])
def test_a_killed_worker_leaves_the_survivor_to_finish_with_at_most_one_commit_redone(tmp_path, sharded):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    env = job_env()
    env.update(HVD_HOSTS_FILE=str(hosts), OMP_NUM_THREADS="1")
    out = tmp_path / "run"
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
           str(ROOT / "hostfiles" / "discover_hosts.py"), sys.executable, str(ROOT / "train_hvd.py"), "--elastic",
           "--output-dir", str(out), "--epochs", "6", "--horovod.commit_every", str(COMMIT_EVERY),
           "--logging.progress=false", "--logging.tensorboard=false", "--logging.plot=false"]
    if sharded:  # the dead worker's slice of the optimizer state comes back from the survivor's last commit
        cmd += ["--shard-optimizer", "--opt", "adamw", "--lr", "0.002"]
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, killed = [], None
    deadline = time.monotonic() + 240
    try:
        for line in job.stdout:
            lines.append(line)
            if killed is None and "epoch 1/6" in line:  # epoch 1 is over: the kill lands early in epoch 2
                victim = worker_on("127.0.0.1", job.pid)
                assert victim is not None, "no worker for 127.0.0.1"
                os.kill(victim.pid, signal.SIGKILL)
                killed = victim.pid
            assert time.monotonic() < deadline, "the elastic job did not finish in time"
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    output = "".join(lines)
    assert killed is not None, output[-3000:]
    assert job.returncode == 0, output[-3000:]
    assert "workers changed: now 1" in output
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 1 and summary["params_in_sync"]
    assert summary["elastic"]["resets"] >= 1
    assert 0 <= summary["elastic"]["steps_redone"] <= COMMIT_EVERY
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3, 4, 5, 6]
    assert all(h["val_count"] == 359 for h in summary["history"])
    assert summary["final_val_acc1"] > 80.0
    if sharded:  # Adam's step count: every step of the run that was kept, none lost with the dead worker's slice
        state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["optimizer"]["state"]
        assert {float(s["step"]) for s in state.values()} == {summary["elastic"]["steps"]}, summary["elastic"]


def test_an_unwritable_config_and_a_refused_init_file_end_an_elastic_job_with_one_line(tmp_path):
    # The same steps as a fixed run's: config.json written under decide_on_root (a full disk or a directory in its
    # place stops every worker together), --init-from read before the output directory is claimed.
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    env = {**job_env(), "HVD_HOSTS_FILE": str(hosts), "OMP_NUM_THREADS": "1"}
    (tmp_path / "blocked" / "config.json").mkdir(parents=True)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    cases = [(["--output-dir", tmp_path / "blocked"], "could not write"),
             (["--output-dir", tmp_path / "fresh", "--init-from", tmp_path / "junk.pt"], "--init-from")]
    for args, needle in cases:
        cmd = [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
               str(ROOT / "hostfiles" / "discover_hosts.py"), sys.executable, str(ROOT / "train_hvd.py"), "--elastic",
               "--epochs", "1", "--logging.progress=false", *map(str, args)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        output = proc.stdout + proc.stderr
        errors = [line for line in output.splitlines() if "train_hvd.py: error:" in line]
        assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0], output[-3000:]
        assert "Traceback" not in app_output(output), output[-3000:]
    assert list((tmp_path / "fresh").iterdir()) == []  # the refused file left no claimed directory behind
