"""A frozen rank must not hang the job: every rank tells every other one, once a second and outside Horovod, how far
it has got; when this rank has been waiting longer than the timeout, it names the rank that holds the job up and
ends it.

Why outside Horovod: a rank that stops (SIGSTOP, a stuck read, a GPU hang) blocks every collective, and with them
Horovod's own stall inspector, which runs in the coordinator's negotiation loop: under MPI the healthy ranks wait
silently forever, under Gloo they time out blaming themselves. Heartbeats are UDP datagrams, sent to every address
each peer has (loopback only between processes that share one), so no interface needs naming and a misdelivered
one is harmless: it carries the job's token and the sender's rank, nothing else.

Progress is counted at points every rank passes the same number of times (a training batch in hand, its backward
done, validation done), so a rank that is behind the others is the one they are waiting for; a rank whose
heartbeats stopped is stopped or cut off. This process's own activity (tick or busy) restarts its clock.
"""
import faulthandler
import json
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass

import psutil

import hvd_utils
from hvd_train.errors import say

EXIT_CODE = 4  # a rank froze: the job was ended by the watchdog
_active = None  # the process's watchdog, if one runs: the engine's tick()/busy() reach it without being passed it


@dataclass(frozen=True)
class Member:
    """How to reach one rank, exchanged once at start."""
    rank: int
    host: str
    machine: str      # boot id and network namespace: processes with the same one share a loopback interface
    addresses: tuple  # its IPv4 addresses
    port: int
    token: str        # rank 0's is the job's


@dataclass
class Peer:
    member: Member
    progress: int = -1        # its last reported count of progress points (-1: never heard from)
    heard: float = 0.0        # time.monotonic() of its last heartbeat


def tick():
    """A progress point: every rank reaches each one the same number of times."""
    if _active is not None:
        _active.progress += 1
        _active.last_activity = time.monotonic()


def busy():
    """This rank is working (a validation batch, a checkpoint write) without a countable progress point."""
    if _active is not None:
        _active.last_activity = time.monotonic()


def machine_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return socket.gethostname()


def ipv4_addresses():
    return tuple(a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET)


def start(rt, timeout_s, resume_hint):
    """Start this rank's watchdog (a collective: every rank calls it at the same point). `resume_hint` ends the
    message (what a --resume continues from). None for one process or a timeout of 0."""
    global _active
    if timeout_s <= 0 or rt.size == 1:
        return None
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    me = Member(rt.rank, host, machine_id(), ipv4_addresses(), sock.getsockname()[1], secrets.token_hex(8))
    members = hvd_utils.gather_objects(me, name="watchdog")
    _active = Watchdog(me, members, sock, timeout_s, resume_hint)
    _active.thread.start()
    return _active


def stop():
    global _active
    if _active is not None:
        _active.stopped.set()
        _active = None


class Watchdog:
    def __init__(self, me, members, sock, timeout_s, resume_hint):
        self.me, self.sock, self.timeout_s, self.resume_hint = me, sock, timeout_s, resume_hint
        self.token = members[0].token
        self.peers = {m.rank: Peer(m) for m in members if m.rank != me.rank}
        self.targets = [(a, m.port) for m in members if m.rank != me.rank for a in self.reach(m)]
        self.interval = min(1.0, timeout_s / 10)
        self.progress, self.last_activity = 0, time.monotonic()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="hvd-train-watchdog", daemon=True)

    def reach(self, member):
        if member.machine == self.me.machine:
            return ["127.0.0.1"]
        return [a for a in member.addresses if not a.startswith("127.")]

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
                self.receive(*self.sock.recvfrom(512))
            except (socket.timeout, OSError):
                pass

    def beat(self):
        message = json.dumps({"t": self.token, "r": self.me.rank, "p": self.progress}).encode()
        for target in self.targets:
            try:
                self.sock.sendto(message, target)
            except OSError:  # an address that does not route from here: another one of that peer's will
                pass

    def receive(self, data, _sender):
        try:
            beat = json.loads(data)
            peer = self.peers[beat["r"]] if beat["t"] == self.token else None
        except (ValueError, KeyError, TypeError):
            return
        if peer is not None:
            peer.progress, peer.heard = int(beat["p"]), time.monotonic()

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
            os._exit(EXIT_CODE)
        culprits = silent or behind or unheard
        blamed = {p.member.rank for p in culprits}
        reporter = min(r for r in [self.me.rank, *self.peers] if r not in blamed)
        if self.me.rank == reporter:
            waited = "The other ranks waited for it in a collective; e" if culprits else "E"
            say(f"train_hvd.py: error: {self.describe(culprits, silent, behind, stalled)} {waited}nding the job "
                f"(the limit is --freeze-timeout {self.timeout_s:g} s; 0 turns this off). {self.resume_hint}")
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
