"""Writes checkpoints of ~8 MB as fast as it can, epoch after epoch, until it is killed.

    checkpoint_writer.py DIR START_EPOCH [background]

Even epochs are written as epoch-end checkpoints, odd ones as checkpoints within an epoch (step_NNNNNNNN.pt), both
becoming last.pt. With `background`, a thread of the Checkpointer's own writes each from a copy in memory while the
loop goes on. Prints "writing N" before each checkpoint and "saved N" once it is on disk, so a test can kill it
inside a write it knows of.
"""
import sys

import torch

from hvd_train.run import checkpoint


def main(directory, start, background=False):
    saver = checkpoint.Checkpointer(directory, keep_last=2, background=background)
    weights = torch.arange(2_000_000, dtype=torch.float32)  # + epoch: a test can tell a whole file of its epoch
    epoch = start
    while True:
        print(f"writing {epoch}", flush=True)
        payload = {"version": checkpoint.VERSION, "epoch": epoch, "model": {"w": weights + epoch}}
        if epoch % 2:
            saver.save_step(payload, epoch)
        else:
            saver.save(payload, epoch, is_best=epoch % 4 == 0)
        saver.wait()
        print(f"saved {epoch}", flush=True)
        epoch += 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["background"])
