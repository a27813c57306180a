"""Rank 1 joins an allreduce DELAY seconds after rank 0. Rank 0 writes how long it waited and how much CPU its
process (the training thread and Horovod's own) used meanwhile: a rank that waits for a slower peer should not
take a core from it."""
import json
import sys
import time

import torch

import hvd_utils


def main(out, delay):
    rt = hvd_utils.init(cpu=True)
    hvd_utils.allreduce_average([torch.ones(4)], name="first")  # connections made, first-use costs paid
    if rt.rank == 1:
        time.sleep(delay)
    wall, cpu = time.monotonic(), time.process_time()
    hvd_utils.allreduce_average([torch.ones(4)], name="late")
    waited, used = time.monotonic() - wall, time.process_time() - cpu
    if rt.rank == 0:
        with open(out, "w") as f:
            json.dump({"waited": waited, "cpu": used}, f)
    hvd_utils.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
