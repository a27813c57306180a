"""A frozen rank must not hang the job: every rank tells every other one, once a second and outside Horovod, how far
it has got; when this rank has been waiting longer than the timeout, it names the rank that holds the job up and
ends it.

Why outside Horovod: a rank that stops (SIGSTOP, a stuck read, a GPU hang) blocks every collective, and with them
Horovod's own stall inspector, which runs in the coordinator's negotiation loop: under MPI the healthy ranks wait
silently forever, under Gloo they time out blaming themselves. Heartbeats are UDP datagrams, sent to every address
each peer has (loopback only between processes that share one), so no interface needs naming.

Progress is counted at points every rank passes the same number of times (a training batch in hand, its backward
done, validation done), so a rank that is behind the others is the one they are waiting for; a rank whose
heartbeats stopped is stopped or cut off. This process's own activity (tick or busy) restarts its clock.

The heartbeat also carries how many stack requests (SIGUSR2) its rank was sent, so that one signal to one rank has
every rank write its stacks (stacks.py).

Heartbeats are authenticated, as the port is open to the network: each carries the sender's rank, its progress, its
stack requests and a sequence number, with an HMAC-SHA256 over them under a key rank 0 makes and hands out through
Horovod's own channel at start (it never crosses the UDP wire). A datagram from an address no peer of that rank has,
of another size, with a bad MAC, or with a sequence number already seen is ignored and counted; nothing in a datagram
can stop the thread or change a verdict (a forged stack request included). Between processes of one machine the
socket binds loopback alone; across hosts it binds the interface Horovod uses (HOROVOD_GLOO_IFACE, set by horovodrun)
where that is known, and every interface otherwise, still taking beats only from the peers' own addresses (an
address two hosts share, docker0's, is none).
"""
import collections
import faulthandler
import hashlib
import hmac
import os
import secrets
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass

import psutil

import hvd_utils
from hvd_train.errors import say
from hvd_train.guards import stacks

EXIT_CODE = 4  # a rank froze: the job was ended by the watchdog
BEAT = struct.Struct("!IQQI")  # rank, progress, sequence number, SIGUSR2s it was sent; then the MAC
MAC_BYTES = 16  # HMAC-SHA256, truncated: forging one takes 2**128 tries
_active = None  # the process's watchdog, if one runs: the engine's tick()/busy() reach it without being passed it


@dataclass(frozen=True)
class Member:
    """How to reach one rank, exchanged once at start."""
    rank: int
    host: str
    machine: str      # boot id and network namespace: processes with the same one share a loopback interface
    addresses: tuple  # its IPv4 addresses
    port: int
    key: bytes        # rank 0's is the job's MAC key; gathered through Horovod, never sent in a heartbeat


@dataclass
class Peer:
    member: Member
    progress: int = -1        # its last reported count of progress points (-1: never heard from)
    heard: float = 0.0        # time.monotonic() of its last heartbeat
    sequence: int = -1        # the highest sequence number taken from it: an older or repeated one is a replay


_last_activity = time.monotonic()  # of this process, watched or not (interrupt.py waits while it moves)


def tick():
    """A progress point: every rank reaches each one the same number of times."""
    global _last_activity
    _last_activity = time.monotonic()
    if _active is not None:
        _active.progress += 1
        _active.last_activity = _last_activity


def busy():
    """This rank is working (a validation batch, a checkpoint write) without a countable progress point."""
    global _last_activity
    _last_activity = time.monotonic()
    if _active is not None:
        _active.last_activity = _last_activity


def seconds_idle():
    """Seconds since this process last passed a progress point or did other work (a step, a validation batch)."""
    return time.monotonic() - _last_activity


def machine_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return socket.gethostname()


def ipv4_addresses(interface=""):
    """This host's IPv4 addresses (those of `interface` alone where one is named and has any)."""
    found = {name: tuple(a.address for a in addrs if a.family == socket.AF_INET)
             for name, addrs in psutil.net_if_addrs().items()}
    return found.get(interface) or tuple(a for addrs in found.values() for a in addrs)


def job_interface():
    """The network interface Horovod's ranks talk over, where the launcher named one (horovodrun sets it)."""
    return (os.environ.get("HOROVOD_GLOO_IFACE") or "").split(",")[0].strip()


def start(rt, timeout_s, resume_hint):
    """Start this rank's watchdog (a collective: every rank calls it at the same point). `resume_hint` ends the
    message (what a --resume continues from). None for one process or a timeout of 0."""
    global _active
    if timeout_s <= 0 or rt.size == 1:
        return None
    # Where the ranks are decides the address to bind: loopback when they share this machine's network.
    machines = hvd_utils.gather_objects(machine_id(), name="watchdog.machines")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    interface = job_interface()
    addresses = ipv4_addresses(interface)
    if len(set(machines)) == 1:
        sock.bind(("127.0.0.1", 0))
    else:
        sock.bind((addresses[0] if interface and len(addresses) == 1 else "0.0.0.0", 0))
    me = Member(rt.rank, hvd_utils.host_name(), machine_id(), addresses, sock.getsockname()[1], secrets.token_bytes(32))
    members = hvd_utils.gather_objects(me, name="watchdog")
    _active = Watchdog(me, members, sock, timeout_s, resume_hint)
    _active.thread.start()
    return _active


def stop():
    """Stop this rank's watchdog; a rank whose port received datagrams it had to ignore says how many, and why."""
    global _active
    if _active is not None:
        _active.stopped.set()
        _active.report_ignored()
        _active = None


