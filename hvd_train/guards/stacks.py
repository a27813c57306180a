"""Every rank's Python stack on demand, while the job runs: SIGUSR2 sent to any one rank (or to horovodrun, or to
OpenMPI's mpirun, which pass it on to their ranks) has every rank write all its threads' stacks to the log, each
headed by its rank and host, and the job goes on.

Why a pipe: faulthandler writes the stacks from the signal handler itself, so a rank stuck in C++ (a collective, a
read, a CUDA call) answers as well as one running Python; it writes them into a pipe of this process, and a thread
of ours reads them and puts the header on (the handler cannot: it runs no Python). The write end does not block: a
dump larger than the pipe (a megabyte) is cut short rather than leaving the handler waiting for our thread.

Why the watchdog: one signal must reach the ranks on every host, and launchers do not all pass SIGUSR2 on (MPICH's
mpirun dies of it; ssh does not carry signals). The watchdog's heartbeat carries how many stack requests its rank
has seen; a rank that sees a peer's count above its own writes its stacks too. So where the watchdog runs (training
on a fixed set of ranks), one signal to one rank is enough; elsewhere each rank answers the signal it gets.

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

import hvd_utils

SIGNAL = signal.SIGUSR2
PIPE_BYTES = 1 << 20  # Linux's default largest pipe (/proc/sys/fs/pipe-max-size): room for 100 threads' stacks
_pipe = None  # (read fd, write fd), made once a process
requests = 0  # stack requests seen by this rank: signals it was sent, and the highest count a peer reported


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
    global requests
    while True:
        dump = os.read(read_fd, PIPE_BYTES)
        if not dump:
            return
        # The handler writes a whole dump at once; what follows within a moment belongs to it.
        while select.select([read_fd], [], [], 0.2)[0]:
            more = os.read(read_fd, PIPE_BYTES)
            if not more:
                break
            dump += more
        requests += 1
        _write(f"{SIGNAL.name} to this process", dump.decode("utf-8", "replace"))


def answer_peer(rank, count):
    """A peer reported `count` stack requests (its heartbeat): above this rank's own, this rank writes its stacks
    too (on the caller's thread, the watchdog's)."""
    global requests
    if count <= requests:
        return
    requests = count
    sys.stderr.flush()
    _write(f"{SIGNAL.name} to rank {rank}, passed on to every rank", None)


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
