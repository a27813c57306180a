"""The peer: PyTorch DistributedDataParallel over Gloo, launched with torchrun, as one would write it by hand.

Same model, per-rank batch, optimizer, precision, memory format and threads per rank as `train_hvd.py --benchmark`;
written to be fast, not to lose: gradients bucketed and allreduced during backward (DDP's default 25 MB buckets),
buckets as views of the gradients (no copy), gradients set to None between steps, the batch in memory.

    torchrun --standalone --nproc-per-node 2 bench/ddp_peer.py --model resnet18 --image-size 32 --batch-size 32
"""
import importlib
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from common import fixed_batch, rate_summary, sgd_step, step_args, threads_for, timed_rates, write_result
from hvd_train.models import build_model


def main():
    parser = step_args(__doc__.splitlines()[0])
    parser.add_argument("--bf16-compress", action="store_true",
                        help="DDP's bf16_compress_hook: gradients travel as bfloat16 (the peer of --bf16-allreduce)")
    parser.add_argument("--powersgd-rank", type=int, default=0,
                        help="DDP's powerSGD_hook at this rank (error feedback and warm start on; the peer of the "
                        "app's --powersgd-rank); 0: off")
    parser.add_argument("--powersgd-start-step", type=int, default=2, help="the hook's start_powerSGD_iter")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="DDP's bucket size; the PowerSGD hook over Gloo needs one bucket (larger than the model)")
    args = parser.parse_args()
    if args.amp == "fp16":
        parser.error("--amp fp16 needs a GPU, and this peer runs on CPUs over Gloo (as in the app: use bf16)")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = threads_for(args.threads, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    torch.set_num_threads(threads)
    torch.manual_seed(0)  # the same initial weights everywhere; DDP also broadcasts rank 0's at construction
    model = model_of(args)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_cap_mb)
    if args.bf16_compress:
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    if args.powersgd_rank:
        # DDP's defaults but for the rank and the start step (the bench gives the app the same).
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=args.powersgd_start_step, min_compression_rate=2,
                                            use_error_feedback=True, warm_start=True, random_seed=0)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=0.9)
    step = sgd_step(model, optimizer, *fixed_batch(torch, args, seed=rank), amp=args.amp)
    rates = timed_rates(step, args.batch_size, args.num_warmup_batches, args.num_iters, args.num_batches_per_iter)
    gathered = [None] * world
    dist.all_gather_object(gathered, rates)
    if rank == 0:
        write_result(args.out, {"peer": "torchrun_ddp_gloo", "bf16_compress": args.bf16_compress,
                                "powersgd_rank": args.powersgd_rank,
                                "model": args.model, "world_size": world,
                                "threads_per_rank": threads, **rate_summary(gathered)})
    # Both ranks leave together: a rank tearing down its Gloo connections while the other still polls them can make
    # Gloo throw in a background thread (std::terminate, SIGABRT); seen once in CI, not reproduced in 25 runs.
    dist.barrier()
    dist.destroy_process_group()


def model_of(args):
    """A model of the app's registry, or `module:function` (bench/mlp.py's), built as the app builds plug-ins."""
    if ":" in args.model:
        module, function = args.model.split(":")
        factory = getattr(importlib.import_module(module), function)
        return factory(in_channels=args.channels, image_size=args.image_size, num_classes=args.classes)
    return build_model(args.model, args.channels, args.classes, args.image_size)


if __name__ == "__main__":
    main()
