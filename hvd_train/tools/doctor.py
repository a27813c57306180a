"""hvd-train doctor: check every host of a job before the job waits on a broken cluster.

    hvd-train doctor -H host1:4,host2:4 [-p PORT] [-i KEY] [--network-interface IFACE] [--gloo]
    hvd-train doctor -hostfile hostfiles/example.txt

Over ssh (the options horovodrun takes), a probe runs with this Python on every host and reports versions, Horovod's
build, interfaces, what the hostname resolves to, GPUs (and whether nvJPEG can use their hardware JPEG decoder),
mpirun, the clock and free disk; then every host opens a TCP connection to every other one on the interface, and one
rank a host measures the allreduce bandwidth through Horovod (and, on GPUs, which network NCCL chose). One
table, a fix under each problem; exit 1 when a job would fail (FAIL), 0 when it would run (WARN: it would, with
something to look at).

Here: the command, ssh to the hosts and the table (Hosts, Report, main); the rows of one host's probe, each a result
and a fix, from the facts the host sent and the facts of the host the doctor runs on (check_host, nvjpeg_check); and
the programs sent to the hosts (PROBE, LISTEN, CONNECT), run with each host's Python and sent as text, so that
nothing has to be installed there but Python itself. The bandwidth job and its rows are
hvd_train/tools/doctor_network.py's.
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
from typing import IO, Any, Optional, Sequence, Union, cast

from hvd_train.hostfiles.validate import HostListError, parse, read_lines, resolve, windows_line_ending
from hvd_train.tools import doctor_network

SSH_TIMEOUT = 60  # seconds for one ssh command: a host that does not answer within it is reported, not waited on
ALLREDUCE_TIMEOUT = 600  # seconds for the bandwidth job: horovodrun starting every host, then a few seconds' work


class Hosts:
    """How to reach the hosts: ssh options as horovodrun takes them; the launcher's own names run without ssh."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.local_names = {"localhost", "127.0.0.1", socket.gethostname()}

    def command(self, host: str, code: str, *argv: object) -> list[str]:
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

    def run(self, host: str, code: str, *argv: object) -> "subprocess.CompletedProcess[str]":
        return subprocess.run(self.command(host, code, *argv), capture_output=True, text=True, timeout=SSH_TIMEOUT,
                              stdin=subprocess.DEVNULL)


class Report:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str, str]] = []

    def add(self, host: str, check: str, status: str, detail: str, fix: str = "") -> None:
        self.rows.append((host, check, status, detail, fix))

    def print(self) -> int:
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


def important(stderr: str) -> list[str]:
    """What ssh said that matters: its warnings and its last words (a changed host key, a refused login)."""
    lines = [line.strip("@ \t") for line in stderr.strip().splitlines() if line.strip("@ \t")]
    warnings = [line for line in lines if "WARNING" in line.upper() or "IDENTIFICATION HAS CHANGED" in line]
    return list(dict.fromkeys(warnings[:2] + lines[-1:]))


def read_port(proc: "subprocess.Popen[str]", seconds: float) -> Optional[int]:
    """The port a LISTEN program prints first, or None when it prints none within `seconds`."""
    ready, _, _ = select.select([cast(IO[str], proc.stdout)], [], [], seconds)
    line = cast(IO[str], proc.stdout).readline().strip() if ready else ""
    return int(line) if line.isdigit() else None


def probe_all(hosts: Hosts, names: list[str]) -> list[tuple[str, Optional[dict[str, Any]], str]]:
    def probe(name: str) -> tuple[str, Optional[dict[str, Any]], str]:
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


def check_links(report: Report, hosts: Hosts, reachable: dict[str, dict[str, Any]],
                args: argparse.Namespace) -> Optional[dict[str, Optional[str]]]:
    """Every host connects to every other one over TCP, on the interface (or the address its name resolves to).
    Returns each host's address when every host reached every other one, else None."""
    def address(name: str, facts: dict[str, Any]) -> Optional[str]:
        if args.network_interface:
            return (facts["interfaces"].get(args.network_interface) or [None])[0]
        try:
            return socket.gethostbyname(name)
        except OSError:
            return None

    targets = {name: address(name, facts) for name, facts in reachable.items()}
    listeners, ports, connected = {}, {}, True
    proc: Union["subprocess.Popen[str]", "subprocess.CompletedProcess[str]"]
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


