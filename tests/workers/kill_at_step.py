"""train_hvd.py whose rank 0 kills a process group at one of its training steps: a server that dies mid-run.

    kill_at_step.py PGID STEP -- TRAIN_HVD_ARGS...

On rank 0, at training step STEP, process group PGID gets SIGKILL, and the step goes on. Everything else is the
real application.
"""
import os
import signal
import sys

from hvd_train import trainer
import hvd_utils
import train_hvd


def main():
    pgid, step = int(sys.argv[1]), int(sys.argv[2])
    sys.argv = [sys.argv[0]] + sys.argv[sys.argv.index("--") + 1:]
    real_step, calls = trainer.train_step, {"n": 0}

    def step_that_kills(*args, **kwargs):
        calls["n"] += 1
        if hvd_utils.launcher_rank() == 0 and calls["n"] == step:
            os.killpg(pgid, signal.SIGKILL)
        return real_step(*args, **kwargs)

    trainer.train_step = step_that_kills
    train_hvd.cli()


if __name__ == "__main__":
    main()
