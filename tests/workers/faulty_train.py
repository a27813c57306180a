"""train_hvd.py with a fault injected into one rank's training step, as a crash in user code or a dying host.

    faulty_train.py RANK STEP {raise,kill,stop,hang} -- TRAIN_HVD_ARGS...

On global rank RANK, at training step STEP, the step raises RuntimeError, or the process SIGKILLs itself, or it
SIGSTOPs itself (frozen: no thread runs), or the step blocks for an hour (alive but stuck, as in a data read that
never returns). Everything else is the real application.
"""
import os
import signal
import sys
import time

from hvd_train import trainer
import hvd_utils
import train_hvd


def main():
    rank, step, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    sys.argv = [sys.argv[0]] + sys.argv[sys.argv.index("--") + 1:]
    real_step, calls = trainer.train_step, {"n": 0}

    def faulty_step(*args, **kwargs):
        calls["n"] += 1
        if hvd_utils.launcher_rank() == rank and calls["n"] == step:
            # When the fault happens, for the test to time how long the job takes to end after it.
            with open(os.environ["HVD_TEST_FAULT_TIME"] + ".pid", "w") as f:  # how MPICH's mpirun names a rank
                f.write(str(os.getpid()))
            with open(os.environ["HVD_TEST_FAULT_TIME"], "w") as f:
                f.write(repr(time.time()))
            if mode in ("kill", "stop"):
                os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
            if mode in ("stop", "hang"):
                time.sleep(3600)  # (a stopped rank that the launcher resumes to end it stays where it froze)
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        return real_step(*args, **kwargs)

    trainer.train_step = faulty_step
    train_hvd.cli()


if __name__ == "__main__":
    main()
