"""A real two-host run on one machine: two network namespaces joined by a veth pair, each with its own address and
an sshd listening inside, and horovodrun and mpirun launching train_hvd.py across them. Traffic stays between the
two namespaces; everything is torn down afterwards, also on failure."""
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from conftest import BIN, ROOT, job_env, read_json, wait_for

pytestmark = pytest.mark.distributed
SSH_PORT = "2222"
IFACE = "hvdeth0"  # the same interface name inside both namespaces, as on a real cluster
ADDRESSES = ("10.213.0.1", "10.213.0.2")


def sh(*cmd, check=True):
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60, check=check)


@pytest.fixture
def two_hosts(tmp_path):
    """(namespace of host A, ssh options) with sshd running in both namespaces; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(sshd):
        pytest.skip("needs sshd (Debian: apt-get install openssh-server) to start ranks on the second host")
    tag = uuid.uuid4().hex[:6]
    namespaces = [f"hvdA{tag}", f"hvdB{tag}"]
    daemons = []
    try:
        for ns in namespaces:
            if sh("ip", "netns", "add", ns, check=False).returncode != 0:
                pytest.skip("this machine does not allow network namespaces (ip netns add failed)")
        sh("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        keys = tmp_path / "ssh"
        keys.mkdir()
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "id"))
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "host"))
        # horovodrun's ssh records host keys in ~/.ssh/known_hosts; an entry from an earlier run of this test
        # (another host key, same address) would make ssh refuse, so forget only these two test addresses.
        for address in ADDRESSES:
            sh("ssh-keygen", "-R", f"[{address}]:{SSH_PORT}", check=False)
        shutil.copy(keys / "id.pub", keys / "authorized_keys")
        for ns, veth, address in zip(namespaces, (f"va{tag}", f"vb{tag}"), ADDRESSES):
            sh("ip", "link", "set", veth, "netns", ns)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", veth, "name", IFACE)
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", IFACE)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", IFACE, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            config = keys / f"sshd_{ns}"
            config.write_text(f"Port {SSH_PORT}\nListenAddress {address}\nHostKey {keys / 'host'}\n"
                              f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
                              f"PasswordAuthentication no\nStrictModes no\nUsePAM no\nPidFile {keys / ns}.pid\n"
                              f"AcceptEnv *\nPermitUserEnvironment yes\n")
            os.makedirs("/run/sshd", exist_ok=True)
            daemons.append(subprocess.Popen(["ip", "netns", "exec", ns, sshd, "-D", "-e", "-f", str(config)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        ssh_options = ["-p", SSH_PORT, "-i", str(keys / "id"), "-o", "StrictHostKeyChecking=no",
                       "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
        probes = []

        def sshd_answers():  # in host B, from host A
            probes.append(sh("ip", "netns", "exec", namespaces[0], "ssh", *ssh_options, ADDRESSES[1], "true",
                             check=False))
            return probes[-1].returncode == 0

        wait_for(sshd_answers, lambda: f"sshd in {namespaces[1]} to answer: {probes[-1].stderr}", seconds=120)
        yield namespaces[0], ssh_options, keys
    finally:
        for daemon in daemons:
            daemon.kill()
            daemon.wait()
        for ns in namespaces:
            sh("ip", "netns", "del", ns, check=False)


def run_in(ns, cmd, timeout=300):
    env = job_env()
    proc = subprocess.run(["ip", "netns", "exec", ns, *cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def check_two_host_run(out, controller):
    summary = read_json(out / "summary.json")
    # Two hosts with one rank each: both ranks took part (world size 2, one rank per host) and agree.
    assert summary["world_size"] == 2 and summary["local_size"] == 1 and summary["controller"] == controller
    assert summary["params_in_sync"] and len(summary["params_fingerprints"]) == 2
    assert summary["history"][-1]["val_count"] == 359


def test_horovodrun_across_two_hosts(two_hosts, tmp_path):
    ns, ssh_options, keys = two_hosts
    hosts = ",".join(f"{a}:1" for a in ADDRESSES)
    run_in(ns, [str(BIN / "horovodrun"), "-np", "2", "-H", hosts, "--network-interface", IFACE,
                "-p", SSH_PORT, "--ssh-identity-file", str(keys / "id"),
                sys.executable, str(ROOT / "train_hvd.py"), "--output-dir", str(tmp_path / "run"), "--epochs", "1",
                "--logging.progress=false"])
    check_two_host_run(tmp_path / "run", "MPI")


def test_mpirun_across_two_hosts(two_hosts, tmp_path):
    ns, ssh_options, keys = two_hosts
    hosts = ",".join(f"{a}:1" for a in ADDRESSES)
    run_in(ns, [shutil.which("mpirun"), "-np", "2", "-H", hosts, "--allow-run-as-root", "-bind-to", "none",
                "-mca", "plm_rsh_args", " ".join(ssh_options), "-mca", "btl_tcp_if_include", IFACE,
                "-mca", "oob_tcp_if_include", IFACE, "-x", "PATH", "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED",
                sys.executable, str(ROOT / "train_hvd.py"), "--output-dir", str(tmp_path / "run"), "--epochs", "1",
                "--logging.progress=false"])
    check_two_host_run(tmp_path / "run", "MPI")
