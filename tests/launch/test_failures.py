"""Failures end cleanly and lose nothing: crashing or killed ranks, checkpoints killed mid-write, used output
directories, and bad input, each with one clear message and a non-zero exit, never a hang."""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

from hvd_train.run import checkpoint
from hvd_train.run import checkpoint as resume
from hvd_train.run.directory import RunLock
from hvd_train.training import check_shards
from hvd_train.errors import EXIT_BAD_DATA, EXIT_FAILED, ConfigError
from conftest import (QUIET, ROOT, TRAIN, WORKERS, app_output, assert_refused, find_mpirun, job_env, launch,
                      launch_command, read_json, run_app, wait_for)
from formats import write_image_folder
BOUND = 60  # seconds within which a job must have ended after one of its ranks failed


def faulty(launcher, tmp_path, mode, step=5, extra=()):
    """Run the app with rank 1 failing at its `step`th step (`extra`: more flags); returns the job and the seconds
    from the fault to its end (start-up, however slow the machine, is not counted)."""
    fault_time = tmp_path / "fault_time"
    proc = launch(launcher, 2, WORKERS / "faulty_train.py", "1", step, mode, "--", "--output-dir", tmp_path, *QUIET,
                  *extra, check=False, env={"HVD_TEST_FAULT_TIME": str(fault_time)})
    assert fault_time.exists(), f"the fault was never injected:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc, time.time() - float(fault_time.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "mpirun"])
def test_a_rank_that_raises_reports_once_and_the_job_ends(tmp_path, launcher):
    proc, seconds = faulty(launcher, tmp_path, "raise")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds < BOUND
    assert output.count("train_hvd.py: rank 1 failed:") == 1
    assert output.count("RuntimeError: injected failure on rank 1 at step 5") == 1
    assert "rank 0: stopping because another rank failed" in output
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "mpirun"])
def test_a_killed_rank_ends_the_job_with_the_rank_named(tmp_path, launcher):
    proc, seconds = faulty(launcher, tmp_path, "kill")
    assert proc.returncode != 0 and seconds < BOUND
    # How each launcher names the rank that was killed: horovodrun, OpenMPI's mpirun, and Hydra (the mpirun of
    # MPICH and Intel MPI), which names its process id and host.
    pid = (tmp_path / "fault_time.pid").read_text()
    names_the_rank = {"horovodrun-gloo": "horovodrun: rank 1 exited with status", "openmpi": "process rank 1",
                      "hydra": f"PID {pid} RUNNING AT"}[find_mpirun()[1] if launcher == "mpirun" else launcher]
    assert names_the_rank in proc.stdout + proc.stderr, proc.stdout[-3000:]


FREEZE = 20  # --freeze-timeout of the frozen-rank tests: generous for a step of the small CNN on a busy machine


def frozen(launcher, tmp_path, mode):
    """Rank 1 freezes (`mode` stop: SIGSTOP; hang: blocked in its step) at its 28th step, in epoch 2 (22 steps an
    epoch), after epoch 1's checkpoint. Returns the job's output and the seconds from the freeze to the job's end."""
    return faulty(launcher, tmp_path, mode, step=28, extra=("--epochs", "3", "--freeze-timeout", FREEZE))


def assert_checkpoint_of_epoch_1_intact(run):
    assert resume.load(str(run / "checkpoints" / "last.pt"))["epoch"] == 1
    assert not (run / "summary.json").exists()


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["mpirun", pytest.param("horovodrun-mpi", marks=pytest.mark.extended),
                                      "horovodrun-gloo"])
def test_a_stopped_rank_ends_the_job_after_the_freeze_timeout_naming_it(tmp_path, launcher):
    # Before the watchdog: under MPI the job waited silently for ever; under Gloo it ended after 30 s blaming rank 0.
    proc, seconds = frozen(launcher, tmp_path, "stop")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    # It waited for the limit first (counted from the last progress point, which may precede the fault by a step).
    assert seconds >= FREEZE - 1
    # The host as the launcher named it (horovodrun --gloo: from -H), else as it names itself.
    host = "localhost" if launcher == "horovodrun-gloo" else socket.gethostname()
    assert output.count(f"train_hvd.py: error: rank 1 (host {host}) stopped making progress") == 1, output[-3000:]
    assert "--resume auto continues from the newest" in output
    assert "Timed out waiting" not in output  # Gloo's own timeout did not fire first and blame the healthy rank
    assert_checkpoint_of_epoch_1_intact(tmp_path)


