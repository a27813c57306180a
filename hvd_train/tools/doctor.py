"""hvd-train doctor: check every host of a job before the job waits on a broken cluster.

    hvd-train doctor -H host1:4,host2:4 [-p PORT] [-i KEY] [--network-interface IFACE] [--gloo]
    hvd-train doctor -hostfile hostfiles/example.txt

Over ssh (the options horovodrun takes), a probe runs with this Python on every host and reports versions, Horovod's
build, interfaces, what the hostname resolves to, GPUs (and whether nvJPEG can use their hardware JPEG decoder),
mpirun, the clock and free disk; then every host opens a TCP connection to every other one on the interface, and one
rank a host measures the allreduce bandwidth through Horovod (and, on GPUs, which network NCCL chose). One
table, a fix under each problem; exit 1 when a job would fail (FAIL), 0 when it would run (WARN: it would, with
something to look at).

Here: the command, ssh to the hosts and the table; what a host's facts say (its rows) is
hvd_train/tools/doctor_checks.py, the programs sent to the hosts hvd_train/tools/doctor_probes.py.
"""
import argparse
import json
import os
import select
import shlex
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from hvd_train.hostfiles.validate import HostListError, parse, read_lines, resolve, windows_line_ending
from hvd_train.tools import doctor_network
from hvd_train.tools.doctor_checks import check_host
from hvd_train.tools.doctor_probes import CONNECT, LISTEN, PROBE

SSH_TIMEOUT = 60  # seconds for one ssh command: a host that does not answer within it is reported, not waited on
ALLREDUCE_TIMEOUT = 600  # seconds for the bandwidth job: horovodrun starting every host, then a few seconds' work


class Hosts:
    """How to reach the hosts: ssh options as horovodrun takes them; the launcher's own names run without ssh."""

    def __init__(self, args):
        self.args = args
        self.local_names = {"localhost", "127.0.0.1", socket.gethostname()}

    def command(self, host, code, *argv):
        python = [self.args.python, "-c", code, *[str(a) for a in argv]]
        if host in self.local_names:
            return python
        # accept-new: a host met for the first time is remembered, a host whose key changed is refused (as it
        # should be: that is what a man in the middle looks like); ssh's warnings are kept and shown.
        ssh = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new", "-o", "ConnectTimeout=10"]
        if self.args.ssh_port:
            ssh += ["-p", str(self.args.ssh_port)]
        if self.args.ssh_identity_file:
            ssh += ["-i", self.args.ssh_identity_file]
        return ssh + ["--", host, shlex.join(python)]

    def run(self, host, code, *argv):
        return subprocess.run(self.command(host, code, *argv), capture_output=True, text=True, timeout=SSH_TIMEOUT,
                              stdin=subprocess.DEVNULL)


class Report:
    def __init__(self):
        self.rows = []

    def add(self, host, check, status, detail, fix=""):
        self.rows.append((host, check, status, detail, fix))

    def print(self):
        width = max(len(r[0]) for r in self.rows) + 2
        print(f"{'host':<{width}}{'check':<16}{'result':<8}detail")
        for host, check, status, detail, fix in self.rows:
            print(f"{host:<{width}}{check:<16}{status:<8}{detail}")
            if fix:
                print(f"{'':<{width + 24}}fix: {fix}")
        fails = sum(r[2] == "FAIL" for r in self.rows)
        warns = sum(r[2] == "WARN" for r in self.rows)
        verdict = "a job would fail" if fails else "a job would start"
        print(f"\n{fails} problem(s), {warns} warning(s): {verdict}.")
        return 1 if fails else 0


def important(stderr):
    """What ssh said that matters: its warnings and its last words (a changed host key, a refused login)."""
    lines = [line.strip("@ \t") for line in stderr.strip().splitlines() if line.strip("@ \t")]
    warnings = [line for line in lines if "WARNING" in line.upper() or "IDENTIFICATION HAS CHANGED" in line]
    return list(dict.fromkeys(warnings[:2] + lines[-1:]))


def read_port(proc, seconds):
    """The port a LISTEN program prints first, or None when it prints none within `seconds`."""
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    line = proc.stdout.readline().strip() if ready else ""
    return int(line) if line.isdigit() else None


def probe_all(hosts, names):
    def probe(name):
        sent = time.time()
        try:
            proc = hosts.run(name, PROBE, hosts.args.output_dir)
        except subprocess.TimeoutExpired:
            return name, None, f"no answer within {SSH_TIMEOUT} s"
        if proc.returncode != 0:
            return name, None, "; ".join(important(proc.stderr) or [f"exit {proc.returncode}"])
        try:
            facts = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return name, None, f"the probe printed no report ({proc.stdout.strip()[-200:] or 'nothing'})"
        facts["ssh_warnings"] = [line for line in proc.stderr.splitlines() if line.lower().startswith("warning")]
        # The host read its clock between sending and answering: outside that window, the clocks disagree.
        facts["skew"] = min(0.0, facts["time"] - sent) + max(0.0, facts["time"] - time.time())
        return name, facts, ""

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(probe, names))


