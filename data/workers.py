"""What every loader worker does first: leave the stop signals to the training process.

A signal that asks a job to stop (SIGTERM from horovodrun, mpirun or a scheduler, SIGUSR1 as SLURM's warning, a
terminal's SIGINT) is sent to a process group, or to every process of a job step, and so reaches the loader workers
too. A worker that dies of it ends the training process's next fetch with "DataLoader worker exited unexpectedly"
before the ranks have agreed on a step and saved. The training process alone decides what a stop signal means
(hvd_train/guards/interrupt.py); its workers ignore them, and end when it ends them, or when it is gone.
"""
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def ignore_stop_signals(_worker_id=None):
    """A DataLoader worker_init_fn."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
