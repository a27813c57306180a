"""Every rank's Python stack on demand, while the job runs: SIGUSR2 sent to any one rank (or to horovodrun, or to
OpenMPI's mpirun, which pass it on to their ranks) has every rank write all its threads' stacks to the log, each
headed by its rank and host, and the job goes on.

Why a pipe: faulthandler writes the stacks from the signal handler itself, so a rank stuck in C++ (a collective, a
read, a CUDA call) answers as well as one running Python; it writes them into a pipe of this process, and a thread
of ours reads them and puts the header on (the handler cannot: it runs no Python). The write end does not block: a
dump larger than the pipe (a megabyte) loses what does not fit rather than leaving the handler waiting for our
thread.

Why the watchdog: one signal must reach the ranks on every host, and launchers do not all pass SIGUSR2 on (MPICH's
mpirun dies of it; ssh does not carry signals). The watchdog's heartbeat carries how many signals its rank was sent;
a rank that sees a peer's count grow writes its stacks too, unless it wrote them within the last few seconds (when a
launcher signals every rank, each answers its own signal once, not again for each peer's). So where the watchdog
runs (training on a fixed set of ranks, --freeze-timeout above 0), one signal to one rank is enough; elsewhere each
rank answers the signal it gets.

What it cannot do: a rank whose interpreter lock is held by code that never lets it go (a C extension spinning
without releasing it) writes the dump into the pipe but nothing reads it; `py-spy dump --pid PID` shows such a rank.

SIGUSR2 because SIGUSR1 is SLURM's warning before a time limit (a checkpoint and a stop: interrupt.py), and SIGQUIT
would be taken by a terminal's Ctrl-\\ for the process group.
"""
import faulthandler
import fcntl
import os
import select
import signal
import sys
import threading
import time

import hvd_utils

SIGNAL = signal.SIGUSR2
PIPE_BYTES = 1 << 20  # Linux's default largest pipe (/proc/sys/fs/pipe-max-size): room for 100 threads' stacks
HOLD_S = 3.0  # a peer's request within this long of this rank's last dump is answered by that dump
_pipe = None  # (read fd, write fd), made once a process
_lock = threading.Lock()  # one dump at a time on stderr, and the counts below
signals = 0  # SIGUSR2s this process was sent: what its heartbeat reports
_answered = {}  # peer rank: the highest count of its signals this rank has answered
_last_dump = -HOLD_S  # time.monotonic() of this rank's last dump


def install():
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


def _relay_dumps(read_fd):
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


def answer_peer(rank, count, first=False):
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


def _write(cause, dump):
    """The header, then the dump (None: taken now, from this thread), on stderr."""
    sys.stderr.write(f"train_hvd.py: rank {_rank()} (host {hvd_utils.host_name()}, pid {os.getpid()}): every "
                     f"thread's Python stack, as {cause} asked; the job goes on:\n")
    if dump is None:
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    else:
        sys.stderr.write(dump)
    sys.stderr.flush()


def _rank():
    try:
        return hvd_utils.rank()
    except ValueError:  # before hvd.init(): the rank the launcher announced
        return hvd_utils.launcher_rank()
