"""Hosts on one machine for tests, as a cluster has them: each host a network namespace with its own hostname (a UTS
namespace), its own /etc/hosts (ip netns exec mounts /etc/netns/NS/hosts over it), its own /dev/shm and System V IPC
(a mount and an IPC namespace) and an sshd, all joined through a bridge in a namespace of its own, so no traffic
reaches this machine's own network. Hosts can be killed (every process in them, their link cut). Everything is
removed afterwards, also on failure.

Each host's namespaces are held by one process (`holder`), which every command on the host enters (nsenter). A shared
/dev/shm would let MPICH and Horovod move data between "hosts" through shared memory instead of their link: an MPI
run across two such hosts sent nothing over the veth pair.

names="own": every hostname resolves to the host's address everywhere. names="loopback": each host's /etc/hosts maps
its own name to 127.0.1.1, as Debian's installer, cloned VM images and many containers do.
"""
import os
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import job_env, wait_for

SSH_PORT = "2222"
IFACE = "hvdeth0"  # the same interface name on every host, as on a real cluster


def sh(*cmd, check=True):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=60, check=check)


@dataclass
class Host:
    name: str      # its hostname, what -H and host files use
    ns: str        # its network namespace
    address: str   # its address on IFACE
    veth: str      # the switch's end of its link
    holder: subprocess.Popen = None  # the process whose namespaces are the host's (network, mount, IPC, hostname)


