"""Two hosts on this machine joined by a slow link, for the bench's slow-link section: tests/cluster.py's namespace
hosts (each with its own network, /dev/shm and IPC, so MPI and Gloo send every byte over the link, and an sshd for
horovodrun), the link into each shaped with tc to `rate`. One rank a host."""
import contextlib
import os
import subprocess
import sys
from pathlib import Path

from common import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests"))
from cluster import IFACE, Cluster  # noqa: E402  (the suite's hosts: one definition of them)

PY = sys.executable
MASTER_PORT = "29517"


@contextlib.contextmanager
def two_hosts(workdir, rate):
    folder = Path(workdir) / "hosts"
    folder.mkdir()
    with Cluster(folder, 2, names="own") as cluster:
        for host in cluster.hosts:
            cluster.shape(host, rate)  # traffic into each host: the link is slow both ways
        yield cluster


def horovodrun(cluster, controller="mpi"):
    """horovodrun on the first host for one rank on each, over IFACE, ending in python."""
    hosts = ",".join(f"{h.name}:1" for h in cluster.hosts)
    return [os.path.join(os.path.dirname(PY), "horovodrun"), f"--{controller}", "-np", "2", "-H", hosts,
            "--network-interface", IFACE, *cluster.horovodrun_ssh(), PY]


def run(cluster, cmd, env, timeout=1800):
    """`cmd` on the first host; a failure stops the bench with its output."""
    proc = cluster.run(cluster.hosts[0], [str(c) for c in cmd], timeout=timeout, env=env)
    if proc.returncode != 0:
        sys.exit(f"bench: failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-3000:]}")
    return proc


def torchrun(cluster, args, env, timeout=1800):
    """A torchrun node on each host (one process each), rank 0's host the rendezvous, Gloo over IFACE."""
    first = cluster.hosts[0].address
    env = {**env, "GLOO_SOCKET_IFNAME": IFACE}
    procs = [cluster.popen(host, [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                                  "--node-rank", str(i), "--master-addr", first, "--master-port", MASTER_PORT,
                                  *[str(a) for a in args]], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
             for i, host in enumerate(cluster.hosts)]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"bench: torchrun failed ({[p.returncode for p in procs]}): {' '.join(map(str, args))}\n"
                 + "\n".join(o[-3000:] for o in outputs))
