"""Ctrl-C, SIGTERM and SIGUSR1: the run says where it stopped and where `--resume auto` continues; while training, a
SIGTERM or SIGUSR1 first has a checkpoint written at the next step, and a checkpoint being written is finished.

Who sends what: Ctrl-C on mpirun, or SIGINT/SIGTERM to it, makes mpirun send SIGTERM to every rank a second later
and SIGKILL a second after that (OMPI_MCA_odls_base_sigkill_timeout sets both waits; mpirun passes SIGUSR1 on at
once); horovodrun --gloo
sends SIGTERM and SIGKILL after 5 s; SLURM sends SIGTERM to every task and SIGKILL after its KillWait (30 s by
default), and with `#SBATCH --signal=B:USR1@SECONDS` SIGUSR1 to the batch script that long before the time limit.

Python runs a signal handler only in the main thread, between bytecodes: a rank waiting in a collective whose peers
have already stopped would never get there. So the handler's work is split: a watcher thread, woken through
signal.set_wakeup_fd by the C-level handler wherever the main thread is, waits for a checkpoint in progress and
then reports; the main thread's handler raises Interrupted where it can, except while a checkpoint is being written:
then check() raises it once every rank has heard how the writing went. While the training loop takes signals to
save first (save_first()), SIGTERM and SIGUSR1 raise nothing: the loop sees stop_asked(), every rank agrees on a
step, a checkpoint is written there and the loop raises Interrupted itself; the watcher only steps in when this
process stops moving (a peer is gone). A rank still stuck a while after the report ends itself.
"""
import contextlib
import os
import signal
import threading

from hvd_train.errors import say
from hvd_train.guards import watchdog

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# Sent ahead of a kill (SLURM's warning, a scheduler's preemption, a launcher ending the job): a checkpoint first.
SAVE_FIRST = (signal.SIGTERM, signal.SIGUSR1)
STUCK_EXIT_S = 20.0  # after the report, how long a rank stuck in a collective waits before it ends itself
# A save-first signal: how long this process may go without a step or a validation batch before the watcher takes
# it for stuck (a peer gone) and ends it with the report.
IDLE_EXIT_S = 60.0
# The exit code of a run stopped to be continued (SIGUSR1, or a SLURM job's time limit ahead): EX_TEMPFAIL, which
# hostfiles/slurm_train.sbatch answers with `scontrol requeue`.
REQUEUE_EXIT = 75


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread once a SIGINT, SIGTERM or SIGUSR1 has arrived (and any checkpoint write has
    finished), or once the training loop stopped before a job's time limit (signum None).

    A KeyboardInterrupt, so no `except Exception` on the way swallows it, and DataLoader workers (forked with this
    handler) end quietly as they do on Ctrl-C."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name if signum else "time limit")
        self.signum = signum

    @property
    def exit_code(self):
        # 130 for SIGINT, 143 for SIGTERM (the shell's convention); a warning or a time limit ahead: requeue.
        return REQUEUE_EXIT if self.signum in (None, signal.SIGUSR1) else 128 + self.signum


class _Guard:
    def __init__(self):
        self.signum = None           # the first signal that arrived
        self.raised = False          # Interrupted has been raised in the main thread
        self.writing = 0             # checkpoint writes in progress in the main thread (nesting count)
        self.background = 0          # checkpoint writes in progress on a thread of their own
        self.reported = False
        self.announced = False       # the line saying a signal has the run save and stop was printed
        self.cond = threading.Condition()
        self.describe = None         # () -> where the run stands, on the rank that reports
        self.report_here = False     # this rank prints the message (rank 0)
        self.installed = False
        self.save_first = False      # the training loop saves before it stops on SIGTERM and SIGUSR1
        self.deadline = False        # the loop stopped ahead of a job's time limit (no signal)


_guard = _Guard()


def install(report):
    """Handle SIGINT, SIGTERM and SIGUSR1 from now on (main thread only). report: whether this rank prints the
    message."""
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
    with _counted("writing"):
        yield


