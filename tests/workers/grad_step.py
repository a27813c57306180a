"""One optimizer step through hvd-train's own pieces; rank r trains on samples [r*B, (r+1)*B) of the digits.

    grad_step.py OUT_FILE BATCH_PER_RANK [--accumulate N] [--fp16-allreduce] [--adasum] [--predivide F]
                 [--channels-last] [--compile] [--every-rank]

Rank 0 saves the parameters after the step to OUT_FILE. With 2 ranks and batch B, and with 1 rank and batch 2B,
both runs see the same 2B samples; averaged gradients make the two results equal. Plain SGD without momentum
and learning rate 0.5, so the update is exactly -0.5 x the combined gradient. --compile compiles the model in place
as the app's --compile does; --every-rank saves each rank's parameters to OUT_FILE.<rank> as well.
"""
import argparse

import torch

import hvd_utils
from hvd_train.data.digits import load_digits_dataset
from hvd_train.models import build_model, to_channels_last
from hvd_train import engine
from hvd_train.engine import StepOptions, Trainer
from hvd_train.tasks import builtin_task


def main():
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
    args = parser.parse_args()

    rt = hvd_utils.init()
    torch.manual_seed(0)
    model = build_model("small_cnn", 1, 10, 8)
    if args.channels_last:
        to_channels_last(model)
    if args.compile:
        model.compile()  # before the optimizer is wrapped, as hvd_train.build does
    model.eval()  # no dropout: the comparison must not depend on per-rank random masks
    optimizer = hvd_utils.distributed_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), model, batches_per_allreduce=args.accumulate,
        fp16_allreduce=args.fp16_allreduce, use_adasum=args.adasum, gradient_predivide_factor=args.predivide)
    hvd_utils.broadcast_state(model, optimizer)
    digits = load_digits_dataset()
    lo, hi = rt.rank * args.batch, (rt.rank + 1) * args.batch
    images = torch.stack([digits[i][0] for i in range(lo, hi)])
    labels = torch.stack([digits[i][1] for i in range(lo, hi)])
    opts = StepOptions(accumulate=args.accumulate)
    trainer = Trainer(model, builtin_task("classification"), optimizer, None, images.device, opts)
    engine.train_step(trainer, (images, labels))
    if rt.is_main:
        torch.save(model.state_dict(), args.out_file)
    if args.every_rank:
        torch.save(model.state_dict(), f"{args.out_file}.{rt.rank}")
    hvd_utils.shutdown()


if __name__ == "__main__":
    main()