class Watchdog:
    def __init__(self, me, members, sock, timeout_s, resume_hint):
        self.me, self.sock, self.timeout_s, self.resume_hint = me, sock, timeout_s, resume_hint
        self.key = members[0].key
        # An address that members on two machines both have (docker0's 172.17.0.1) identifies neither.
        owners = collections.defaultdict(set)
        for m in members:
            for a in m.addresses:
                owners[a].add(m.machine)
        self.shared = {a for a, machines in owners.items() if len(machines) > 1}
        self.peers = {m.rank: Peer(m) for m in members if m.rank != me.rank}
        self.sources = {m.rank: set(self.reach(m)) for m in members if m.rank != me.rank}
        self.targets = [(a, m.port) for m in members if m.rank != me.rank for a in self.reach(m)]
        self.interval = min(1.0, timeout_s / 10)
        self.progress, self.last_activity, self.sequence = 0, time.monotonic(), 0
        self.ignored = collections.Counter()  # datagrams refused, by reason
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="hvd-train-watchdog", daemon=True)

    def reach(self, member):
        if member.machine == self.me.machine:
            return ["127.0.0.1"]
        return [a for a in member.addresses if not a.startswith("127.") and a not in self.shared]

    def run(self):
        self.sock.settimeout(self.interval)
        next_beat = 0.0
        while not self.stopped.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self.beat()
                next_beat = now + self.interval
                if now - self.last_activity > self.timeout_s:
                    self.verdict(now)
            try:
                data, sender = self.sock.recvfrom(512)
            except OSError:  # the interval passed with nothing received (socket.timeout is an OSError)
                continue
            try:
                self.receive(data, sender)
            except Exception:  # a datagram must never stop this thread, whatever it holds
                self.ignored["malformed"] += 1

    def mac(self, body):
        return hmac.new(self.key, body, hashlib.sha256).digest()[:MAC_BYTES]

    def beat(self):
        self.sequence += 1
        body = BEAT.pack(self.me.rank, self.progress, self.sequence, stacks.signals)
        message = body + self.mac(body)
        for target in self.targets:
            try:
                self.sock.sendto(message, target)
            except OSError:  # an address that does not route from here: another one of that peer's will
                pass

    def receive(self, data, sender):
        """Take a peer's heartbeat, or count why this datagram is not one."""
        if len(data) != BEAT.size + MAC_BYTES:
            self.ignored["of another size"] += 1
            return
        body, mac = data[:BEAT.size], data[BEAT.size:]
        if not hmac.compare_digest(mac, self.mac(body)):
            self.ignored["with a bad MAC"] += 1
            return
        rank, progress, sequence, requests = BEAT.unpack(body)
        peer = self.peers.get(rank)
        if peer is None or sender[0] not in self.sources[rank]:
            self.ignored["from an address that is not the rank's"] += 1
            return
        if sequence <= peer.sequence:
            self.ignored["replayed"] += 1
            return
        first = peer.sequence < 0
        peer.sequence, peer.progress, peer.heard = sequence, progress, time.monotonic()
        stacks.answer_peer(rank, requests, first)

    def report_ignored(self):
        if self.ignored:
            why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.ignored.items()))
            say(f"train_hvd.py: warning: rank {self.me.rank}'s watchdog ignored {sum(self.ignored.values())} "
                f"datagram(s) on UDP port {self.me.port} that were not its peers' heartbeats ({why}); something "
                f"else sends to that port")

    def verdict(self, now):
        """This rank has made no progress for the timeout: blame whoever holds the job up, and end it."""
        stalled = int(now - self.last_activity)
        silent = [p for p in self.peers.values() if p.progress >= 0 and now - p.heard > self.timeout_s / 2]
        unheard = [p for p in self.peers.values() if p.progress < 0]
        behind = [p for p in self.peers.values() if p not in silent and 0 <= p.progress < self.progress]
        ahead = [p for p in self.peers.values() if p not in silent and p.progress > self.progress]
        if ahead and not silent and not behind:
            # This rank is the one the others wait for: say where it is stuck, then end.
            say(f"train_hvd.py: rank {self.me.rank} (host {self.me.host}) made no progress for {stalled} s while "
                f"the other ranks waited for it; where it is stuck:")
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            self.report_ignored()
            os._exit(EXIT_CODE)
        culprits = silent or behind or unheard
        blamed = {p.member.rank for p in culprits}
        reporter = min(r for r in [self.me.rank, *self.peers] if r not in blamed)
        if self.me.rank == reporter:
            waited = "The other ranks waited for it in a collective; e" if culprits else "E"
            say(f"train_hvd.py: error: {self.describe(culprits, silent, behind, stalled)} {waited}nding the job "
                f"(the limit is --freeze-timeout {self.timeout_s:g} s; 0 turns this off). {self.resume_hint}")
            self.report_ignored()
            os._exit(EXIT_CODE)
        # The reporter says it; leave it a moment to, then end this rank too (the launcher may already have).
        self.stopped.wait(self.timeout_s / 2 + 10)
        os._exit(EXIT_CODE)

    def describe(self, culprits, silent, behind, stalled):
        who = ", ".join(f"rank {p.member.rank} (host {p.member.host})" for p in culprits)
        if silent:
            quiet = int(max(time.monotonic() - p.heard for p in silent))
            return (f"{who} stopped making progress: no sign of life from it for {quiet} s (the process is "
                    f"stopped or hung outside Python, or its host is down or cut off).")
        if behind:
            return (f"{who} made no progress for {stalled} s: it is alive but stuck in its own work (a data read, a "
                    f"deadlock, a GPU hang); its stack is printed above if it could print it.")
        if culprits:
            return (f"no rank made progress for {stalled} s, and no heartbeat ever arrived from {who} (UDP between "
                    f"the hosts may be blocked).")
        return (f"no rank made progress for {stalled} s and none is behind: every rank is waiting in a collective "
                f"(the network between the hosts may be stuck).")
