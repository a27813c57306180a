r"""The ranks' heartbeat outside Horovod: a frozen rank is named and the job ended, and SIGUSR2 sent to one rank has
every rank write its Python stacks while the job goes on.

Every rank tells every other one, once a second, how far it has got; when this rank has been waiting longer than
--freeze-timeout, it names the rank that holds the job up and ends the job (EXIT_CODE). Why outside Horovod: a rank
that stops (SIGSTOP, a stuck read, a GPU hang) blocks every collective, and with them Horovod's own stall inspector,
which runs in the coordinator's negotiation loop: under MPI the healthy ranks wait silently forever, under Gloo they
time out blaming themselves. Progress is counted at points every rank passes the same number of times (a training
batch in hand, its backward done, validation done), so a rank that is behind the others is the one they are waiting
for; a rank whose heartbeats stopped is stopped or cut off. This process's own activity (tick or busy) restarts its
clock.

Heartbeats are UDP datagrams, authenticated as the port is open to the network: each carries the sender's rank, its
progress, its stack requests and a sequence number, with an HMAC-SHA256 over them under a key rank 0 makes and hands
out through Horovod's own channel at start (it never crosses the UDP wire). A datagram from an address no peer of
that rank has, of another size, with a bad MAC, or with a sequence number already seen is ignored and counted;
nothing in a datagram can stop the thread or change a verdict (a forged stack request included). Between processes
of one machine the socket binds loopback alone; across hosts it binds the interface Horovod uses
(HOROVOD_GLOO_IFACE, set by horovodrun) where that is known, and every interface otherwise, still taking beats only
from the peers' own addresses (an address two hosts share, docker0's, is none).

Stacks: faulthandler writes them from the SIGUSR2 handler itself, so a rank stuck in C++ (a collective, a read, a
CUDA call) answers as well as one running Python; it writes into a pipe of this process, which a thread of ours
reads to put the rank and host on (the handler runs no Python). The write end does not block: a dump larger than
the pipe (a megabyte) loses what does not fit rather than leaving the handler waiting. horovodrun and OpenMPI's
mpirun pass SIGUSR2 on to their ranks, but not every launcher does (MPICH's mpirun dies of it; ssh does not carry
signals), so the heartbeat carries how many SIGUSR2s its rank was sent: a rank that sees a peer's count grow writes
its stacks too, unless it wrote them within HOLD_S. So where the watchdog runs (training on a fixed set of ranks,
--freeze-timeout above 0), one signal to one rank is enough; elsewhere each rank answers the signal it gets. A rank
whose interpreter lock is never let go (a C extension spinning without releasing it) writes its dump into the pipe
but nothing reads it: `py-spy dump --pid PID` shows such a rank. SIGUSR2 because SIGUSR1 is SLURM's warning before
a time limit (hvd_train/guards/interrupt.py), and SIGQUIT would be taken by a terminal's Ctrl-\ for the process
group.
"""
import collections
import faulthandler
import fcntl
import hashlib
import hmac
import os
import secrets
import select
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import NoReturn, Optional

import psutil

from hvd_train.errors import say
from hvd_utils.comm import gather_objects
from hvd_utils.runtime import Runtime, host_name, launcher_rank
from hvd_utils.runtime import rank as rank_of_this_process

EXIT_CODE = 4  # a rank froze: the job was ended by the watchdog
BEAT = struct.Struct("!IQQI")  # rank, progress, sequence number, SIGUSR2s it was sent; then the MAC
MAC_BYTES = 16  # HMAC-SHA256, truncated: forging one takes 2**128 tries
# The process's watchdog, if one runs: the training loop's tick()/busy() (hvd_train/trainer.py) reach it without
# being passed it.
_active = None


@dataclass(frozen=True)
class Member:
    """How to reach one rank, exchanged once at start."""
    rank: int
    host: str
    machine: str      # boot id and network namespace: processes with the same one share a loopback interface
    addresses: tuple[str, ...]  # its IPv4 addresses
    port: int
    key: bytes        # rank 0's is the job's MAC key; gathered through Horovod, never sent in a heartbeat


