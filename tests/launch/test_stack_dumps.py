"""Every rank's stack on demand while a job runs: SIGUSR2 to horovodrun --gloo reaches its ranks; SIGUSR2 to one rank
under MPICH's mpirun (which dies of SIGUSR2 itself) reaches the others through the watchdog's heartbeat, even from a
rank whose peer is stopped; and each time the job goes on. (A rank stuck in its own work printing its stack after
--freeze-timeout: test_failures.py.)"""
import os
import re
import signal
import subprocess

import psutil
import pytest

from conftest import QUIET, ROOT, TRAIN, epochs_in, job_env, launch_command, wait_for

pytestmark = pytest.mark.distributed

HEADER = (r"train_hvd.py: rank (\d) \(host [^,]+, pid (\d+)\): every thread's Python stack, as (SIGUSR2 to this "
          r"process|SIGUSR2 to rank (\d), passed on to every rank) asked; the job goes on:")


def start(launcher, run, log):
    """A long two-rank run of the app in its own process group; ended by the test."""
    cmd = launch_command(launcher, 2, [str(TRAIN), "--output-dir", str(run), *QUIET, "--epochs", "300",
                                       "--workers", "0"])
    return subprocess.Popen(cmd, cwd=ROOT, env=job_env(), stdout=log, stderr=subprocess.STDOUT, text=True,
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


def goes_on_then_ends(proc, run, log):
    """One more epoch ends after the dumps; then the job is stopped (SIGTERM to its group) and its output returned."""
    done = len(epochs(run))
    try:
        wait_for(lambda: len(epochs(run)) > done or proc.poll() is not None, "an epoch after the stacks")
        assert proc.poll() is None, log.read_text()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return log.read_text()


def check_dumps(output):
    """Each header is followed by the stacks of that rank's threads, its main thread's in the app's recipe."""
    for header in re.finditer(HEADER, output):
        after = output[header.end():header.end() + 20000]
        assert re.search(r"Thread 0x[0-9a-f]+", after) and "train_hvd.py" in after, after[:3000]


def test_sigusr2_to_horovodrun_has_every_rank_write_its_stacks_and_the_job_goes_on(tmp_path):
    run, log = tmp_path / "run", tmp_path / "log"
    with open(log, "w") as out:
        proc = start("horovodrun-gloo", run, out)
        wait_for(lambda: len(epochs(run)) >= 1 or proc.poll() is not None, "an epoch")
        proc.send_signal(signal.SIGUSR2)
        wait_for(lambda: len(headers(log)) >= 2 or proc.poll() is not None, lambda: log.read_text()[-3000:])
        output = goes_on_then_ends(proc, run, log)
    assert "horovodrun: SIGUSR2 passed on to 2 process(es) of the job on this host" in output, output[-3000:]
    found = headers(log)
    assert sorted(int(rank) for rank, *_ in found) == [0, 1], found
    check_dumps(output)


def test_sigusr2_to_one_rank_reaches_every_rank_even_from_a_rank_whose_peer_is_stopped(tmp_path):
    run, log = tmp_path / "run", tmp_path / "log"
    with open(log, "w") as out:
        proc = start("mpirun", run, out)
        wait_for(lambda: len(epochs(run)) >= 1 or proc.poll() is not None, "an epoch")
        ranks = ranks_of(run)
        assert sorted(ranks) == [0, 1], ranks
        ranks[1].suspend()  # rank 0 soon waits for it in a collective, in C++, where it must still answer
        try:
            ranks[0].send_signal(signal.SIGUSR2)
            wait_for(lambda: headers(log) or proc.poll() is not None, lambda: log.read_text()[-3000:])
        finally:
            ranks[1].resume()
        # Rank 1 hears of the request in rank 0's next heartbeat and writes its own stacks.
        wait_for(lambda: len(headers(log)) >= 2 or proc.poll() is not None, lambda: log.read_text()[-3000:])
        output = goes_on_then_ends(proc, run, log)
    found = headers(log)
    assert [(int(rank), cause) for rank, _, cause, _ in found] == [
        (0, "SIGUSR2 to this process"), (1, "SIGUSR2 to rank 0, passed on to every rank")], found
    assert {int(pid) for _, pid, _, _ in found} == {p.pid for p in ranks.values()}
    check_dumps(output)