def interface_of(facts: dict[str, Any], address: Optional[str], args: argparse.Namespace) -> Optional[str]:
    """The interface the job's traffic leaves a host by: the one named, else the one holding its address."""
    if args.network_interface:
        return args.network_interface
    return next((name for name, addrs in facts["interfaces"].items() if address in addrs), None)


def check_network(report: Report, reachable: dict[str, dict[str, Any]], targets: dict[str, Optional[str]],
                  args: argparse.Namespace) -> None:
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


def run_for_output(cmd: list[str], env: dict[str, str]) -> tuple[str, bool]:
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


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
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


def read_hosts(args: argparse.Namespace) -> list[tuple[str, int]]:
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


def main(argv: Sequence[str]) -> int:
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


def jpeg_engines(capability: tuple[int, ...]) -> Optional[bool]:
    """Whether a GPU of this compute capability has hardware JPEG decoders (nvJPEG's NVJPEG_BACKEND_HARDWARE, which
    torchvision's decode_jpeg on CUDA tries first and leaves for the CUDA cores where nvjpegCreateEx says
    NVJPEG_STATUS_ARCH_MISMATCH); None for an architecture newer than this list.

    The list is NVIDIA's (nvJPEG documentation, "Hardware Acceleration": Ampere A100 and A30, Hopper, Ada,
    Blackwell, Jetson Thor): sm_80 is A100/A30 alone among Ampere (sm_86 and sm_87, A10, A40, RTX 30, Jetson Orin,
    have none), sm_89 Ada (L4, L40, L40S), sm_90 Hopper (H100, H200, GH200), sm_100 to sm_121 Blackwell (B200,
    GB200, B300, Jetson Thor, RTX PRO 6000). Volta and Turing (V100, T4) and older have none."""
    major, minor = capability
    if major > 12:
        return None
    return (major, minor) in ((8, 0), (8, 9)) or major >= 9


def nvjpeg_check(gpu_name: str, capability: Sequence[int], driver_capabilities: Optional[str],
                 video_library: bool) -> tuple[str, str, str]:
    """The nvjpeg row, (status, detail, fix), from the GPU's name and compute capability, the container's
    NVIDIA_DRIVER_CAPABILITIES (None where unset: not started by the NVIDIA Container Toolkit, or no container) and
    whether the driver's video decode library (libnvcuvid.so.1) loads.

    nvJPEG's hardware backend needs the driver's `video` capability (NVIDIA's answers in CUDALibrarySamples#132 and
    nvImageCodec#26): without it the backend is refused and decode_jpeg silently decodes on the CUDA cores. For that
    capability the NVIDIA Container Toolkit mounts the driver's video libraries (libnvcuvid, libnvidia-encode,
    libnvidia-opticalflow, libvdpau_nvidia); libnvcuvid.so.1 loading is taken as the sign that they are there, which
    is what counts. The variable only explains why they are not (and may differ from what the toolkit read:
    docker run --gpus 'all,"capabilities=..."' appends a second one)."""
    sm = f"sm_{capability[0]}{capability[1]}"
    engines = jpeg_engines(tuple(capability))
    fallback = "--data.decode gpu decodes on the CUDA cores"
    if engines is False:
        return "ok", f"no hardware decoder: the {gpu_name} ({sm}) has no hardware JPEG engine; {fallback}", ""
    if engines is None:
        return "ok", (f"hardware decoder unknown: the {gpu_name} ({sm}) is newer than the GPUs this check knows; the "
                      f"driver's video libraries are {'present' if video_library else 'missing'}"), ""
    if video_library:
        mig = (" if this MIG instance's profile has JPEG engines (nvidia-smi mig -lgip)"
               if "MIG" in gpu_name.split() else "")
        return "ok", f"hardware decoder available{mig} ({gpu_name}; driver video libraries present)", ""
    caps = None if driver_capabilities is None else {c.strip() for c in driver_capabilities.split(",")}
    if caps is not None and not caps & {"video", "all"}:
        return ("WARN", f"hardware decoder not available: this container lacks the driver's video capability "
                f"(NVIDIA_DRIVER_CAPABILITIES={driver_capabilities}); {fallback}",
                "run the image with --gpus all and NVIDIA_DRIVER_CAPABILITIES including video (docker/README.md)")
    if caps is not None:
        return ("WARN", f"hardware decoder not available: NVIDIA_DRIVER_CAPABILITIES={driver_capabilities} names "
                f"video, but the driver's libnvcuvid.so.1 does not load; {fallback}",
                "the host's driver lacks its video libraries (Debian/Ubuntu: libnvidia-decode-<driver branch>), or the "
                "container was not started through the NVIDIA Container Toolkit (docker run --gpus all)")
    return ("WARN", f"hardware decoder not available: the driver's libnvcuvid.so.1 does not load; {fallback}",
            "install the driver's video decode library (Debian/Ubuntu: libnvidia-decode-<driver branch>); in a "
            "container, give it the video driver capability (docker/README.md)")