@dataclass
class Peer:
    member: Member
    progress: int = -1        # its last reported count of progress points (-1: never heard from)
    heard: float = 0.0        # time.monotonic() of its last heartbeat
    sequence: int = -1        # the highest sequence number taken from it: an older or repeated one is a replay


_last_activity = time.monotonic()  # of this process, watched or not (interrupt.py waits while it moves)


def tick() -> None:
    """A progress point: every rank reaches each one the same number of times."""
    global _last_activity
    _last_activity = time.monotonic()
    if _active is not None:
        _active.progress += 1
        _active.last_activity = _last_activity


def busy() -> None:
    """This rank is working (a validation batch, a checkpoint write) without a countable progress point."""
    global _last_activity
    _last_activity = time.monotonic()
    if _active is not None:
        _active.last_activity = _last_activity


def seconds_idle() -> float:
    """Seconds since this process last passed a progress point or did other work (a step, a validation batch)."""
    return time.monotonic() - _last_activity


def machine_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return socket.gethostname()


def ipv4_addresses(interface: str = "") -> tuple[str, ...]:
    """This host's IPv4 addresses (those of `interface` alone where one is named and has any)."""
    found = {name: tuple(a.address for a in addrs if a.family == socket.AF_INET)
             for name, addrs in psutil.net_if_addrs().items()}
    return found.get(interface) or tuple(a for addrs in found.values() for a in addrs)


def job_interface() -> str:
    """The network interface Horovod's ranks talk over, where the launcher named one (horovodrun sets it)."""
    return (os.environ.get("HOROVOD_GLOO_IFACE") or "").split(",")[0].strip()


def start(rt: Runtime, timeout_s: float, resume_hint: str) -> Optional["Watchdog"]:
    """Start this rank's watchdog (a collective: every rank calls it at the same point). `resume_hint` ends the
    message (what a --resume continues from). None for one process or a timeout of 0."""
    global _active
    if timeout_s <= 0 or rt.size == 1:
        return None
    # Where the ranks are decides the address to bind: loopback when they share this machine's network.
    machines = gather_objects(machine_id(), name="watchdog.machines")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    interface = job_interface()
    addresses = ipv4_addresses(interface)
    if len(set(machines)) == 1:
        sock.bind(("127.0.0.1", 0))
    else:
        sock.bind((addresses[0] if interface and len(addresses) == 1 else "0.0.0.0", 0))
    me = Member(rt.rank, host_name(), machine_id(), addresses, sock.getsockname()[1], secrets.token_bytes(32))
    members = gather_objects(me, name="watchdog")
    _active = Watchdog(me, members, sock, timeout_s, resume_hint)
    _active.thread.start()
    return _active


def stop() -> None:
    """Stop this rank's watchdog; a rank whose port received datagrams it had to ignore says how many, and why."""
    global _active
    if _active is not None:
        _active.stopped.set()
        _active.report_ignored()
        _active = None


class Watchdog:
    def __init__(self, me: Member, members: list[Member], sock: socket.socket, timeout_s: float,
                 resume_hint: str) -> None:
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
        self.ignored: collections.Counter[str] = collections.Counter()  # datagrams refused, by reason
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="hvd-train-watchdog", daemon=True)

    def reach(self, member: Member) -> list[str]:
        if member.machine == self.me.machine:
            return ["127.0.0.1"]
        return [a for a in member.addresses if not a.startswith("127.") and a not in self.shared]

    def run(self) -> None:
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

    def mac(self, body: bytes) -> bytes:
        return hmac.new(self.key, body, hashlib.sha256).digest()[:MAC_BYTES]

    def beat(self) -> None:
        self.sequence += 1
        body = BEAT.pack(self.me.rank, self.progress, self.sequence, signals)
        message = body + self.mac(body)
        for target in self.targets:
            try:
                self.sock.sendto(message, target)
            except OSError:  # an address that does not route from here: another one of that peer's will
                pass

    def receive(self, data: bytes, sender: tuple[str, int]) -> None:
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
        answer_peer(rank, requests, first)

    def report_ignored(self) -> None:
        if self.ignored:
            why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.ignored.items()))
            say(f"train_hvd.py: warning: rank {self.me.rank}'s watchdog ignored {sum(self.ignored.values())} "
                f"datagram(s) on UDP port {self.me.port} that were not its peers' heartbeats ({why}); something "
                f"else sends to that port")

    def verdict(self, now: float) -> NoReturn:
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

    def describe(self, culprits: list[Peer], silent: list[Peer], behind: list[Peer], stalled: int) -> str:
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


