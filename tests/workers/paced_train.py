"""train_hvd.py that takes its time while the job has one worker, so a test can grow the job before it ends.

    paced_train.py SECONDS AFTER -- TRAIN_HVD_ARGS...

After AFTER training steps of this process, each step sleeps SECONDS first for as long as the job has one worker.
Everything else is the real application.
"""
import sys
import time

from hvd_train import trainer
import hvd_utils
import train_hvd


def main():
    seconds, after = float(sys.argv[1]), int(sys.argv[2])
    sys.argv = [sys.argv[0]] + sys.argv[sys.argv.index("--") + 1:]
    real_step, calls = trainer.train_step, {"n": 0}

    def paced_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > after and hvd_utils.world_size() == 1:
            time.sleep(seconds)
        return real_step(*args, **kwargs)

    trainer.train_step = paced_step
    train_hvd.cli()


if __name__ == "__main__":
    main()