def check_host(report: Report, name: str, slots: int, facts: dict[str, Any], reference: dict[str, Any],
               args: argparse.Namespace) -> None:
    versions = {k: facts[k] for k in ("python", "torch", "horovod", "hvd-train")}
    differ = [f"{k} {versions[k]} (here {reference[k]})" for k in versions if versions[k] != reference[k]]
    report.add(name, "versions", "FAIL" if differ else "ok",
               "; ".join(differ) if differ else ", ".join(f"{k} {v}" for k, v in versions.items()),
               "install the same versions on every host (scripts/install.sh from the same checkout, or one image)"
               if differ else "")
    build = facts["build"]
    if "error" in build:
        report.add(name, "horovod build", "FAIL", build["error"], "run scripts/install.sh on this host")
    else:
        has = ", ".join(k for k, v in build.items() if v) or "nothing"
        missing = "MPI" if not (args.gloo or build["MPI"]) else ("Gloo" if args.gloo and not build["Gloo"] else "")
        report.add(name, "horovod build", "FAIL" if missing else "ok", has + (f"; no {missing}" if missing else ""),
                   f"rebuild Horovod with {missing} (scripts/install.sh), or launch with "
                   f"{'--mpi' if missing == 'Gloo' else '--gloo'}" if missing else "")
        if facts["gpus"] and not build["NCCL"]:
            report.add(name, "nccl", "WARN", f"{facts['gpus']} GPU(s) but Horovod has no NCCL: gradients go "
                       "through host memory", "scripts/install.sh --gpu")
    if args.network_interface:
        addresses = facts["interfaces"].get(args.network_interface)
        report.add(name, "interface", "ok" if addresses else "FAIL",
                   f"{args.network_interface} {', '.join(addresses)}" if addresses else
                   f"no interface {args.network_interface} with an IPv4 address (it has "
                   f"{', '.join(sorted(facts['interfaces']))})",
                   "" if addresses else "name an interface every host has (--network-interface), e.g. the one "
                   "of the address the host names resolve to")
    resolved = facts["resolves_to"] or ""
    # Only matters between hosts: a job on one host talks over loopback anyway.
    loopback = resolved.startswith("127.") and args.multi_host
    report.add(name, "hostname", "WARN" if loopback or not resolved else "ok",
               f"{facts['hostname']} resolves to {resolved or 'nothing'}"
               + (" (loopback)" if resolved.startswith("127.") else ""),
               f"map {facts['hostname']} to this host's network address in /etc/hosts; until then pass "
               f"--network-interface to horovodrun (hvd-train's Horovod build then ignores the hostname; a stock "
               f"Horovod's Gloo aborts with 'connect [127.0.0.1]')" if loopback or not resolved else "")
    gpus = facts["gpus"]
    if gpus:
        status = "FAIL" if slots > gpus else ("WARN" if slots < gpus else "ok")
        report.add(name, "slots", status, f"{slots} slot(s), {gpus} GPU(s)",
                   {"FAIL": f"{name}:{gpus}: one rank per GPU (ranks would share a GPU)",
                    "WARN": f"{name}:{gpus} uses every GPU"}.get(status, ""))
        if facts.get("gpu_model"):
            report.add(name, "nvjpeg", *nvjpeg_check(  # type: ignore[call-arg]
                *facts["gpu_model"], facts["driver_capabilities"], facts["video_library"]))
    else:
        cpus = facts.get("cpus") or 0
        over = slots > cpus > 0
        report.add(name, "slots", "WARN" if over else "ok", f"{slots} slot(s), no GPU, {cpus} CPU core(s)",
                   f"{name}:{cpus} at most: more CPU ranks than cores share them, and every step waits for the "
                   f"slowest rank" if over else "")
    if not args.gloo:
        report.add(name, "mpirun", "ok" if facts["mpirun"] else "FAIL",
                   facts["mpirun"] or "not in the environment nor on PATH",
                   "" if facts["mpirun"] else "set up the environment on every host (scripts/install.sh installs an "
                   "MPI), or launch with horovodrun --gloo")
    skew = facts["skew"]
    report.add(name, "clock", "WARN" if abs(skew) > 2 else "ok", f"{skew:+.1f} s against this host",
               "run NTP/chrony on every host: logs and timelines are compared across hosts" if abs(skew) > 2 else "")
    free = facts["disk_free"] / 2**30
    bad = not facts["disk_writable"] or free < 1
    report.add(name, "disk", "FAIL" if bad else "ok",
               f"{free:.1f} GiB free in {facts['disk_path']}" + ("" if facts["disk_writable"] else ", not writable"),
               "free space, or give --output-dir a writable directory with room for checkpoints" if bad else "")


