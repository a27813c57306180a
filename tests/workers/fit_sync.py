"""Two epochs of hvd-train's real training loop, with dropout on; every rank saves its final parameters.

    fit_sync.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.pt. Ranks see different samples and different dropout masks, so only correct
gradient averaging leaves them with identical weights.
"""
import sys

import torch

import hvd_utils
from hvd_train.data import LoaderSpec, build_loaders
from hvd_train import trainer as engine
from hvd_train.config import DataConfig, OptimConfig
from hvd_train.data import build_datasets
from hvd_train.trainer import LRSchedule
from hvd_train.tasks import builtin_task
from hvd_train.models import build_model


def main(out_dir):
    rt = hvd_utils.init()
    torch.manual_seed(rt.rank)
    train_set, val_set, info = build_datasets(DataConfig())
    train_loader, val_loader, sampler = build_loaders(train_set, val_set, LoaderSpec(64, seed=0), rt.rank, rt.size)
    model = build_model("small_cnn", info.in_channels, info.num_classes, info.image_size)
    optimizer = hvd_utils.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    hvd_utils.broadcast_state(model, optimizer)
    trainer = engine.Trainer(model, builtin_task("classification"), optimizer,
                             LRSchedule(OptimConfig(epochs=2, lr=0.05), 1), torch.device("cpu"), engine.StepOptions(),
                             epochs=2)
    engine.fit_epochs(trainer, train_loader, val_loader, engine.Hooks(sampler))
    torch.save(model.state_dict(), f"{out_dir}/rank{rt.rank}.pt")
    hvd_utils.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
