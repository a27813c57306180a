"""The peer: PyTorch DistributedDataParallel over Gloo, launched with torchrun, as one would write it by hand.

Same model, per-rank batch, optimizer, precision, memory format and threads per rank as `train_hvd.py --benchmark`;
written to be fast, not to lose: gradients bucketed and allreduced during backward (DDP's default 25 MB buckets),
buckets as views of the gradients (no copy), gradients set to None between steps, the batch in memory.

    torchrun --standalone --nproc-per-node 2 bench/ddp_peer.py --model resnet18 --image-size 32 --batch-size 32
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from common import fixed_batch, rate_summary, sgd_step, step_args, threads_for, timed_rates, write_result
from hvd_train.models import build_model


def main():
    parser = step_args(__doc__.splitlines()[0])
    parser.add_argument("--bf16-compress", action="store_true",
                        help="DDP's bf16_compress_hook: gradients travel as bfloat16 (the peer of --bf16-allreduce)")
    args = parser.parse_args()
    if args.amp == "fp16":
        parser.error("--amp fp16 needs a GPU, and this peer runs on CPUs over Gloo (as in the app: use bf16)")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = threads_for(args.threads, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    torch.set_num_threads(threads)
    torch.manual_seed(0)  # the same initial weights everywhere; DDP also broadcasts rank 0's at construction
    model = build_model(args.model, args.channels, args.classes, args.image_size)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = DistributedDataParallel(model, gradient_as_bucket_view=True)
    if args.bf16_compress:
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=0.9)
    step = sgd_step(model, optimizer, *fixed_batch(torch, args, seed=rank), amp=args.amp)
    rates = timed_rates(step, args.batch_size, args.num_warmup_batches, args.num_iters, args.num_batches_per_iter)
    gathered = [None] * world
    dist.all_gather_object(gathered, rates)
    if rank == 0:
        write_result(args.out, {"peer": "torchrun_ddp_gloo", "bf16_compress": args.bf16_compress,
                                "model": args.model, "world_size": world,
                                "threads_per_rank": threads, **rate_summary(gathered)})
    # Both ranks leave together: a rank tearing down its Gloo connections while the other still polls them can make
    # Gloo throw in a background thread (std::terminate, SIGABRT); seen once in CI, not reproduced in 25 runs.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