# Runs on every host (stdin of `python -`): one JSON line of facts, nothing that needs Horovod to be initialised.
PROBE = r"""
import json, os, platform, shutil, socket, sys, time
from importlib import metadata
facts = {"python": platform.python_version(), "time": time.time(), "hostname": socket.gethostname()}
for dist in ("torch", "horovod", "hvd-train"):
    try:
        facts[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        facts[dist] = None
try:
    facts["resolves_to"] = socket.gethostbyname(socket.gethostname())
except OSError:
    facts["resolves_to"] = None
import psutil
facts["interfaces"] = {name: [a.address for a in addrs if a.family == socket.AF_INET]
                       for name, addrs in psutil.net_if_addrs().items()}
# A link's rate in Mb/s as its driver reports it; None for a virtual interface (veth, a bridge, loopback: no device
# behind it, and a made-up speed) or one whose rate is unknown.
def nominal_mbit(name):
    if not os.path.exists(f"/sys/class/net/{name}/device"):
        return None
    try:
        with open(f"/sys/class/net/{name}/speed") as f:
            speed = int(f.read())
    except (OSError, ValueError):
        return None
    return speed if speed > 0 else None
facts["link_mbit"] = {name: nominal_mbit(name) for name in facts["interfaces"]}
ib = "/sys/class/infiniband"
facts["infiniband"] = sorted(os.listdir(ib)) if os.path.isdir(ib) else []
facts["nccl_env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
try:
    import horovod.torch as hvd
    facts["build"] = {"MPI": hvd.mpi_built(), "Gloo": hvd.gloo_built(), "NCCL": hvd.nccl_built() > 0}
except Exception as e:
    facts["build"] = {"error": f"{type(e).__name__}: {e}"}
import torch
facts["gpus"] = torch.cuda.device_count()
# For the nvjpeg row: the first GPU's model, whether the driver's video decode library loads (what a container's
# `video` driver capability mounts; nvJPEG's hardware backend needs it), and the capabilities the container asked for.
facts["gpu_model"] = None
if facts["gpus"]:
    try:
        facts["gpu_model"] = [torch.cuda.get_device_name(0), list(torch.cuda.get_device_capability(0))]
    except Exception:
        pass
import ctypes
try:
    ctypes.CDLL("libnvcuvid.so.1")
    facts["video_library"] = True
except OSError:
    facts["video_library"] = False
facts["driver_capabilities"] = os.environ.get("NVIDIA_DRIVER_CAPABILITIES")
facts["cpus"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
# The environment's own mpirun first (an MPI setup installed from PyPI), as horovodrun runs it, then PATH's.
facts["mpirun"] = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
path = os.path.abspath(sys.argv[1])
while not os.path.exists(path):
    path = os.path.dirname(path)
facts["disk_path"], facts["disk_free"] = path, shutil.disk_usage(path).free
facts["disk_writable"] = os.access(path, os.W_OK)
print(json.dumps(facts))
"""

# Listens on one address until stdin closes; prints its port first.
LISTEN = r"""
import socket, sys, threading
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(64)
print(s.getsockname()[1], flush=True)
threading.Thread(target=lambda: [s.accept()[0].close() for _ in iter(int, 1)], daemon=True).start()
sys.stdin.read()
"""

# Connects to every (name, address, port) given as JSON; prints which failed and why.
CONNECT = r"""
import json, socket, sys
failed = {}
for name, address, port in json.loads(sys.argv[1]):
    try:
        socket.create_connection((address, port), timeout=10).close()
    except OSError as e:
        failed[name] = f"{address}:{port}: {e.strerror or e}"
print(json.dumps(failed))
"""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