@pytest.mark.distributed
def test_a_rank_stuck_in_its_step_is_named_with_where_it_is_stuck(tmp_path):
    proc, seconds = frozen("horovodrun-gloo", tmp_path, "hang")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds >= FREEZE - 1, output[-3000:]
    assert "rank 1 (host localhost) made no progress for" in output
    assert "it is alive but stuck in its own work" in output
    assert "in faulty_step" in output  # the stuck rank's own stack, printed by its watchdog
    assert_checkpoint_of_epoch_1_intact(tmp_path)


@pytest.mark.parametrize("mode", ["in the step", "background"])
def test_killing_the_checkpoint_writer_at_any_moment_leaves_a_loadable_checkpoint(tmp_path, mode):
    rng, last_epoch = random.Random(0), 0
    for attempt in range(8):
        writer = subprocess.Popen([sys.executable, str(WORKERS / "checkpoint_writer.py"), str(tmp_path),
                                   str(last_epoch + 1), *(["background"] if mode == "background" else [])],
                                  env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, text=True)
        # Wait for one whole write (start-up is over and this machine's time for a write is known), then for the
        # next write to begin, and kill the writer at a random moment inside it.
        assert writer.stdout.readline().startswith("writing")
        began = time.perf_counter()
        assert writer.stdout.readline().startswith("saved")
        write_seconds = time.perf_counter() - began
        assert writer.stdout.readline().startswith("writing")
        time.sleep(rng.random() * write_seconds)
        writer.kill()
        writer.wait()
        writer.stdout.close()
        last = resume.load(str(tmp_path / "last.pt"))
        assert last["epoch"] >= last_epoch
        # Whole, and the epoch it names: the writer's weights are arange(n) + epoch.
        assert torch.equal(last["model"]["w"], torch.arange(len(last["model"]["w"]), dtype=torch.float32) +
                           last["epoch"])
        if (tmp_path / "best.pt").exists():
            assert resume.load(str(tmp_path / "best.pt"))["epoch"] % 4 == 0
        written = checkpoint.epoch_files(str(tmp_path))
        for path in written + checkpoint.numbered_files(str(tmp_path), checkpoint.STEP_FILE):
            resume.load(path)
        last_epoch = last["epoch"]
    assert last_epoch > 0, "the writer never finished a checkpoint: the test proved nothing"
    checkpoint.Checkpointer(str(tmp_path))
    assert not [name for name in os.listdir(tmp_path) if ".tmp." in name]


@pytest.mark.distributed
def test_a_second_job_in_the_same_output_dir_is_refused_and_a_dead_job_s_lock_taken_over(tmp_path, app):
    out, lock = tmp_path / "run", tmp_path / "run" / ".hvd-train.lock"
    command = launch_command("horovodrun-mpi", 2, [str(TRAIN), *QUIET, "--output-dir", str(out), "--epochs", "1000"])
    first = subprocess.Popen(command, cwd=ROOT, env=job_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: lock.exists() and lock.read_text().endswith("}"), "the first job's lock")
        holder = json.loads(lock.read_text())
        second = run_app("horovodrun-mpi", 2, "--output-dir", out, "--epochs", "3", check=False)
        assert_refused(second, f"--output-dir {out} is in use by the job whose rank 0 runs on {socket.gethostname()} "
                               f"as pid {holder['pid']}, started ")
        assert first.poll() is None, "the running job was disturbed"
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # as a host that dies: the lock stays behind
        first.wait(timeout=60)
    # mpirun's ranks may outlive horovodrun for a moment (they go when their launcher's pipes close): the job is
    # gone when its rank 0 is.
    wait_for(lambda: RunLock(str(out)).gone(holder), "the killed job's rank 0 to end")
    assert json.loads(lock.read_text())["pid"] == holder["pid"]
    third = app("--output-dir", out, "--epochs", "2", "--overwrite", "--logging.tensorboard=true")  # rank 0's part
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-2000:]
    assert f"taking over the lock of a job that is gone (pid {holder['pid']} on {socket.gethostname()} no longer " \
           f"runs)" in third.stdout
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2 and not lock.exists()
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) <= 1