SIGNAL = signal.SIGUSR2
PIPE_BYTES = 1 << 20  # Linux's default largest pipe (/proc/sys/fs/pipe-max-size): room for 100 threads' stacks
HOLD_S = 3.0  # a peer's request within this long of this rank's last dump is answered by that dump
_pipe: Optional[tuple[int, int]] = None  # (read fd, write fd), made once a process
_lock = threading.Lock()  # one dump at a time on stderr, and the counts below
signals = 0  # SIGUSR2s this process was sent: what its heartbeat reports
_answered: dict[int, int] = {}  # peer rank: the highest count of its signals this rank has answered
_last_dump = -HOLD_S  # time.monotonic() of this rank's last dump


def install_stack_dumps() -> None:
    """Have SIGUSR2 write this process's stacks to the log (every call re-registers the handler; the pipe and its
    reader are made once a process)."""
    global _pipe
    if _pipe is None:
        read_fd, write_fd = os.pipe()
        try:
            fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:  # a lower limit set by the administrator: the default 64 KB still holds most dumps
            pass
        os.set_blocking(write_fd, False)
        _pipe = (read_fd, write_fd)
        threading.Thread(target=_relay_dumps, args=(read_fd,), name="hvd-train-stacks", daemon=True).start()
    faulthandler.register(SIGNAL, file=_pipe[1], all_threads=True)


def _relay_dumps(read_fd: int) -> None:
    """Read each dump the signal handler wrote and write it to stderr under its header."""
    global signals, _last_dump
    while True:
        dump = os.read(read_fd, PIPE_BYTES)
        if not dump:
            return
        with _lock:  # from now on a peer's request is answered by this dump
            _last_dump = time.monotonic()
        # The handler writes a whole dump at once; what follows within a moment belongs to it.
        while select.select([read_fd], [], [], 0.2)[0]:
            more = os.read(read_fd, PIPE_BYTES)
            if not more:
                break
            dump += more
        with _lock:
            _write(f"{SIGNAL.name} to this process", dump.decode("utf-8", "replace"))
            signals += 1
            _last_dump = time.monotonic()


def answer_peer(rank: int, count: int, first: bool = False) -> None:
    """Rank `rank`'s heartbeat reports it was sent `count` signals: this rank writes its stacks for one it has not
    answered yet (on the caller's thread, the watchdog's), unless it just did. `first`: the peer's first heartbeat,
    whose count is taken as answered (signals before the watchdog started reached only the ranks they were sent
    to)."""
    global _last_dump
    with _lock:
        if first or count <= _answered.get(rank, 0):
            if first:
                _answered[rank] = count
            return
        _answered[rank] = count
        if time.monotonic() - _last_dump < HOLD_S:
            return
        sys.stderr.flush()
        _write(f"{SIGNAL.name} to rank {rank}, passed on to every rank", None)
        _last_dump = time.monotonic()


def _write(cause: str, dump: Optional[str]) -> None:
    """The header, then the dump (None: taken now, from this thread), on stderr."""
    sys.stderr.write(f"train_hvd.py: rank {_rank()} (host {host_name()}, pid {os.getpid()}): every "
                     f"thread's Python stack, as {cause} asked; the job goes on:\n")
    if dump is None:
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    else:
        sys.stderr.write(dump)
    sys.stderr.flush()


def _rank() -> int:
    try:
        return rank_of_this_process()
    except ValueError:  # before hvd.init(): the rank the launcher announced
        return launcher_rank()
