"""Horovod started and shut down CYCLES times in one process, an allreduce and a barrier in each, as Horovod's own
test_torch.py does around every test (and as a process that runs several jobs' worth of work in turn does).
Writes OUT (rank 0): the cycles done and the last allreduce's result.

    reinit_cycles.py OUT CYCLES
"""
import json
import sys

import horovod.torch as hvd
import torch


def main(out, cycles):
    total = None
    for _ in range(cycles):
        hvd.init()
        total = hvd.allreduce(torch.ones(4), op=hvd.Sum, name="cycle")
        hvd.barrier()
        rank = hvd.rank()
        hvd.shutdown()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"cycles": cycles, "sum": total.tolist()}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
