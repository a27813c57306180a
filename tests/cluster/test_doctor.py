"""hvd-train doctor on namespace hosts (tests/cluster.py): a healthy cluster passes; each injected fault (sshd down,
a wrong interface name, loopback-resolving hostnames, another package version on one host) is named with its fix."""
import re
import subprocess
from pathlib import Path

import pytest

from cluster import IFACE, SSH_PORT, Cluster
from conftest import BIN

# Namespace hosts have fixed names: one cluster at a time (make test runs files side by side).
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("cluster")]


def doctor(cluster, *args, hostfile=None):
    """The doctor on the first host, for every host (as -H, or as a hostfile written to `hostfile`)."""
    if hostfile is None:
        where = ["-H", ",".join(f"{h.name}:1" for h in cluster.hosts)]
    else:
        hostfile.write_text("".join(f"{h.name} slots=1\n" for h in cluster.hosts))
        where = ["-hostfile", hostfile]
    return cluster.run(cluster.hosts[0], [BIN / "hvd-train", "doctor", *where, "-p", SSH_PORT,
                                          "-i", cluster.keys / "id", *args], timeout=600)


def rows(output, host, check):
    """(result, row, fix) of the report's rows for one host and check; the fix is the line under a problem."""
    lines, found = output.splitlines(), []
    for i, line in enumerate(lines):
        m = re.match(rf"{re.escape(host)}\s+{re.escape(check)}\s+(ok|WARN|FAIL)\s", line)
        if m:
            after = lines[i + 1].strip() if i + 1 < len(lines) else ""
            found.append((m.group(1), line, after if after.startswith("fix:") else ""))
    return found


def test_a_healthy_cluster_passes(tmp_path):
    with Cluster(tmp_path, 2, names="own") as cluster:
        proc = doctor(cluster, "--network-interface", IFACE, hostfile=tmp_path / "hosts")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for host in ("node-a", "node-b"):
        for check in ("ssh", "versions", "horovod build", "interface", "hostname", "slots", "mpirun", "clock",
                      "disk", "tcp"):
            [(status, _, _)] = rows(proc.stdout, host, check)
            assert status == "ok", proc.stdout
    assert "reaches node-b" in rows(proc.stdout, "node-a", "tcp")[0][1]
    # veth pairs have no device behind them: no nominal rate to compare with, said so.
    [(status, line, _)] = rows(proc.stdout, "node-a", "allreduce")
    assert status == "ok" and re.search(r"[\d.]+ [GM]b/s bus bandwidth \(\d+ MB in \d+ ms, MPI, 2 hosts, CPU "
                                        r"tensors\); the link's nominal rate is not readable here", line), line
    assert "0 problem(s)" in proc.stdout


def test_the_allreduce_bandwidth_is_that_of_the_link_between_the_hosts(tmp_path):
    # 20 Mb/s into node-b: a two-rank ring's bus bandwidth is what each link carries one way, so the doctor's figure
    # is at most the shaped rate (tbf's burst allows a little more), whatever the machine's speed.
    with Cluster(tmp_path, 2, names="own") as cluster:
        cluster.shape(cluster.hosts[1], "20mbit")
        proc = doctor(cluster, "--network-interface", IFACE, "--gloo")
    [(status, line, _)] = rows(proc.stdout, "node-a", "allreduce")
    figure = re.search(r"([\d.]+) Mb/s bus bandwidth \(\d+ MB in \d+ ms, Gloo, 2 hosts", line)
    assert status == "ok" and figure, proc.stdout + proc.stderr
    assert 1 < float(figure.group(1)) <= 22, line


def test_each_injected_fault_is_named_with_its_fix(tmp_path):
    # node-b: sshd down. node-c: another hvd-train version in its ssh sessions. Every hostname: loopback.
    fake = tmp_path / "other-version"
    (fake / "hvd_train-0.0.9.dist-info").mkdir(parents=True)
    (fake / "hvd_train-0.0.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: hvd-train\n"
                                                                 "Version: 0.0.9\n")
    # node-d: its host key is not the one known_hosts holds for it (what a man in the middle looks like).
    with Cluster(tmp_path, 4, names="loopback", ssh_env={"node-c": {"PYTHONPATH": fake}}) as cluster:
        cluster.stop_sshd(cluster.hosts[1])
        known = Path.home() / ".ssh" / "known_hosts"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", tmp_path / "other"], check=True)
        known.parent.mkdir(mode=0o700, exist_ok=True)
        kind, key = (tmp_path / "other.pub").read_text().split()[:2]
        with open(known, "a") as f:
            f.write(f"[node-d]:{SSH_PORT} {kind} {key}\n")
        try:
            proc = doctor(cluster, "--network-interface", "eth7")
        finally:
            subprocess.run(["ssh-keygen", "-R", f"[node-d]:{SSH_PORT}"], capture_output=True)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    [(status, _, fix)] = rows(out, "node-b", "ssh")
    assert status == "FAIL" and f"check that sshd runs on node-b on port {SSH_PORT}" in fix
    [(status, line, _)] = rows(out, "node-d", "ssh")
    assert status == "FAIL" and "IDENTIFICATION HAS CHANGED" in line and "Host key verification failed" in line
    [(status, line, _)] = rows(out, "node-c", "ssh")  # met for the first time: accepted, and said so
    assert status == "ok" and "its host key is now in known_hosts" in line, out
    [(status, line, fix)] = rows(out, "node-c", "versions")
    assert status == "FAIL" and "hvd-train 0.0.9 (here 0.1.0)" in line and "same versions" in fix
    for host in ("node-a", "node-c"):
        [(status, line, fix)] = rows(out, host, "interface")
        assert status == "FAIL" and "no interface eth7" in line and IFACE in line
        [(status, line, fix)] = rows(out, host, "hostname")
        assert status == "WARN" and f"{host} resolves to 127.0.1.1 (loopback)" in line and "/etc/hosts" in fix
    assert "a job would fail" in out


def test_a_hostfile_with_windows_line_endings_is_refused_before_any_host_is_contacted(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_bytes(b"node-a slots=1\r\nnode-b slots=1\r\n")
    proc = subprocess.run([BIN / "hvd-train", "doctor", "-hostfile", hostfile], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"{hostfile}:1: Windows line endings (CR LF), which mpirun -hostfile rejects" in proc.stderr


def test_a_name_that_does_not_resolve_and_more_cpu_ranks_than_cores_are_named(tmp_path):
    # No cluster needed: this host (local, no ssh) and a name no resolver knows (RFC 6761's .invalid).
    import os

    cores = len(os.sched_getaffinity(0))
    proc = subprocess.run([BIN / "hvd-train", "doctor", "-H", f"localhost:{cores + 2},node-9.invalid:1",
                           "--output-dir", tmp_path], capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    [(status, line, fix)] = rows(out, "node-9.invalid", "ssh")
    assert status == "FAIL" and "node-9.invalid does not resolve here" in line and "/etc/hosts" in fix, out
    assert "sshd" not in fix
    [(status, line, fix)] = rows(out, "localhost", "slots")
    assert status == "WARN" and f"{cores + 2} slot(s), no GPU, {cores} CPU core(s)" in line, out
    assert f"localhost:{cores} at most" in fix