def test_a_lock_whose_holder_is_a_zombie_is_taken_over(tmp_path):
    # A job's rank 0 killed with its launcher, in a container whose first process reaps nothing, stays a zombie.
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # ends, and stays a zombie until it is waited for
    try:
        wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, "the child to end")
        holder = {"host": socket.gethostname(), "pid": child.pid, "started": psutil.Process(child.pid).create_time()}
        (tmp_path / "run").mkdir()
        lock = RunLock(str(tmp_path / "run"))
        (tmp_path / "run" / ".hvd-train.lock").write_text(json.dumps(holder))
        assert lock.gone(holder) == f"pid {child.pid} on {holder['host']} no longer runs"
        holder["pid"] = os.getpid()
        holder["started"] = psutil.Process().create_time()
        assert lock.gone(holder) is None  # a live holder holds it
    finally:
        child.wait()


def test_a_lock_from_another_host_holds_until_it_goes_stale(tmp_path, app):
    out = tmp_path / "run"
    out.mkdir()
    lock = out / ".hvd-train.lock"
    lock.write_text(json.dumps({"host": "node-7", "pid": 4242, "started": time.time() - 60, "token": "x"}))
    assert_refused(app("--output-dir", out, "--epochs", "1"), "is in use by the job whose rank 0 runs on node-7 as "
                   "pid 4242", "5 minutes after its last sign of life")
    assert lock.exists() and not (out / "config.json").exists()
    stale = time.time() - 600
    os.utime(lock, (stale, stale))  # node-7 died ten minutes ago
    result = app("--output-dir", out, "--epochs", "1")
    assert result.returncode == 0 and "taking over the lock of a job that is gone (its lock was not touched for" \
        in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    assert not lock.exists() and (out / "summary.json").exists()


def test_an_earlier_run_is_never_clobbered_by_accident(tmp_path, app):
    assert app("--output-dir", tmp_path, "--epochs", "1").returncode == 0
    before = (tmp_path / "summary.json").read_bytes(), (tmp_path / "checkpoints" / "last.pt").read_bytes()
    assert "--resume auto" in assert_refused(app("--output-dir", tmp_path, "--epochs", "1"), "already holds a run")
    assert before == ((tmp_path / "summary.json").read_bytes(), (tmp_path / "checkpoints" / "last.pt").read_bytes())
    assert app("--output-dir", tmp_path, "--epochs", "2", "--overwrite").returncode == 0
    assert [h["epoch"] for h in read_json(tmp_path / "summary.json")["history"]] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "best.pt", "epoch_0001.pt", "epoch_0002.pt", "last.pt"]


@pytest.mark.distributed
def test_download_without_network_is_one_line_naming_the_url_and_the_way_by_hand(tmp_path):
    # Two ranks on one host: local rank 0 downloads, and both stop with its error; rank 0 alone prints it.
    (tmp_path / "data").mkdir()
    proc = run_app("horovodrun-gloo", 2, "--output-dir", tmp_path / "out", "--dataset", "cifar10", "--download",
                   "--data-dir", tmp_path / "data", check=False, offline=True)
    line = assert_refused(proc, "--download CIFAR-10: cannot fetch https://www.cs.toronto.edu/~kriz/cifar-10-python",
                          f"extract it into {tmp_path / 'data'} (it makes cifar-10-batches-py/)",
                          "then run without --download")
    assert "failed on another host" not in proc.stdout + proc.stderr and "Downloading" not in proc.stdout, line
    assert not (tmp_path / "out").exists() and not list((tmp_path / "data").iterdir())