class Cluster:
    def __init__(self, tmp_path, count, names, ssh_env=None):
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
            pytest.skip("needs root, iproute2 and unshare to make network namespaces")
        self.sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not os.path.exists(self.sshd):
            pytest.skip("needs sshd (Debian: apt-get install openssh-server) to start ranks on the other hosts")
        tag = uuid.uuid4().hex[:6]
        self.switch = f"hvdS{tag}"
        self.hosts = [Host(f"node-{chr(97 + i)}", f"hvd{chr(65 + i)}{tag}", f"10.213.0.{i + 1}", f"hv{tag}{i}")
                      for i in range(count)]
        self.keys = tmp_path / "ssh"
        self.daemons, self.made = {}, []
        self.ssh_options = ["-p", SSH_PORT, "-i", str(self.keys / "id"), "-o", "StrictHostKeyChecking=no",
                            "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
        self.names = names
        self.ssh_env = ssh_env or {}  # {host name: {variable: value}} set in that host's ssh sessions

    def __enter__(self):
        self.keys.mkdir()
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.keys / "id")
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.keys / "host")
        shutil.copy(self.keys / "id.pub", self.keys / "authorized_keys")
        # horovodrun's ssh records host keys in ~/.ssh/known_hosts; an entry from an earlier run (another host key,
        # the same name) would make ssh refuse, so forget only these hosts.
        for host in self.hosts:
            sh("ssh-keygen", "-R", f"[{host.name}]:{SSH_PORT}", check=False)
        self.add_namespace(self.switch)
        sh("ip", "netns", "exec", self.switch, "ip", "link", "add", "br0", "type", "bridge")
        sh("ip", "netns", "exec", self.switch, "ip", "link", "set", "br0", "up")
        for host in self.hosts:
            self.add_host(host)
        for host in self.hosts[1:]:
            wait_for(lambda: self.ssh(self.hosts[0], host, "true").returncode == 0,
                     lambda: f"sshd on {host.name}: {self.ssh(self.hosts[0], host, 'true').stderr}", seconds=120)
        return self

    def __exit__(self, *exc):
        for daemon in [*self.daemons.values(), *(h.holder for h in self.hosts if h.holder)]:
            daemon.kill()
            daemon.wait()
        for ns in self.made:
            self.kill_all_in(ns)
            sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)

    def add_namespace(self, ns):
        if sh("ip", "netns", "add", ns, check=False).returncode != 0:
            pytest.skip("this machine does not allow network namespaces (ip netns add failed)")
        self.made.append(ns)

    def hosts_file(self, host):
        own = "127.0.1.1" if self.names == "loopback" else host.address
        lines = ["127.0.0.1 localhost", f"{own} {host.name}"]
        lines += [f"{h.address} {h.name}" for h in self.hosts if h is not host]
        return "\n".join(lines) + "\n"

    def add_host(self, host):
        self.add_namespace(host.ns)
        os.makedirs(f"/etc/netns/{host.ns}", exist_ok=True)
        Path(f"/etc/netns/{host.ns}/hosts").write_text(self.hosts_file(host))
        sh("ip", "link", "add", host.veth, "type", "veth", "peer", "name", f"{host.veth}p")
        sh("ip", "link", "set", host.veth, "netns", self.switch)
        sh("ip", "netns", "exec", self.switch, "ip", "link", "set", host.veth, "master", "br0", "up")
        sh("ip", "link", "set", f"{host.veth}p", "netns", host.ns)
        for cmd in (["link", "set", f"{host.veth}p", "name", IFACE],
                    ["addr", "add", f"{host.address}/24", "dev", IFACE], ["link", "set", IFACE, "up"],
                    ["link", "set", "lo", "up"]):
            sh("ip", "netns", "exec", host.ns, "ip", *cmd)
        self.hold(host)
        config = self.keys / f"sshd_{host.ns}"
        config.write_text(f"Port {SSH_PORT}\nHostKey {self.keys / 'host'}\nAuthorizedKeysFile "
                          f"{self.keys / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
                          f"PasswordAuthentication no\nStrictModes no\nUsePAM no\nPidFile {self.keys / host.ns}.pid\n"
                          f"AcceptEnv *\nPermitUserEnvironment yes\n"
                          + "".join(f"SetEnv {k}={v}\n" for k, v in self.ssh_env.get(host.name, {}).items()))
        os.makedirs("/run/sshd", exist_ok=True)
        self.daemons[host.name] = subprocess.Popen(self.on(host, [self.sshd, "-D", "-e", "-f", config]),
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def hold(self, host):
        """The host's own mount (a private tmpfs on /dev/shm), IPC and UTS namespaces, held by a sleeping process."""
        script = (f"mount -t tmpfs -o size=2g,mode=1777 tmpfs /dev/shm && hostname {host.name} && echo up && "
                  "exec sleep inf")
        host.holder = subprocess.Popen(["ip", "netns", "exec", host.ns, "unshare", "--mount", "--propagation",
                                        "private", "--ipc", "--uts", "sh", "-c", script], stdout=subprocess.PIPE,
                                       text=True)
        if host.holder.stdout.readline().strip() != "up":  # blocks until the mount is made, or the shell ends
            pytest.fail(f"could not give {host.name} its own /dev/shm and IPC namespace (exit {host.holder.wait()})")

    def on(self, host, cmd):
        """`cmd` as a command line that runs on `host`: its network, hostname, /etc/hosts, /dev/shm and IPC."""
        return ["nsenter", "-t", str(host.holder.pid), "--net", "--mount", "--ipc", "--uts", "--",
                *[str(c) for c in cmd]]

    def ssh(self, src, dst, command):
        return sh(*self.on(src, ["ssh", *self.ssh_options, dst.name, command]), check=False)

    def popen(self, host, cmd, **kwargs):
        """Start `cmd` on `host` with the test environment (the venv first on PATH, the project importable)."""
        return subprocess.Popen(self.on(host, cmd), env={**job_env(), **kwargs.pop("env", {})}, **kwargs)

    def run(self, host, cmd, timeout=300, env=None):
        return subprocess.run(self.on(host, cmd), env={**job_env(), **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)

    def kill_all_in(self, ns):
        """SIGKILL every process in the namespace; returns the pids that were still there."""
        pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        return pids

    def stop_sshd(self, host):
        daemon = self.daemons.pop(host.name)
        daemon.kill()
        daemon.wait()

    def kill_host(self, host):
        """The host dies: every process on it is killed and its link is cut.

        The link is cut only once the killed processes are gone. SIGKILL takes effect asynchronously, and a process
        still exiting when the link went down closed its connections into the void: horovodrun's ssh session to
        the host then never ended, so Horovod's elastic driver never learned that the worker was gone, and the
        survivors waited in their next rendezvous for good (caught with py-spy in a hung run: the survivor in
        hvd.init(), the ssh to the dead host still connected). A real host that vanishes without closing its
        connections needs ssh keep-alives for the same reason (README, Elastic training)."""
        self.stop_sshd(host)
        wait_for(lambda: not self.kill_all_in(host.ns), f"the processes on {host.name} to exit after SIGKILL",
                 seconds=60)
        sh("ip", "netns", "exec", self.switch, "ip", "link", "set", host.veth, "down")

    def shape(self, host, rate):
        """Traffic into `host` limited to `rate` (tc's units: 20mbit), as on a slow link between real nodes."""
        sh("ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", host.veth, "root", "tbf", "rate", rate,
           "burst", "64kb", "latency", "500ms")

    def link_bytes(self, host):
        """Bytes that crossed the host's link so far, both ways (the switch's end of its veth pair)."""
        read = [sh("ip", "netns", "exec", self.switch, "cat", f"/sys/class/net/{host.veth}/statistics/{way}_bytes")
                for way in ("rx", "tx")]
        return sum(int(r.stdout) for r in read)

    def horovodrun_ssh(self):
        """horovodrun's options for reaching the hosts' sshd."""
        return ["-p", SSH_PORT, "--ssh-identity-file", str(self.keys / "id")]
