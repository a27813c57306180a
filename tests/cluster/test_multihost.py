"""Real multi-host runs on one machine (tests/cluster.py: network namespaces with their own hostnames, /etc/hosts,
/dev/shm and sshd): horovodrun over MPI and Gloo and mpirun launch train_hvd.py across two hosts, also where every
hostname resolves to a loopback address (Debian's default), which made Horovod's Gloo abort before hvd-train
patched it."""
import sys

import pytest
import torch

from cluster import IFACE, Cluster
from conftest import BIN, ROOT, find_mpirun, read_json

# Namespace hosts have fixed names: one cluster at a time (make test runs files side by side).
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("cluster")]
TRAIN = [sys.executable, str(ROOT / "train_hvd.py"), "--epochs", "1", "--logging.progress=false"]


@pytest.fixture(params=["own", "loopback"])
def two_hosts(request, tmp_path):
    with Cluster(tmp_path, 2, names=request.param) as cluster:
        yield cluster


@pytest.fixture
def two_named_hosts(tmp_path):
    with Cluster(tmp_path, 2, names="own") as cluster:
        yield cluster


def run_ok(cluster, cmd, env=None):
    proc = cluster.run(cluster.hosts[0], cmd, env=env)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def check_two_host_run(out, controller):
    summary = read_json(out / "summary.json")
    # Two hosts with one rank each: both ranks took part (world size 2, one rank per host) and agree.
    assert summary["world_size"] == 2 and summary["local_size"] == 1 and summary["controller"] == controller
    assert summary["params_in_sync"] and len(summary["params_fingerprints"]) == 2
    assert summary["history"][-1]["val_count"] == 359


# Each controller once with the hosts' own names and once where they resolve to loopback; the other two pairings
# are extended.
@pytest.mark.parametrize("two_hosts, controller", [
    ("own", "--gloo"), ("loopback", "--mpi"),
    pytest.param("own", "--mpi", marks=pytest.mark.extended),
    pytest.param("loopback", "--gloo", marks=pytest.mark.extended),
], indirect=["two_hosts"])
def test_horovodrun_across_two_hosts(two_hosts, tmp_path, controller):
    hosts = ",".join(f"{h.name}:1" for h in two_hosts.hosts)
    run_ok(two_hosts, [BIN / "horovodrun", controller, "-np", "2", "-H", hosts, "--network-interface", IFACE,
                       *two_hosts.horovodrun_ssh(), *TRAIN, "--output-dir", tmp_path / "run"])
    check_two_host_run(tmp_path / "run", {"--gloo": "Gloo", "--mpi": "MPI"}[controller])


def test_mpirun_across_two_hosts(two_named_hosts, tmp_path):
    cluster = two_named_hosts
    hosts = ",".join(f"{h.name}:1" for h in cluster.hosts)
    mpirun, kind = find_mpirun()
    env = None
    if kind == "hydra":
        # MPICH's and Intel MPI's launcher: ssh's options from its environment; every rank gets this environment.
        options = ["-hosts", hosts, "-bind-to", "none", "-launcher", "ssh", "-iface", IFACE]
        env = {"HYDRA_LAUNCHER_EXTRA_ARGS": " ".join(cluster.ssh_options)}
    else:
        options = ["-H", hosts, "--allow-run-as-root", "--bind-to", "none", "-mca", "plm_rsh_args",
                   " ".join(cluster.ssh_options), "-mca", "btl_tcp_if_include", IFACE, "-mca", "oob_tcp_if_include",
                   IFACE, "-x", "PATH", "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED"]
    before = cluster.link_bytes(cluster.hosts[1])
    run_ok(cluster, [mpirun, "-np", "2", *options, *TRAIN, "--output-dir", tmp_path / "run"], env)
    check_two_host_run(tmp_path / "run", "MPI")
    # The gradients crossed the link, as between real nodes (each host has its own /dev/shm): every step sends
    # about the model's size each way, and an epoch has more than 20 steps.
    weights = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["model"]
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert cluster.link_bytes(cluster.hosts[1]) - before > 10 * model_bytes


def test_a_job_on_a_slow_link_is_found_communication_bound(two_named_hosts, tmp_path):
    """Two hosts on a 20 Mbit/s link and a model of 0.76M weights (3 MB of gradients a step) that computes little:
    every rank waits for the allreduce most of each step, and rank 0 says the job is communication-bound."""
    cluster = two_named_hosts
    for host in cluster.hosts:
        cluster.shape(host, "20mbit")
    hosts = ",".join(f"{h.name}:1" for h in cluster.hosts)
    proc = run_ok(cluster, [BIN / "horovodrun", "--gloo", "-np", "2", "-H", hosts, "--network-interface", IFACE,
                            *cluster.horovodrun_ssh(), *TRAIN, "--output-dir", tmp_path / "run", "--model", "vae",
                            "--model-args", "hidden=4000", "--batch-size", "128"])
    lines = [line for line in proc.stdout.splitlines() if "communication-bound: every rank" in line]
    assert len(lines) == 1 and "--bf16-allreduce" in lines[0] and "--batches-per-allreduce" in lines[0], proc.stdout
    assert "straggler:" not in proc.stdout, proc.stdout
    ranks = read_json(tmp_path / "run" / "summary.json")["timing"]["ranks"]
    assert [r["host"] for r in ranks] == ["node-a", "node-b"]
    assert all(r["allreduce_wait"] > max(r[p] for p in ("data", "compute", "optimizer", "other")) for r in ranks)
