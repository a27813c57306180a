"""train_hvd.py whose ranks are all killed (SIGKILL) right after the checkpoint taken within an epoch at one step of
the run is written: a job lost to a dead node, a failed GPU or a scheduler's kill, just after a save.

    killed_after_save.py STEP -- TRAIN_HVD_ARGS...

After the checkpoint of run step STEP (--checkpoint.every_steps must land on it) is written whole (rank 0's background
writer included; the ranks wait for it together), every rank kills itself and its loader workers, as a node that
dies takes them all. Everything else is the real application.
"""
import os
import signal
import sys

import psutil

import hvd_utils
from hvd_train.run import checkpoint as saves
import train_hvd


def main():
    step = int(sys.argv[1])
    sys.argv = [sys.argv[0]] + sys.argv[sys.argv.index("--") + 1:]
    real_save = saves.StepSaves.save

    def save_then_die(self, *args, **kwargs):
        real_save(self, *args, **kwargs)
        if self.after_epoch.state.step == step:
            hvd_utils.decide_on_root(self.checkpointer.wait, "written")
            for child in psutil.Process().children(recursive=True):  # loader workers, their forkserver
                child.kill()
            os.kill(os.getpid(), signal.SIGKILL)

    saves.StepSaves.save = save_then_die
    train_hvd.cli()


if __name__ == "__main__":
    main()