def test_every_rank_needs_samples_and_a_whole_batch_of_them():
    check_shards(num_train=8, world_size=2, batch_per_step=4)
    with pytest.raises(ConfigError, match=r"1 training sample\(s\) cannot be shared by 2 ranks"):
        check_shards(num_train=1, world_size=2, batch_per_step=1)
    with pytest.raises(ConfigError, match="each of the 2 ranks holds only 5 of the 9 training samples"):
        check_shards(num_train=9, world_size=2, batch_per_step=6)


@pytest.mark.distributed
def test_a_batch_larger_than_a_rank_s_shard_stops_both_ranks_with_one_message(tmp_path):
    # Found after Horovod started (the shard size needs the number of ranks): rank 0's message, every rank stops.
    # Under horovodrun, which tags each chunk a rank writes: the message must stay one whole line.
    proc = run_app("horovodrun-mpi", 2, "--output-dir", tmp_path / "out", "--batch-size", "1000", check=False)
    assert_refused(proc, "each of the 2 ranks holds only 719 of the 1438 training samples")


def write_corrupt_tree(root):
    write_image_folder(root, per_class=6, size=12, ext="jpg")
    broken = root / "dog" / "broken.jpg"
    broken.write_bytes((root / "dog" / "0.jpg").read_bytes()[:300])  # a JPEG cut short, as a failed copy leaves it


@pytest.mark.distributed
def test_a_corrupt_jpeg_met_by_a_loader_worker_is_named_in_one_line_and_the_job_ends(tmp_path):
    write_corrupt_tree(tmp_path / "data")
    proc = run_app("mpirun", 2, "--output-dir", tmp_path / "out", "--dataset", "imagefolder", "--data-dir",
                   tmp_path / "data", "--image-size", "12", "--batch-size", "2", "--epochs", "1", "--workers", "2",
                   check=False)
    # The rank that met it exits 5, the one waiting for it 1: MPICH's mpirun exits with their bitwise OR, 5 (a 2
    # read 3, a diverged run's code); OpenMPI's with the code of the rank that ended first.
    assert proc.returncode == EXIT_BAD_DATA if find_mpirun()[1] == "hydra" else \
        proc.returncode in (EXIT_BAD_DATA, EXIT_FAILED), proc.returncode
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if "broken.jpg" in line]
    assert len(lines) == 1 and "cannot read this image" in lines[0] and "--data.skip_bad_files" in lines[0], output
    assert "Traceback" not in app_output(output) and "DataLoader worker" not in output, output[-3000:]


def test_an_unreadable_image_is_one_line_naming_it_and_exits_with_the_bad_data_code(tmp_path, app):
    write_corrupt_tree(tmp_path / "data")
    result = app("--output-dir", tmp_path / "out", "--dataset", "imagefolder", "--data-dir", tmp_path / "data",
                 "--image-size", "12", "--batch-size", "2", "--epochs", "1")
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_BAD_DATA == 5, output[-3000:]  # docs/reliability.md: its own code
    lines = [line for line in output.splitlines() if "error:" in line]
    assert len(lines) == 1 and "broken.jpg: cannot read this image" in lines[0], output[-3000:]
    assert "Traceback" not in output


def test_skip_bad_files_leaves_out_and_counts_the_corrupt_image(tmp_path, app):
    write_corrupt_tree(tmp_path / "data")
    result = app("--output-dir", tmp_path / "out", "--dataset", "imagefolder", "--data-dir", tmp_path / "data",
                 "--image-size", "12", "--batch-size", "2", "--epochs", "1", "--data.skip_bad_files")
    assert result.returncode == 0 and "left out 1 image(s) that do not decode" in result.stdout, result.stderr
    assert "broken.jpg" in result.stdout
    summary = read_json(tmp_path / "out" / "summary.json")
    assert summary["history"][0]["val_count"] + 14 == 18  # 18 good images, 20% held out (4), 14 for training
