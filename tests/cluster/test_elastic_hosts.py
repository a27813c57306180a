"""Elastic training across hosts (tests/cluster.py: network namespaces with their own hostnames and sshd): a host
that dies mid-epoch, a host that joins a running job, and the loss of the host that holds rank 0. Each job ends
with exit 0, redoes at most one commit interval and reaches the accuracy bar."""
import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from cluster import IFACE, Cluster
from conftest import BIN, ROOT, WORKERS, read_json
from hvd_train.run import checkpoint as resume

# Namespace hosts have fixed names: one cluster at a time (make test runs files side by side).
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("cluster")]
COMMIT_EVERY = 5
EPOCHS = 8


def elastic_job(cluster, hosts_file, out, np, script=ROOT / "train_hvd.py", script_args=(), extra=()):
    """horovodrun in elastic mode on the first host, the hosts read from `hosts_file` (an operator's list)."""
    cmd = [BIN / "horovodrun", "-np", np, "--min-np", "1", "--max-np", "2", "--host-discovery-script",
           ROOT / "hostfiles" / "discover_hosts.py", "--network-interface", IFACE, *cluster.horovodrun_ssh(),
           sys.executable, script, *script_args, "--elastic", "--output-dir", out, "--epochs", EPOCHS,
           "--horovod.commit_every", COMMIT_EVERY, "--logging.progress=false", "--logging.tensorboard=false",
           "--logging.plot=false", *extra]
    return cluster.popen(cluster.hosts[0], cmd, env={"HVD_HOSTS_FILE": str(hosts_file), "OMP_NUM_THREADS": "1"},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def follow(job, on_line, out):
    """Read the job's output to its end, calling on_line(line) for each; returns the whole output. A job still
    running after 420 s (a hang, not slowness: these jobs take a minute or two) has its workers print their Python
    stacks into the output (train_hvd.py's SIGUSR2; `out` is the job's --output-dir, which names its workers) and
    is killed 5 s later, so that the failure shows where it hung instead of being lost to pytest's own timeout."""
    lines = []

    def hung():
        for proc in workers_of(out):
            proc.send_signal(signal.SIGUSR2)
        threading.Timer(5, job.kill).start()

    stopper = threading.Timer(420, hung)
    stopper.start()
    try:
        for line in job.stdout:
            lines.append(line)
            on_line(line)
        job.wait(timeout=120)
    finally:
        stopper.cancel()
        if job.poll() is None:
            job.kill()
    return "".join(lines)


def workers_of(out):
    """The training processes of the job writing to `out`, on every host (the hosts share this machine's pids)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        cmdline = " ".join(argv)
        # Python processes only: the ssh client and the remote shell that started a worker name the same script and
        # folder, and SIGUSR2 ends them, cutting the worker's stack dump off on its way back.
        if argv and "python" in os.path.basename(argv[0]) and "train_hvd.py" in cmdline and str(out) in cmdline \
                and "horovodrun" not in cmdline:
            found.append(proc)
    return found


def check_finished(job, output, out, world_size):
    assert job.returncode == 0, output[-12000:]
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == world_size and summary["params_in_sync"]
    assert [h["epoch"] for h in summary["history"]] == list(range(1, EPOCHS + 1))
    assert all(h["val_count"] == 359 for h in summary["history"])
    assert 0 <= summary["elastic"]["steps_redone"] <= COMMIT_EVERY
    assert summary["final_val_acc1"] > 90.0
    return summary


@pytest.fixture
def three_hosts(tmp_path):
    with Cluster(tmp_path, 3, names="own") as cluster:
        yield cluster


@pytest.fixture
def two_loopback_hosts(tmp_path):
    with Cluster(tmp_path, 2, names="loopback") as cluster:
        yield cluster


def kill_after_epoch_1(cluster, victim, killed):
    def on_line(line):
        if not killed and f"epoch 1/{EPOCHS}" in line:  # epoch 1 is over: the kill lands early in epoch 2
            cluster.kill_host(victim)
            killed.append(victim.name)
    return on_line


def run_losing_host(cluster, workers, victim, out):
    """An elastic job with one worker on each of `workers`; `victim` dies early in epoch 2. The others finish."""
    hosts = out.parent / "hosts.txt"
    hosts.write_text("".join(f"{h.name}:1\n" for h in workers))
    killed = []
    job = elastic_job(cluster, hosts, out, np=len(workers))
    output = follow(job, kill_after_epoch_1(cluster, victim, killed), out)
    assert killed, output[-3000:]
    return output, check_finished(job, output, out, world_size=len(workers) - 1)


def test_a_host_that_dies_mid_epoch_leaves_the_other_to_finish(two_loopback_hosts, tmp_path):
    # Loopback-resolving hostnames too: elastic jobs always run over Gloo, which aborted on them before the patch.
    cluster, out = two_loopback_hosts, tmp_path / "run"
    a, b = cluster.hosts
    output, summary = run_losing_host(cluster, [a, b], b, out)
    assert "workers changed: now 1" in output
    assert summary["elastic"]["resets"] >= 1


def test_the_loss_of_the_host_of_rank_0_leaves_a_new_rank_0_writing(three_hosts, tmp_path):
    # The launcher's host runs no worker (a login node); rank 0 is on node-b, which dies.
    cluster, out = three_hosts, tmp_path / "run"
    _, b, c = cluster.hosts
    run_losing_host(cluster, [b, c], b, out)
    # The new rank 0 wrote every epoch's checkpoint after the loss, and the summary.
    assert resume.load(str(out / "checkpoints" / "last.pt"))["epoch"] == EPOCHS
    metrics = [line for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(metrics) >= EPOCHS


class Growth:
    """A job that starts on `first` alone; after its first epoch the operator adds `second` to the host list.
    Alone from then on, the worker takes 0.2 s a step (tests/workers/paced_train.py), so the job cannot end before
    the host joins. `events` records what happened, in order; on_line(line) follows the job's output."""

    def __init__(self, hosts_file, first, second):
        self.hosts_file, self.first, self.second, self.events = hosts_file, first, second, []
        hosts_file.write_text(f"{first.name}:1\n")

    def on_line(self, line):
        if not self.events and f"epoch 1/{EPOCHS}" in line:
            self.hosts_file.write_text(f"{self.first.name}:1\n{self.second.name}:1\n")
            self.events.append("added")
        elif self.events == ["added"] and "workers changed: now 2" in line:
            self.events.append("grown")

    def job(self, cluster, out, extra=()):
        return elastic_job(cluster, self.hosts_file, out, np=1, script=WORKERS / "paced_train.py",
                           script_args=("0.2", "45", "--"), extra=extra)


def test_a_host_that_joins_grows_the_job_and_the_rate_and_shards_follow(three_hosts, tmp_path):
    cluster, out = three_hosts, tmp_path / "run"
    a, b, _ = cluster.hosts
    growth = Growth(tmp_path / "hosts.txt", a, b)
    job = growth.job(cluster, out, extra=("--lr-schedule", "constant", "--data.drop_last", "false"))
    output = follow(job, growth.on_line, out)
    assert growth.events == ["added", "grown"], output[-3000:]
    summary = check_finished(job, output, out, world_size=2)
    history = summary["history"]
    # The rate is scaled by the number of workers: 0.025 alone, 0.05 once two train.
    assert history[0]["lr"] == pytest.approx(0.025) and history[-1]["lr"] == pytest.approx(0.05)
    # The elastic sampler shards each later epoch between both: every training sample once, none twice.
    assert history[-1]["train_count"] == 1438


@pytest.mark.extended
def test_a_worker_that_joined_writes_the_whole_run_when_the_first_host_dies(three_hosts, tmp_path):
    # node-b trains alone, node-c joins after epoch 1, node-b (rank 0) dies after epoch 3: node-c, which saw
    # neither epoch 1 nor the start, finishes as rank 0 and writes the whole history.
    cluster, out = three_hosts, tmp_path / "run"
    _, b, c = cluster.hosts
    growth = Growth(tmp_path / "hosts.txt", b, c)

    def on_line(line):
        growth.on_line(line)
        if growth.events == ["added", "grown"] and f"epoch 3/{EPOCHS}" in line:
            cluster.kill_host(b)
            growth.events.append("killed")

    job = growth.job(cluster, out)
    output = follow(job, on_line, out)
    assert growth.events == ["added", "grown", "killed"], output[-3000:]
    summary = check_finished(job, output, out, world_size=1)
    assert summary["elastic"]["resets"] >= 2
