"""train_hvd.py whose checkpoint of one epoch is held mid-write until the test lets it go, so a signal can be sent
while it is being written.

    held_checkpoint_train.py EPOCH MARKER_DIR -- TRAIN_HVD_ARGS...

Writing epoch_EPOCH.pt, rank 0 creates MARKER_DIR/writing, then waits for MARKER_DIR/go before it writes the file
for real. Everything else is the real application.
"""
import os
import sys
import time

from hvd_train.run import checkpoint
import train_hvd


def main():
    epoch, markers = int(sys.argv[1]), sys.argv[2]
    sys.argv = [sys.argv[0]] + sys.argv[sys.argv.index("--") + 1:]
    real_save = checkpoint.atomic_save

    def held_save(obj, path):
        if os.path.basename(path) == f"epoch_{epoch:04d}.pt":
            open(os.path.join(markers, "writing"), "w").close()
            while not os.path.exists(os.path.join(markers, "go")):
                time.sleep(0.05)
        real_save(obj, path)

    checkpoint.atomic_save = held_save
    train_hvd.cli()


if __name__ == "__main__":
    main()
