"""One optimizer step through hvd-train's own pieces; rank r trains on samples [r*B, (r+1)*B) of the digits.

    grad_step.py OUT_FILE BATCH_PER_RANK

Rank 0 saves the parameters after the step to OUT_FILE. With 2 ranks and batch B, and with 1 rank and batch 2B,
both runs see the same 2B samples; averaged gradients make the two results equal.
"""
import sys

import torch

import engine
import hvd_utils
from data.digits import load_digits_dataset
from models import build_model
from tasks import TASKS


def main(out_file, batch):
    rt = hvd_utils.init()
    torch.manual_seed(0)
    model = build_model("small_cnn", 1, 10, 8)
    model.eval()  # no dropout: the comparison must not depend on per-rank random masks
    optimizer = hvd_utils.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), model)
    hvd_utils.broadcast_state(model, optimizer)
    digits = load_digits_dataset()
    lo, hi = rt.rank * batch, (rt.rank + 1) * batch
    images = torch.stack([digits[i][0] for i in range(lo, hi)])
    labels = torch.stack([digits[i][1] for i in range(lo, hi)])
    engine.train_step(model, TASKS["classification"], optimizer, images, labels)
    if rt.is_main:
        torch.save(model.state_dict(), out_file)
    hvd_utils.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
