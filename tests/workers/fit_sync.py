"""Two epochs of hvd-train's real training loop, with dropout on; every rank saves its final parameters.

    fit_sync.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.pt. Ranks see different samples and different dropout masks, so only correct
gradient averaging leaves them with identical weights.
"""
import sys

import torch

import engine
import hvd_utils
from data import build_datasets, build_loaders
from config import OptimConfig, DataConfig
from models import build_model
from tasks import TASKS


def main(out_dir):
    rt = hvd_utils.init()
    torch.manual_seed(rt.rank)
    train_set, val_set, info = build_datasets(DataConfig())
    train_loader, val_loader, sampler = build_loaders(train_set, val_set, 64, rt.rank, rt.size, seed=0)
    model = build_model("small_cnn", info.in_channels, info.num_classes, info.image_size)
    optimizer = hvd_utils.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    hvd_utils.broadcast_state(model, optimizer)
    scheduler = engine.make_scheduler(optimizer, OptimConfig(epochs=2), len(train_loader), rt.size)
    engine.fit(model, TASKS["classification"], optimizer, scheduler, train_loader, val_loader, sampler,
               torch.device("cpu"), epochs=2)
    torch.save(model.state_dict(), f"{out_dir}/rank{rt.rank}.pt")
    hvd_utils.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
