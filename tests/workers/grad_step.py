"""One optimizer step through hvd-train's own pieces; rank r trains on samples [r*B, (r+1)*B) of the digits.

    grad_step.py OUT_FILE BATCH_PER_RANK [--accumulate N] [--fp16-allreduce] [--adasum] [--predivide F]
                 [--channels-last] [--compile] [--every-rank]
    grad_step.py OUT_FOLDER BATCH_PER_RANK --variants NAME[,NAME...]

Rank 0 saves the parameters after the step to OUT_FILE. With 2 ranks and batch B, and with 1 rank and batch 2B,
both runs see the same 2B samples; averaged gradients make the two results equal. Plain SGD without momentum
and learning rate 0.5, so the update is exactly -0.5 x the combined gradient. --compile compiles the model in place
as the app's --compile does; --every-rank saves each rank's parameters to OUT_FILE.<rank> as well.

--variants takes several steps in one job, each from the same start with a model and a DistributedOptimizer of its
own, and saves each to OUT_FOLDER/NAME.pt (the names are VARIANTS'): the tests that compare one option's step with
the plain one's share a job, not a job each (most of a job's time is its ranks' start-up).
"""
import argparse
import os

import torch

import hvd_utils
from hvd_train.data.catalog import load_digits_dataset
from hvd_train.models import build_model, to_channels_last
from hvd_train import trainer as engine
from hvd_train.config import HorovodConfig
from hvd_train.trainer import StepOptions, Trainer
from hvd_train.tasks import builtin_task

# name: the flags it stands for
VARIANTS = {"plain": [], "accumulate-2": ["--accumulate", "2"], "fp16-allreduce": ["--fp16-allreduce"],
            "predivide-2": ["--predivide", "2"], "channels-last": ["--channels-last"], "adasum": ["--adasum"]}


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out_file")
    parser.add_argument("batch", type=int)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--adasum", action="store_true")
    parser.add_argument("--predivide", type=float, default=1.0)
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--every-rank", action="store_true")
    parser.add_argument("--variants", type=lambda text: text.split(","))
    return parser.parse_args(argv)


def step(rt, args, digits, out_file):
    torch.manual_seed(0)
    model = build_model("small_cnn", 1, 10, 8)
    if args.channels_last:
        to_channels_last(model)
    if args.compile:
        model.compile()  # before the optimizer is wrapped, as hvd_train.training does
    model.eval()  # no dropout: the comparison must not depend on per-rank random masks
    optimizer = hvd_utils.distributed_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), model, hvd_utils.WireOptions(
            batches_per_allreduce=args.accumulate, fp16_allreduce=args.fp16_allreduce, use_adasum=args.adasum,
            gradient_predivide_factor=args.predivide))
    hvd_utils.broadcast_state(model, optimizer)
    lo, hi = rt.rank * args.batch, (rt.rank + 1) * args.batch
    images = torch.stack([digits[i][0] for i in range(lo, hi)])
    labels = torch.stack([digits[i][1] for i in range(lo, hi)])
    opts = StepOptions(horovod=HorovodConfig(batches_per_allreduce=args.accumulate))
    trainer = Trainer(model, builtin_task("classification"), optimizer, None, images.device, opts)
    engine.train_step(trainer, (images, labels))
    if rt.is_main:
        torch.save(model.state_dict(), out_file)
    if args.every_rank:
        torch.save(model.state_dict(), f"{out_file}.{rt.rank}")


def main():
    args = parse()
    rt = hvd_utils.init()
    digits = load_digits_dataset()
    if args.variants is None:
        step(rt, args, digits, args.out_file)
    else:
        os.makedirs(args.out_file, exist_ok=True)
        for name in args.variants:
            step(rt, parse([args.out_file, str(args.batch), *VARIANTS[name]]), digits,
                 os.path.join(args.out_file, f"{name}.pt"))
    hvd_utils.shutdown()


if __name__ == "__main__":
    main()
