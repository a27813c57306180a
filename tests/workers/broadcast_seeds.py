"""Ranks seeded differently build different models and momentum buffers; broadcast_state must make them equal.

    broadcast_seeds.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.pt with its parameters and momentum buffers before and after the broadcast.
"""
import sys

import torch

import hvd_utils
from hvd_train.models import build_model
from hvd_train import trainer as engine
from hvd_train.trainer import StepOptions, Trainer
from hvd_train.tasks import builtin_task


def momentum_buffers(optimizer):
    return [optimizer.state[p]["momentum_buffer"].clone() for group in optimizer.param_groups for p in group["params"]]


def main(out_dir):
    rt = hvd_utils.init()
    torch.manual_seed(1000 + rt.rank)
    model = build_model("small_cnn", 1, 10, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # One local step on rank-specific random data, so every rank holds its own momentum state.
    trainer = Trainer(model, builtin_task("classification"), optimizer, None, torch.device("cpu"), StepOptions())
    engine.train_step(trainer, (torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))))
    local_state = optimizer.state_dict()
    # Horovod's wrapper is a new optimizer over the same parameters, without the old one's state: load it back,
    # as a resume does, so each rank enters the broadcast with its own momentum.
    optimizer = hvd_utils.distributed_optimizer(optimizer, model)
    optimizer.load_state_dict(local_state)
    before = {"params": {k: v.clone() for k, v in model.state_dict().items()}, "momentum": momentum_buffers(optimizer)}
    hvd_utils.broadcast_state(model, optimizer, root_rank=0)
    after = {"params": {k: v.clone() for k, v in model.state_dict().items()}, "momentum": momentum_buffers(optimizer)}
    torch.save({"before": before, "after": after}, f"{out_dir}/rank{rt.rank}.pt")
    hvd_utils.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
