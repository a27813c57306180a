"""Gradients averaged through hvd-train's DistributedOptimizer as float32, fp16 and bfloat16, and bfloat16 tensors
through Horovod's other collectives.

    wire_formats.py OUT_FILE [--gpu]

Rank r's gradient of a bias-free Linear(4, 2) is [[g_r], [2 g_r]] with g_r = (r + 1) * [1e5, 1.001, 1e-3, -2.5]:
its first column is beyond fp16's largest value (65504), the others need float32's precision or the small end of
the range. Each format's averaged gradient (float32, as the optimizer sees it) is saved, with the results of a
bfloat16 reducescatter (average), allgather and broadcast, to OUT_FILE by rank 0. --gpu: on each rank's GPU
(NCCL's bfloat16 and the CUDA scaling of an average).
"""
import sys
from collections import OrderedDict

import horovod.torch as hvd
import torch

import hvd_utils

FORMATS = {"fp32": {}, "fp16": {"fp16_allreduce": True}, "bf16": {"bf16_allreduce": True}}


def base_gradient(rank, device):
    return (rank + 1) * torch.tensor([1e5, 1.001, 1e-3, -2.5], device=device)


def averaged_gradient(name, flags, rank, device):
    # A name of its own for each format's weight: Horovod matches tensors across ranks by name.
    model = torch.nn.Sequential(OrderedDict([(name, torch.nn.Linear(4, 2, bias=False))])).to(device)
    optimizer = hvd_utils.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                                                hvd_utils.WireOptions(**flags))
    # d/dW of sum(c * (W x)) is the outer product of c and x.
    (model(base_gradient(rank, device).unsqueeze(0)) * torch.tensor([1.0, 2.0], device=device)).sum().backward()
    optimizer.synchronize()
    return model[0].weight.grad.clone()


def main():
    rt = hvd_utils.init()
    device = rt.device if "--gpu" in sys.argv[2:] else torch.device("cpu")
    results = {name: averaged_gradient(name, flags, rt.rank, device) for name, flags in FORMATS.items()}
    mine = base_gradient(rt.rank, device).to(torch.bfloat16)
    results["reducescatter"] = hvd.reducescatter(torch.stack([mine] * rt.size), op=hvd.Average, name="rs")
    results["allgather"] = hvd.allgather(mine.unsqueeze(0), name="ag")
    results["broadcast"] = hvd.broadcast(mine, root_rank=rt.size - 1, name="bc")
    results = {key: value.cpu() for key, value in results.items()}
    results["device"] = str(device)
    if rt.is_main:
        torch.save(results, sys.argv[1])
    hvd_utils.shutdown()


if __name__ == "__main__":
    main()
