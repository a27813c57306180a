"""Runs that never lie: a full disk that stops every rank with one message and leaves one record per epoch,
interruptions (Ctrl-C, SIGTERM) that say where the run stopped, bad paths refused before anything is built, and
Horovod's autotuner left free to tune. (Resumes that refuse what they cannot continue: test_resume.py.)"""
import json
import os
import re
import signal
import subprocess

import pytest

from hvd_train.run import checkpoint as resume
from conftest import (BIN, QUIET, ROOT, TRAIN, WORKERS, app_output, assert_refused, epochs_in, find_mpirun, job_env,
                      launch_command, read_json, run_app, tensorboard_steps, train_here, wait_for)

TENSORBOARD = "--logging.tensorboard=true"  # these tests read the events back


def train(launcher, np, run, *args, check=True, env=None):
    return run_app(launcher, np, "--output-dir", run, TENSORBOARD, *args, check=check, env=env)


# --------------------------------------------------------------------------------------------------------------------
# A full disk


@pytest.fixture
def small_disk(tmp_path):
    """A directory on a tmpfs of a size set with resize(bytes); unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")

    def resize(size):
        subprocess.run(["mount", "-o", f"remount,size={size}", str(mount)], check=True)

    yield mount, resize
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.distributed
def test_a_full_disk_stops_every_rank_with_one_message_and_resuming_keeps_one_record_per_epoch(tmp_path, small_disk,
                                                                                               app):
    # The size of one checkpoint of this model, from a run on the ordinary disk.
    probe = tmp_path / "probe"
    train_here(app, probe, "--epochs", 1)
    size = (probe / "checkpoints" / "epoch_0001.pt").stat().st_size
    disk, resize = small_disk
    run = disk / "run"
    # Room for the small files and two checkpoints, not three: epoch 3's checkpoint fails.
    resize(2 * size + size // 2 + 256 * 1024)
    proc = train("horovodrun-gloo", 2, run, "--epochs", 6, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in app_output(output), output[-3000:]
    lines = [line for line in output.splitlines() if "train_hvd.py: error:" in line]
    assert len(lines) == 1, output[-3000:]
    assert re.search(r"could not write \S+epoch_0003\.pt: no space left on the device \([\d.]+ MB free", lines[0])
    assert "--resume auto continues from the newest" in lines[0]
    assert "stopping because another rank failed" not in output  # every rank heard of it and stopped with rank 0
    assert resume.load(str(run / "checkpoints" / "last.pt"))["epoch"] == 2
    assert epochs_in(run) == [1, 2]  # no record of the epoch whose checkpoint failed
    resize("64m")
    train("horovodrun-gloo", 2, run, "--epochs", 6, "--resume", "auto")
    assert epochs_in(run) == [1, 2, 3, 4, 5, 6]
    assert tensorboard_steps(run) == [1, 2, 3, 4, 5, 6]


# --------------------------------------------------------------------------------------------------------------------
# Interruptions


def start(launcher, np, run, log, *args, script=TRAIN, script_args=(), env=None):
    """Start a long run in its own process group, as a shell starts a job; returns the Popen."""
    cmd = launch_command(launcher, np, [str(script), *map(str, script_args), "--output-dir", str(run), *QUIET,
                                        TENSORBOARD, "--epochs", "300", *map(str, args)])
    return subprocess.Popen(cmd, cwd=ROOT, env={**job_env(), **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def finished_epochs(run):
    return epochs_in(run) if (run / "metrics.jsonl").exists() else []


def interrupted(proc, log, *signums):
    """The job ended on one of the signals (horovodrun --gloo turns a Ctrl-C into SIGTERM for the ranks), and the
    launcher's own exit status says so; returns its output and the epochs done in the checkpoint its message says
    --resume auto continues from (a checkpoint taken within epoch N, which SIGTERM and SIGUSR1 have written at the
    next step: N - 1)."""
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    name = "(?:" + "|".join(signal.Signals(n).name for n in signums) + ")"
    assert proc.returncode != 0, output[-3000:]
    assert "Traceback" not in app_output(output), output[-3000:]
    said = re.findall(rf"train_hvd.py: interrupted by {name} at (epoch (\d+)/300, after (\d+) step\(s\) of it|the "
                      rf"end of epoch (\d+)/300); --resume auto continues from (\S+) \((?:the end of epoch (\d+)|"
                      rf"epoch (\d+), after step (\d+) of it)\)", output)
    assert len(said) == 1, output[-3000:]
    _, running, steps, ended, last, saved, within, saved_steps = said[0]
    assert last.endswith("checkpoints/last.pt")
    if within:  # saved at the step every rank stopped at
        assert (running, steps) == (within, saved_steps), said
        return output, int(within) - 1
    # Mid-epoch: the checkpoint is the previous epoch's (one each epoch); at an epoch's end, that epoch's.
    assert (int(running) == int(saved) + 1) if running else (int(ended) == int(saved)), said
    return output, int(saved)


@pytest.mark.distributed
@pytest.mark.parametrize("launcher,target,signum,workers", [
    # With loader workers (--workers 2), which the launchers' signals reach too (the ranks' process groups, every
    # descendant of horovodrun): they must not die of it before the ranks have agreed on a step and saved.
    ("horovodrun-gloo", "group", signal.SIGINT, 2),   # Ctrl-C in a terminal: the whole foreground group
    pytest.param("horovodrun-gloo", "launcher", signal.SIGTERM, 2, marks=pytest.mark.extended),
    ("horovodrun-mpi", "launcher", signal.SIGINT, 0),  # kill -INT <horovodrun's pid>, as the README says
    pytest.param("horovodrun-mpi", "launcher", signal.SIGTERM, 2, marks=pytest.mark.extended),
    ("mpirun", "launcher", signal.SIGTERM, 2),
    ("single", "group", signal.SIGINT, 0),
])
def test_an_interrupted_run_says_where_it_stopped_and_resumes_from_there(tmp_path, launcher, target, signum, workers):
    run, log = tmp_path / "run", tmp_path / "log"
    np = 1 if launcher == "single" else 2
    with open(log, "w") as out:
        # OpenMPI's mpirun passes its SIGTERM on to the ranks after OMPI_MCA_odls_base_sigkill_timeout seconds and
        # kills them as long after it: 1 s by default, which a checkpoint at the next step may need more than on a
        # busy machine.
        proc = start(launcher, np, run, out, "--workers", workers, env={"OMPI_MCA_odls_base_sigkill_timeout": "3"})
        wait_for(lambda: len(finished_epochs(run)) >= 2 or proc.poll() is not None, "two epochs")
        (os.killpg if target == "group" else os.kill)(proc.pid, signum)
        # What docs/reliability.md says: one process reports the signal and exits 128 + it; horovodrun and
        # OpenMPI's mpirun catch it, end their ranks with SIGTERM (the ranks' process groups are their own, which
        # a terminal's Ctrl-C does not reach); OpenMPI's mpirun (and horovodrun --mpi, which becomes it) exits 1,
        # horovodrun --gloo with the code of the rank that ended first, 143. Hydra, the mpirun of MPICH and Intel
        # MPI, passes the signal itself on and exits with the ranks' code.
        passes_it_on = launcher == "single" or (launcher != "horovodrun-gloo" and find_mpirun()[1] == "hydra")
        reported = signum if passes_it_on else signal.SIGTERM
        output, saved = interrupted(proc, log, reported)
        # (137 where the rank that ended first had to be killed after the grace period, on a very busy machine)
        expected = {128 + signum} if passes_it_on else {143, 137} if launcher == "horovodrun-gloo" else {1}
        assert proc.returncode in expected, (proc.returncode, output[-3000:])
    assert resume.load(str(run / "checkpoints" / "last.pt"))["epoch"] == saved
    assert not (run / "summary.json").exists()
    train(launcher, np, run, "--epochs", saved + 1, "--resume", "auto")
    assert epochs_in(run) == list(range(1, saved + 2))


@pytest.mark.distributed
def test_slurm_s_warning_saves_at_a_step_every_rank_agrees_on_and_exits_to_be_requeued(tmp_path):
    # SIGUSR1, as SLURM's --signal=B:USR1@SECONDS sends it to the batch script and the script to mpirun, which passes
    # it to every rank: the ranks agree on a step, rank 0 writes a checkpoint there, and every rank exits 75.
    run, log = tmp_path / "run", tmp_path / "log"
    with open(log, "w") as out:
        proc = start("mpirun", 2, run, out)
        wait_for(lambda: len(finished_epochs(run)) >= 1 or proc.poll() is not None, "an epoch")
        proc.send_signal(signal.SIGUSR1)
        output, saved = interrupted(proc, log, signal.SIGUSR1)
    assert proc.returncode == 75, output[-3000:]
    assert re.search(r"train_hvd.py: SIGUSR1 at epoch \d+/300, after \d+ step\(s\) of it: every rank saves a "
                     r"checkpoint at its next step, then stops", output), output[-3000:]
    last = resume.load(str(run / "checkpoints" / "last.pt"))
    position = last["partial"]
    assert last["epoch"] == saved == position["epoch"] - 1 and len(position["sums"]) == 2  # both ranks' sums
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*.pt")) == [f"step_{last['step']:08d}.pt"]
    proc = train("mpirun", 2, run, "--epochs", position["epoch"], "--resume", "auto")
    assert (f"resumed within epoch {position['epoch']}: epoch {position['epoch']} continues after its step "
            f"{position['steps']}, each rank where it was") in proc.stdout
    assert epochs_in(run) == list(range(1, position["epoch"] + 1))


def test_horovodrun_keeps_the_exit_status_of_a_rank_it_ends():
    # horovodrun --gloo ends each rank's shell (Ctrl-C, a failed peer) from one thread of that rank's runner while
    # another thread waits for the shell. Horovod's ending thread reaped the shell itself when it ran first, as
    # happens on a busy machine, and the waiter then read the lost status as 0: horovodrun exited 0 after an
    # interrupted run. The build's patch makes the ending thread wait through the shell's Popen. Here it runs first
    # every time: the rank's status must survive it.
    import psutil
    from horovod.runner.common.util import safe_shell_exec

    shell = subprocess.Popen("cd / > /dev/null 2>&1 ; sleep 600", shell=True)  # horovodrun's form of command
    try:
        wait_for(lambda: psutil.Process(shell.pid).children(), "the rank under its shell")
        safe_shell_exec.terminate_executor_shell_and_children(shell.pid, shell)
        # The rank was ended by SIGTERM (the shell exits 143), or the shell was killed with it (-9).
        assert shell.wait(timeout=60) in (128 + signal.SIGTERM, -signal.SIGKILL)
    finally:
        shell.kill()


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", [pytest.param("single", marks=pytest.mark.extended), "horovodrun-gloo"])
def test_sigterm_during_a_checkpoint_write_lets_it_finish(tmp_path, launcher):
    run, log, markers = tmp_path / "run", tmp_path / "log", tmp_path / "markers"
    markers.mkdir()
    with open(log, "w") as out:
        proc = start(launcher, 1 if launcher == "single" else 2, run, out,
                     script=WORKERS / "held_checkpoint_train.py", script_args=(2, markers, "--"))
        wait_for(lambda: (markers / "writing").exists() or proc.poll() is not None, "epoch 2's checkpoint")
        os.kill(proc.pid, signal.SIGTERM)
        wait_for(lambda: (markers / "writing").exists(), "the signal")  # sent; the write is still held
        (markers / "go").touch()
        output, saved = interrupted(proc, log, signal.SIGTERM)
    assert saved == 2
    assert resume.load(str(run / "checkpoints" / "last.pt"))["epoch"] == 2


@pytest.mark.distributed
def test_horovodrun_signalled_gives_the_ranks_time_to_save_before_it_kills_them(tmp_path):
    # Stock Horovod's horovodrun --gloo kills the ranks 5 s after it passes a SIGTERM on; each rank here needs 8 s
    # to stop. hvd-train's build waits up to 30 s, so both end by themselves and their own exit status is reported.
    command = launch_command("horovodrun-gloo", 2, [str(WORKERS / "slow_to_stop.py"), str(tmp_path)])
    proc = subprocess.Popen(command, cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == 2 or proc.poll() is not None, "both ranks")
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    assert sorted(p.name for p in tmp_path.glob("stopped-*")) == ["stopped-0", "stopped-1"], output
    assert "exited with status 3" in output and "status code 137" not in output, output


def test_a_ranks_exit_status_survives_another_thread_reaping_its_runner(worker):
    # An elastic job's host discovery starts a process every second, and Process.start() polls every child: it reaped
    # a finished rank's runner first often enough that the rank counted as failed with exit code None.
    proc = subprocess.run([str(BIN / "python"), worker("reaped_runner.py"), "40"], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == [3] * 40


# --------------------------------------------------------------------------------------------------------------------
# Bad paths, checked before data and model are built


OUTPUT_DIRS = [("/proc/hvd-train-x", "cannot write there"), ("{file}", "is a file, not a directory")]


@pytest.mark.parametrize("output_dir,why", OUTPUT_DIRS)
def test_an_output_dir_that_cannot_be_written_is_refused_first(tmp_path, app, output_dir, why):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    output_dir = output_dir.format(file=a_file)
    # Before the data set is read: the MNIST files are not there, and that is not what the message says.
    assert_refused(app("--output-dir", output_dir, "--dataset", "mnist", "--data-dir", tmp_path / "absent"),
                   f"--output-dir {output_dir}: {why}")
    assert a_file.read_text() == "keep me"


@pytest.mark.distributed
def test_an_output_dir_that_cannot_be_written_stops_every_rank_under_horovodrun(tmp_path):
    # Under horovodrun: every rank stops with rank 0's message (horovodrun itself exits 1, naming exit code 2).
    proc = train("horovodrun-gloo", 2, "/proc/hvd-train-x", "--dataset", "mnist", "--data-dir", tmp_path / "absent",
                 check=False)
    assert_refused(proc, "--output-dir /proc/hvd-train-x: cannot write there")


def test_download_into_a_data_dir_that_is_a_file_is_refused(tmp_path, app):
    a_file = tmp_path / "data"
    a_file.write_text("keep me")
    result = app("--output-dir", tmp_path / "run", "--dataset", "mnist", "--download", "--data-dir", a_file)
    assert_refused(result, f"--data-dir {a_file}: is a file, not a directory")
    assert a_file.read_text() == "keep me" and not (tmp_path / "run" / "metrics.jsonl").exists()


# --------------------------------------------------------------------------------------------------------------------
# Autotune


@pytest.mark.distributed
def test_horovodrun_autotune_tunes_the_fusion_threshold_and_cycle_time(tmp_path):
    log = tmp_path / "autotune.csv"
    cmd = launch_command("horovodrun-gloo", 2, [str(TRAIN), "--output-dir", str(tmp_path / "run"), *QUIET,
                                                TENSORBOARD, "--epochs", "2"])
    cmd[1:1] = ["--autotune", "--autotune-log-file", str(log), "--autotune-warmup-samples", "1",
                "--autotune-steps-per-sample", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Horovod autotune is on: it tunes the fusion threshold and the cycle time while training" in proc.stdout
    with open(log) as f:
        header, *rows = [line.strip().split(",") for line in f if line.strip()]
    # One row per sample of the values Horovod tried; a value fixed in the environment would be the same in all.
    cycle, fusion = header.index("cycle_time_ms"), header.index("tensor_fusion_threshold")
    assert len({row[cycle] for row in rows}) > 1 and len({row[fusion] for row in rows}) > 1, rows[:5]
    assert read_json(tmp_path / "run" / "summary.json")["autotune"] is True
