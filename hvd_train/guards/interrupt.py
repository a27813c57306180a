"""How a run stops when asked to: Ctrl-C, SIGTERM, SIGUSR1 or a SLURM job's time limit ahead, each ending with a line
saying where the run stopped and where `--resume auto` continues.

While training, a SIGTERM or SIGUSR1 first has a checkpoint written at the next step, and a checkpoint being written
is finished. Under SLURM, rank 0 reads the job's time limit once (squeue's %L), so that the run saves and stops
--checkpoint.before_time_limit_s before SLURM kills it; such a stop, like SIGUSR1's, exits REQUEUE_EXIT (75), which
hostfiles/slurm_train.sbatch answers with `scontrol requeue`.

Who sends what: Ctrl-C on mpirun, or SIGINT/SIGTERM to it, makes mpirun send SIGTERM to every rank a second later
and SIGKILL a second after that (OMPI_MCA_odls_base_sigkill_timeout sets both waits; mpirun passes SIGUSR1 on at
once); horovodrun --gloo sends SIGTERM and SIGKILL after 5 s; SLURM sends SIGTERM to every task and SIGKILL after
its KillWait (30 s by default), and with `#SBATCH --signal=B:USR1@SECONDS` SIGUSR1 to the batch script that long
before the time limit.

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
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator, Mapping, NoReturn, Optional

from hvd_train.errors import say
from hvd_train.guards import watchdog

if TYPE_CHECKING:
    from types import FrameType

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

    def __init__(self, signum: Optional[int]) -> None:
        super().__init__(signal.Signals(signum).name if signum else "time limit")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        # 130 for SIGINT, 143 for SIGTERM (the shell's convention); a warning or a time limit ahead: requeue.
        return REQUEUE_EXIT if self.signum in (None, signal.SIGUSR1) else 128 + self.signum


class _Guard:
    def __init__(self) -> None:
        self.signum: Optional[int] = None  # the first signal that arrived
        self.raised = False          # Interrupted has been raised in the main thread
        self.writing = 0             # checkpoint writes in progress in the main thread (nesting count)
        self.background = 0          # checkpoint writes in progress on a thread of their own
        self.reported = False
        self.announced = False       # the line saying a signal has the run save and stop was printed
        self.cond = threading.Condition()
        self.describe: Optional[Callable[[], str]] = None  # () -> where the run stands, on the rank that reports
        self.report_here = False     # this rank prints the message (rank 0)
        self.installed = False
        self.save_first = False      # the training loop saves before it stops on SIGTERM and SIGUSR1
        self.deadline = False        # the loop stopped ahead of a job's time limit (no signal)


_guard = _Guard()


def install(report: bool) -> None:
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


def describe_with(fn: Callable[[], str]) -> None:
    """fn() -> a sentence on where the run stands and where --resume auto continues (read from another thread)."""
    _guard.describe = fn


@contextlib.contextmanager
def protected() -> Iterator[None]:
    """A checkpoint write: a signal that arrives during it takes effect at the next check() after it."""
    with _counted("writing"):
        yield


def background_write() -> ContextManager[None]:
    """A checkpoint written by another thread: the process does not end before it is written (the watcher waits),
    while the main thread goes on and takes signals as usual."""
    return _counted("background")


@contextlib.contextmanager
def _counted(name: str) -> Iterator[None]:
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
def save_first() -> Iterator[None]:
    """The training loop: SIGTERM and SIGUSR1 ask it (stop_asked()) for a checkpoint at the next step, then a stop."""
    g = _guard
    g.save_first = True
    try:
        yield
    finally:
        g.save_first = False


def stop_asked() -> bool:
    """Whether a signal asks the training loop to save and stop (this rank's view; the ranks then agree)."""
    g = _guard
    return g.save_first and g.signum in SAVE_FIRST and not g.raised


def stop_now(signum: Optional[int] = None) -> NoReturn:
    """The training loop saved and stops: Interrupted for the signal it stopped on (None: a job's time limit)."""
    g = _guard
    g.raised = True
    if signum is None and g.signum is None:
        g.deadline = True
    raise Interrupted(g.signum if signum is None else signum)


def check() -> None:
    """Raise Interrupted for a signal that arrived during a protected() write (main thread)."""
    g = _guard
    if g.signum is not None and not g.writing and not g.raised and not stop_asked():
        g.raised = True
        raise Interrupted(g.signum)


def signalled() -> Optional[int]:
    """The signal number of the interruption under way, or None."""
    return _guard.signum


def _on_signal(signum: int, frame: Optional["FrameType"]) -> None:
    g = _guard
    if g.signum is None:
        g.signum = signum
    if g.save_first and signum in SAVE_FIRST:
        return  # the training loop saves at its next step, then raises Interrupted itself
    if g.writing or g.raised:
        return  # raised when the write ends; or already unwinding, and a second Ctrl-C changes nothing
    g.raised = True
    raise Interrupted(signum)


def _watch(read_fd: int) -> None:
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


def announce(signum: int) -> None:
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


def report() -> None:
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


log = logging.getLogger("hvd_train")
# squeue's %L: [days-]hours:minutes:seconds, minutes:seconds, or a word (UNLIMITED, NOT_SET, INVALID).
TIME_LEFT = re.compile(r"(?:(?:(\d+)-)?(\d+):)?(\d+):(\d+)")


def parse_time_left(text: str) -> Optional[int]:
    """Seconds from squeue's %L, or None where it names no limit."""
    m = TIME_LEFT.fullmatch(text.strip())
    if m is None:
        return None
    days, hours, minutes, seconds = (int(v) if v else 0 for v in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def slurm_seconds_left(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Seconds until this SLURM job's time limit (squeue -j $SLURM_JOB_ID -o %L), or None: not a SLURM job, no
    limit, or squeue cannot tell (said in one line)."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        return None
    squeue = shutil.which("squeue")
    if squeue is None:
        log.info("SLURM job %s: no squeue on this node, so the time limit is not watched (SIGUSR1 still saves)", job)
        return None
    try:
        out = subprocess.run([squeue, "-h", "-j", job, "-o", "%L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.info("SLURM job %s: squeue failed (%s), so the time limit is not watched", job, e)
        return None
    return parse_time_left(out.stdout) if out.returncode == 0 else None


def deadline(margin_s: float, is_main: bool) -> Optional[float]:
    """time.monotonic() by which a save-and-stop must have begun (rank 0, under a SLURM time limit), else None."""
    if not is_main or not margin_s:
        return None
    left = slurm_seconds_left()
    if left is None:
        return None
    if left <= margin_s:
        log.info("SLURM time limit in %d s, within --checkpoint.before_time_limit_s %g: not watched (lower that "
                 "setting, or ask SLURM for more time)", left, margin_s)
        return None
    log.info("SLURM time limit in %d s: a checkpoint and a stop (exit 75, to be requeued) %g s before it", left,
             margin_s)
    return time.monotonic() + left - margin_s