def background_write():
    """A checkpoint written by another thread: the process does not end before it is written (the watcher waits),
    while the main thread goes on and takes signals as usual."""
    return _counted("background")


@contextlib.contextmanager
def _counted(name):
    g = _guard
    with g.cond:
        setattr(g, name, getattr(g, name) + 1)
    try:
        yield
    finally:
        with g.cond:
            setattr(g, name, getattr(g, name) - 1)
            g.cond.notify_all()


@contextlib.contextmanager
def save_first():
    """The training loop: SIGTERM and SIGUSR1 ask it (stop_asked()) for a checkpoint at the next step, then a stop."""
    g = _guard
    g.save_first = True
    try:
        yield
    finally:
        g.save_first = False


def stop_asked():
    """Whether a signal asks the training loop to save and stop (this rank's view; the ranks then agree)."""
    g = _guard
    return g.save_first and g.signum in SAVE_FIRST and not g.raised


def stop_now(signum=None):
    """The training loop saved and stops: Interrupted for the signal it stopped on (None: a job's time limit)."""
    g = _guard
    g.raised = True
    if signum is None and g.signum is None:
        g.deadline = True
    raise Interrupted(g.signum if signum is None else signum)


def check():
    """Raise Interrupted for a signal that arrived during a protected() write (main thread)."""
    g = _guard
    if g.signum is not None and not g.writing and not g.raised and not stop_asked():
        g.raised = True
        raise Interrupted(g.signum)


def signalled():
    """The signal number of the interruption under way, or None."""
    return _guard.signum


def _on_signal(signum, frame):
    g = _guard
    if g.signum is None:
        g.signum = signum
    if g.save_first and signum in SAVE_FIRST:
        return  # the training loop saves at its next step, then raises Interrupted itself
    if g.writing or g.raised:
        return  # raised when the write ends; or already unwinding, and a second Ctrl-C changes nothing
    g.raised = True
    raise Interrupted(signum)


def _watch(read_fd):
    g = _guard
    while True:
        data = os.read(read_fd, 16)
        if any(b in SIGNALS for b in data):
            break
    if g.save_first and g.signum in SAVE_FIRST:
        announce(g.signum)
    with g.cond:
        # A save-first signal: the training loop saves at its next step and stops the process itself; as long as
        # it moves (steps, validation batches) it is let be. A write under way is always finished.
        while g.writing or g.background or (g.save_first and g.signum in SAVE_FIRST and not g.raised and
                                            watchdog.seconds_idle() < IDLE_EXIT_S):
            g.cond.wait(timeout=1.0)
    report()
    # The main thread normally ends the process before this; where it waits in a collective whose peers are gone,
    # nothing else would end it.
    threading.Event().wait(STUCK_EXIT_S)
    os._exit(Interrupted(g.signum or signal.SIGTERM).exit_code)


def announce(signum):
    """Say once (the reporting rank) that signal `signum` has the run save at its next step and stop: the line stays
    even where the process is killed before the checkpoint is written. Said by the thread that saw the signal, or
    by the training loop when the ranks agreed on it first (under load that thread may not have run yet, or the
    signal reached another rank first)."""
    with _guard.cond:
        if _guard.announced or not _guard.report_here:
            return
        _guard.announced = True
    where = ""
    if _guard.describe is not None:
        try:
            where = " " + _guard.describe().split(";")[0]
        except Exception:  # the state may be mid-update in the main thread
            pass
    say(f"train_hvd.py: {signal.Signals(signum).name}{where}: every rank saves a checkpoint at its next step, "
        f"then stops")


def report():
    """Print, once, that the run was interrupted and where it stands (on the reporting rank only)."""
    g = _guard
    with g.cond:
        if g.reported or (g.signum is None and not g.deadline):
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
    what = f"interrupted by {signal.Signals(g.signum).name}" if g.signum else \
        "stopped ahead of the job's time limit (SLURM)"
    say(f"train_hvd.py: {what}{where}")
