"""Writes checkpoints of ~8 MB as fast as it can, epoch after epoch, until it is killed.

    checkpoint_writer.py DIR START_EPOCH

Prints "writing N" before and "saved N" after each checkpoint, so a test can kill it inside a write it knows of.
"""
import sys

import torch

from hvd_train.run import checkpoint


def main(directory, start):
    saver = checkpoint.Checkpointer(directory, keep_last=2)
    weights = torch.arange(2_000_000, dtype=torch.float32)  # + epoch: a test can tell a whole file of its epoch
    epoch = start
    while True:
        print(f"writing {epoch}", flush=True)
        saver.save({"version": checkpoint.VERSION, "epoch": epoch, "model": {"w": weights + epoch}}, epoch,
                   is_best=epoch % 2 == 0)
        print(f"saved {epoch}", flush=True)
        epoch += 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
