"""Writes checkpoints of ~8 MB as fast as it can, epoch after epoch, until it is killed.

    checkpoint_writer.py DIR START_EPOCH
"""
import sys

import torch

import checkpoint


def main(directory, start):
    saver = checkpoint.Checkpointer(directory, keep_last=2)
    weights = torch.randn(2_000_000)
    epoch = start
    while True:
        saver.save({"version": checkpoint.VERSION, "epoch": epoch, "model": {"w": weights + epoch}}, epoch,
                   is_best=epoch % 2 == 0)
        epoch += 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
