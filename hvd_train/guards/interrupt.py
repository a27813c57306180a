"""Ctrl-C and SIGTERM: the run says where it stopped and where `--resume auto` continues, and a checkpoint that is
being written is finished first.

Who sends what: Ctrl-C on mpirun, or SIGINT/SIGTERM to it, makes mpirun send SIGTERM to every rank and SIGKILL one
second later (OMPI_MCA_odls_base_sigkill_timeout raises that); horovodrun --gloo sends SIGTERM and SIGKILL after
5 s; SLURM sends SIGTERM to every task, and SIGKILL after its KillWait (30 s by default).

Python runs a signal handler only in the main thread, between bytecodes: a rank waiting in a collective whose peers
have already stopped would never get there. So the handler's work is split: a watcher thread, woken through
signal.set_wakeup_fd by the C-level handler wherever the main thread is, waits for a checkpoint in progress and
then reports; the main thread's handler raises Interrupted where it can, except while a checkpoint is being written:
then check() raises it once every rank has heard how the writing went. A rank still stuck a while after the report
ends itself.
"""
import contextlib
import os
import signal
import threading

from hvd_train.errors import say

SIGNALS = (signal.SIGINT, signal.SIGTERM)
STUCK_EXIT_S = 20.0  # after the report, how long a rank stuck in a collective waits before it ends itself


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread once a SIGINT or SIGTERM has arrived (and any checkpoint write has finished).

    A KeyboardInterrupt, so no `except Exception` on the way swallows it, and DataLoader workers (forked with this
    handler) end quietly as they do on Ctrl-C."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self):
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


class _Guard:
    def __init__(self):
        self.signum = None           # the first signal that arrived
        self.raised = False          # Interrupted has been raised in the main thread
        self.writing = 0             # checkpoint writes in progress (nesting count)
        self.reported = False
        self.cond = threading.Condition()
        self.describe = None         # () -> where the run stands, on the rank that reports
        self.report_here = False     # this rank prints the message (rank 0)
        self.installed = False


_guard = _Guard()


def install(report):
    """Handle SIGINT and SIGTERM from now on (main thread only). report: whether this rank prints the message."""
    g = _guard
    g.report_here = report
    if g.installed:
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for signum in SIGNALS:
        signal.signal(signum, _on_signal)
    threading.Thread(target=_watch, args=(read_fd,), name="interrupt-watcher", daemon=True).start()
    g.installed = True


def describe_with(fn):
    """fn() -> a sentence on where the run stands and where --resume auto continues (read from another thread)."""
    _guard.describe = fn


@contextlib.contextmanager
def protected():
    """A checkpoint write: a signal that arrives during it takes effect at the next check() after it."""
    g = _guard
    with g.cond:
        g.writing += 1
    try:
        yield
    finally:
        with g.cond:
            g.writing -= 1
            g.cond.notify_all()


def check():
    """Raise Interrupted for a signal that arrived during a protected() write (main thread)."""
    g = _guard
    if g.signum is not None and not g.writing and not g.raised:
        g.raised = True
        raise Interrupted(g.signum)


def signalled():
    """The signal number of the interruption under way, or None."""
    return _guard.signum


def _on_signal(signum, frame):
    g = _guard
    if g.signum is None:
        g.signum = signum
    if g.writing or g.raised:
        return  # raised when the write ends; or already unwinding, and a second Ctrl-C changes nothing
    g.raised = True
    raise Interrupted(g.signum)


def _watch(read_fd):
    g = _guard
    while True:
        data = os.read(read_fd, 16)
        if any(b in SIGNALS for b in data):
            break
    with g.cond:
        while g.writing:
            g.cond.wait()
    report()
    # The main thread normally ends the process before this; where it waits in a collective whose peers are gone,
    # nothing else would end it.
    threading.Event().wait(STUCK_EXIT_S)
    os._exit(128 + (g.signum or signal.SIGTERM))


def report():
    """Print, once, that the run was interrupted and where it stands (on the reporting rank only)."""
    g = _guard
    with g.cond:
        if g.reported or g.signum is None:
            return
        g.reported = True
    if not g.report_here:
        return
    where = ""
    if g.describe is not None:
        try:
            where = " " + g.describe()
        except Exception as e:  # the state may be mid-update in the main thread; the signal still gets its line
            where = f" (position unknown: {type(e).__name__})"
    say(f"train_hvd.py: interrupted by {signal.Signals(g.signum).name}{where}")
