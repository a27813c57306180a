"""Horovod's collectives on CUDA tensors (run by NCCL in a GPU build), each rank on the GPU of its local rank.

    nccl_collectives.py OUT_DIR

Rank r of n contributes base + r + 1 (base = 0, 1, ..., 999) to allreduces (sum, average, pre/post-scaled sum,
fp16 average, in place), r + 10 to a broadcast from rank 0, r to one from the last rank, and r + 1 rows of r to an
allgather. Each rank writes OUT_DIR/rank<r>.json with every result and the device it came back on.
"""
import json
import sys

import horovod.torch as hvd
import torch


def main(out_dir):
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda", hvd.local_rank())
    rank, size = hvd.rank(), hvd.size()
    mine = torch.arange(1000, dtype=torch.float32, device=device) + rank + 1
    results = {
        "sum": hvd.allreduce(mine, op=hvd.Sum, name="sum"),
        "average": hvd.allreduce(mine, op=hvd.Average, name="average"),
        "scaled_sum": hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25, name="scaled"),
        "fp16_average": hvd.allreduce(mine.half(), op=hvd.Average, name="fp16"),
        "broadcast_from_0": hvd.broadcast(torch.full((4, 5), float(rank + 10), device=device), root_rank=0,
                                          name="bcast0"),
        "broadcast_from_last": hvd.broadcast(torch.full((3,), float(rank), device=device), root_rank=size - 1,
                                             name="bcast_last"),
        "allgather": hvd.allgather(torch.full((rank + 1, 2), float(rank), device=device), name="gather"),
    }
    in_place = mine.clone()
    hvd.allreduce_(in_place, op=hvd.Average, name="in_place")  # as DistributedOptimizer averages gradients
    results["in_place_average"] = in_place
    record = {"rank": rank, "size": size, "local_rank": hvd.local_rank(), "nccl_built": bool(hvd.nccl_built()),
              "devices": {k: str(v.device) for k, v in results.items()},
              "dtypes": {k: str(v.dtype) for k, v in results.items()},
              "values": {k: v.float().cpu().tolist() for k, v in results.items()}}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(record, f)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
