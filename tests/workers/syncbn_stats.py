"""BatchNorm running statistics after one training-mode forward pass on rank-specific data.

    syncbn_stats.py OUT_DIR [--average]

With --average, hvd_utils.average_buffers runs after the pass, as the training loop does after every epoch.

Rank r feeds 4 samples filled with the value r + 1. Each rank writes OUT_DIR/rank<r>.pt with its running mean.
"""
import sys

import torch
from torch import nn

import hvd_utils


def main(out_dir, average):
    rt = hvd_utils.init()
    model = nn.Sequential(nn.Conv2d(1, 2, 1, bias=False), nn.BatchNorm2d(2, momentum=1.0))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    model.train()
    model(torch.full((4, 1, 3, 3), float(rt.rank + 1)))
    if average:
        hvd_utils.average_buffers(model)
    torch.save({"running_mean": model[1].running_mean.clone()}, f"{out_dir}/rank{rt.rank}.pt")
    hvd_utils.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], "--average" in sys.argv)
