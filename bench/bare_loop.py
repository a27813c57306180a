"""The bare PyTorch training loop the app is measured against: one process, no Horovod, no bookkeeping.

Same model, batch, optimizer (SGD, momentum 0.9) and threads as `python train_hvd.py --benchmark`; the batch lives in
memory, so only forward, backward and the optimizer step are timed.

    python bench/bare_loop.py --model resnet18 --image-size 32 --batch-size 32 --threads 2
"""
import torch

from common import fixed_batch, rate_summary, sgd_step, step_args, threads_for, timed_rates, write_result
from models import build_model


def main():
    args = step_args(__doc__.splitlines()[0]).parse_args()
    threads = threads_for(args.threads, 1)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model(args.model, args.channels, args.classes, args.image_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = sgd_step(model, optimizer, *fixed_batch(torch, args))
    rates = timed_rates(step, args.batch_size, args.num_warmup_batches, args.num_iters, args.num_batches_per_iter)
    write_result(args.out, {"peer": "bare_loop", "model": args.model, "world_size": 1, "threads_per_rank": threads,
                            **rate_summary([rates])})


if __name__ == "__main__":
    main()