def check_links(report, hosts, reachable, args):
    """Every host connects to every other one over TCP, on the interface (or the address its name resolves to).
    Returns each host's address when every host reached every other one, else None."""
    def address(name, facts):
        if args.network_interface:
            return (facts["interfaces"].get(args.network_interface) or [None])[0]
        try:
            return socket.gethostbyname(name)
        except OSError:
            return None

    targets = {name: address(name, facts) for name, facts in reachable.items()}
    listeners, ports, connected = {}, {}, True
    try:
        for name, addr in targets.items():
            if addr is None:
                continue
            listeners[name] = subprocess.Popen(hosts.command(name, LISTEN, addr), stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, proc in listeners.items():
            port = read_port(proc, SSH_TIMEOUT)
            if port is None:
                report.add(name, "tcp", "FAIL", f"the listener started over ssh printed no port within {SSH_TIMEOUT} "
                           f"s", "check that ssh to this host works (the ssh row above)")
            else:
                ports[name] = port
        for name in reachable:
            peers = [(other, targets[other], ports[other]) for other in ports if other != name]
            if not peers:
                continue
            try:
                proc = hosts.run(name, CONNECT, json.dumps(peers))
                failed = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else \
                    {p[0]: proc.stderr.strip() for p in peers}
            except subprocess.TimeoutExpired:
                failed = {p[0]: f"no answer within {SSH_TIMEOUT} s" for p in peers}
            detail = ("cannot reach " + "; ".join(f"{k} ({v})" for k, v in failed.items())) if failed else \
                f"reaches {', '.join(p[0] for p in peers)}"
            report.add(name, "tcp", "FAIL" if failed else "ok", detail,
                       "open TCP between the hosts on every port (Horovod, Gloo, MPI and NCCL pick random ports), "
                       "or name an interface on a network that allows it" if failed else "")
            connected &= not failed
    finally:
        for proc in listeners.values():
            proc.kill()
            proc.wait()
    return targets if connected and len(ports) == len(reachable) else None


def interface_of(facts, address, args):
    """The interface the job's traffic leaves a host by: the one named, else the one holding its address."""
    if args.network_interface:
        return args.network_interface
    return next((name for name, addrs in facts["interfaces"].items() if address in addrs), None)


def check_network(report, reachable, targets, args):
    """One rank a host allreduces through horovodrun with the job's controller: the bus bandwidth beside the
    links' nominal rate; on GPU hosts NCCL's log says which network it chose."""
    # The environment's own horovodrun first (a venv), then PATH's (pip's scripts beside another Python).
    horovodrun = shutil.which("horovodrun", path=os.path.dirname(args.python)) or shutil.which("horovodrun")
    first = next(iter(reachable))
    if horovodrun is None:
        report.add(first, "allreduce", "FAIL", f"no horovodrun beside {args.python} nor on PATH",
                   "install Horovod into the environment the job uses (scripts/install.sh)")
        return
    cmd = [horovodrun, "-np", str(len(reachable)), "-H", ",".join(f"{name}:1" for name in reachable),
           "--gloo" if args.gloo else "--mpi"]
    if args.ssh_port:
        cmd += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        cmd += ["-i", args.ssh_identity_file]
    if args.network_interface:
        cmd += ["--network-interface", args.network_interface]
    cmd += [args.python, "-m", "hvd_train.tools.doctor_network"]
    env = {**os.environ, "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
    output, late = run_for_output(cmd, env)
    result = doctor_network.read_result(output)
    if result is None:
        said = [line for line in output.splitlines() if line.strip()][-2:]
        report.add(first, "allreduce", "FAIL", "the bandwidth job through horovodrun gave no result"
                   + (f" within {ALLREDUCE_TIMEOUT} s" if late else "") + (f": {' / '.join(said)}" if said else ""),
                   "run it by hand to see why: " + shlex.join(cmd))
        return
    speeds = [reachable[name]["link_mbit"].get(interface_of(reachable[name], targets[name], args))
              for name in reachable]
    report.add(first, "allreduce", *doctor_network.bandwidth_row(result, speeds))
    if result["device"] == "cuda":
        networks = doctor_network.nccl_networks(output)
        launcher = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}  # horovodrun passes these on
        for name, facts in reachable.items():
            report.add(name, "nccl transport", *doctor_network.nccl_row(
                name, networks.get(facts["hostname"].split(".")[0]), facts["infiniband"],
                {**facts["nccl_env"], **launcher}))


def run_for_output(cmd, env):
    """The command's output (stdout and stderr), and whether it ran past ALLREDUCE_TIMEOUT (then it is ended:
    SIGTERM, so that horovodrun ends its ranks, then SIGKILL)."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, env=env)
    except OSError as e:
        return f"{cmd[0]}: {e.strerror or e}", False
    try:
        return proc.communicate(timeout=ALLREDUCE_TIMEOUT)[0], False
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            output = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            output = proc.communicate()[0]
        return output or "", True


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="hvd-train doctor", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("-H", "--hosts", help="host:slots,... as horovodrun -H takes them")
    where.add_argument("-hostfile", "--hostfile", help="a hostfile (HOST slots=N lines), as horovodrun takes it")
    parser.add_argument("-p", "--ssh-port", type=int, help="ssh port on every host")
    parser.add_argument("-i", "--ssh-identity-file", help="ssh key")
    parser.add_argument("--network-interface", help="the interface the job will use (horovodrun's option)")
    parser.add_argument("--gloo", action="store_true", help="the job uses Gloo (no mpirun needed)")
    parser.add_argument("--output-dir", default="runs/latest", help="where the job will write (free disk)")
    parser.add_argument("--python", default=sys.executable, help="Python on every host (default: this one)")
    return parser.parse_args(argv)


def read_hosts(args):
    if args.hosts:
        lines, source = args.hosts.split(","), "-H"
    else:
        try:
            lines, source = read_lines(args.hostfile), args.hostfile
        except HostListError as e:
            sys.exit(f"hvd-train doctor: {e}")
    hosts, errors = parse(lines, live=bool(args.hosts))
    crlf = None if args.hosts else windows_line_ending(args.hostfile, lines)
    errors = errors or ([crlf] if crlf else [])
    if errors:
        number, message = errors[0]
        sys.exit(f"hvd-train doctor: {source}{'' if args.hosts else f':{number}'}: {message}")
    if not hosts:
        sys.exit(f"hvd-train doctor: {source} names no hosts")
    return hosts


def main(argv):
    args = parse_args(argv)
    # horovodrun starts the ranks in the launcher's directory on every host: a relative path means the same there.
    args.output_dir = os.path.abspath(args.output_dir)
    slots = dict(read_hosts(args))
    args.multi_host = len(slots) > 1
    hosts, report = Hosts(args), Report()
    local = json.loads(subprocess.run([args.python, "-c", PROBE, args.output_dir], capture_output=True, text=True,
                                      check=True, timeout=SSH_TIMEOUT).stdout.strip().splitlines()[-1])
    reachable = {}
    for name, facts, error in probe_all(hosts, list(slots)):
        unresolved = resolve(name) if facts is None else None
        if unresolved:  # ssh never got as far as a host
            report.add(name, "ssh", "FAIL", f"{name} does not resolve here ({unresolved})",
                       f"fix the name in the host list, or map {name} to its address in /etc/hosts (mpirun and "
                       f"horovodrun need it to resolve on every host)")
            continue
        if facts is None:
            report.add(name, "ssh", "FAIL", error,
                       f"check that sshd runs on {name}"
                       + (f" on port {args.ssh_port}" if args.ssh_port else "")
                       + " and accepts this key without a password (horovodrun and mpirun log in the same way)")
            continue
        warned = [w for w in facts.get("ssh_warnings", []) if "Permanently added" not in w]
        if name in hosts.local_names:
            detail = "this host"
        elif warned:
            detail = "; ".join(warned)
        else:
            added = any("Permanently added" in w for w in facts.get("ssh_warnings", []))
            detail = "answers" + (" (its host key is now in known_hosts)" if added else "")
        report.add(name, "ssh", "WARN" if warned else "ok", detail,
                   "read ssh's warning: horovodrun and mpirun log in the same way" if warned else "")
        reachable[name] = facts
        check_host(report, name, slots[name], facts, local, args)
    if len(reachable) > 1:
        targets = check_links(report, hosts, reachable, args)
        # Only where a job could start: with a problem above, horovodrun would fail on it first, or wait.
        if targets is not None and len(reachable) == len(slots) and all(r[2] != "FAIL" for r in report.rows):
            check_network(report, reachable, targets, args)
    print(f"hvd-train doctor: {len(slots)} host(s), {sum(slots.values())} slot(s)"
          + (f", interface {args.network_interface}" if args.network_interface else "")
          + f", controller {'Gloo' if args.gloo else 'MPI'}\n")
    return report.print()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
