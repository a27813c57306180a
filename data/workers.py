"""What every loader worker does first: leave the stop signals to the training process that owns it.

A signal that asks a job to stop (SIGTERM from horovodrun, mpirun or a scheduler, SIGUSR1 as SLURM's warning, a
terminal's SIGINT) is sent to a process group, to every process of a job step, or to every descendant of a launcher,
and so reaches the loader workers too. A worker that dies of it ends the training process's next fetch with
"DataLoader worker exited unexpectedly" before the ranks have agreed on a step and saved. So a worker takes those
signals itself, on a thread of its own (sigwaitinfo, which tells who sent each), and passes over any that does not
come from the training process; the training process alone decides what a stop means
(hvd_train/guards/interrupt.py).

A stop can also cut a batch's hand-over short: a worker passes each batch's shared-memory file descriptors to its
training process through multiprocessing's resource sharer, a thread that serves each one on request, and a training
process that ends mid-request leaves that thread a closed connection, which it reports through sys.excepthook as a
traceback after the run's own last line. The training process reports its own errors; a worker's sharer has nobody
left to serve, so a worker passes over those (_quiet_when_the_reader_leaves).

The training process does end its workers with SIGTERM (torch's DataLoader when it shuts down, multiprocessing's
terminate()): a worker obeys those at once, as torch's own worker handler does.

Under the forkserver context (data/__init__.py) a worker's parent is the server, and torch's watchdog ends a worker
whose parent is gone: the server must outlive a stop signal too. It imports this module (its preload), and ignores
them from then on; it ends when the training process does (multiprocessing closes its pipe).
"""
import functools
import os
import signal
import sys
import threading
from multiprocessing import resource_sharer
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from types import FrameType, TracebackType

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}


def stop_signals_from(owner: int) -> Callable[[int], None]:
    """A DataLoader worker_init_fn for the loaders of process `owner` (os.getpid() of the training process; under
    the forkserver context a worker's parent is the server, not it)."""
    return functools.partial(_take_stop_signals, owner)


def _take_stop_signals(owner: int, _worker_id: Optional[int] = None) -> None:
    # Blocked on this thread before any other starts: the threads started later (the waiter, any the data set
    # starts) inherit the mask, so only the waiter ever takes these signals.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    # A stack request (SIGUSR2, hvd_train/guards/watchdog.py) is for the training process: a worker that a
    # `pkill -USR2` reaches too neither dies of it nor writes its stacks into its owner's pipe (inherited by fork).
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    threading.Thread(target=_wait_for_stop_signals, args=(owner,), name="stop-signals", daemon=True).start()
    sys.excepthook = _quiet_when_the_reader_leaves(sys.excepthook)


def _wait_for_stop_signals(owner: int) -> None:
    while True:
        info = signal.sigwaitinfo(STOP_SIGNALS)
        if info.si_pid in (owner, os.getppid()):  # ended by the process that runs it: at once, as torch's handler
            os._exit(0)


def _quiet_when_the_reader_leaves(
        hook: "Callable[[type[BaseException], BaseException, Optional[TracebackType]], Any]"
) -> "Callable[[type[BaseException], BaseException, Optional[TracebackType]], Any]":
    def excepthook(kind, value, tb):
        # _serve catches whatever ends a request and hands it to sys.excepthook, so the traceback's first frame is it
        lost_reader = issubclass(kind, (ConnectionError, EOFError))
        in_sharer = tb is not None and tb.tb_frame.f_code is resource_sharer._ResourceSharer._serve.__code__
        if not (lost_reader and in_sharer):
            hook(kind, value, tb)
    return excepthook


def _imported_by_a_forkserver() -> bool:
    frame: "Optional[FrameType]" = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return True
        frame = frame.f_back
    return False


if _imported_by_a_forkserver():  # its children, the workers, inherit this until they take the signals themselves
    for _signum in (*STOP_SIGNALS, signal.SIGUSR2):
        signal.signal(_signum, signal.SIG_IGN)
