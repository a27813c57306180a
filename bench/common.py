"""What the peers in bench/ share: the arguments, the fixed batch, the timing loop and the statistics.

The peers (bare_loop.py, ddp_peer.py) import nothing from the app but its model registry, so they measure plain
PyTorch; they time the same way as `train_hvd.py --benchmark`: warm-up steps, then iterations of several steps.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # the model registry, run from any directory


def step_args(description):
    """The command line shared with `train_hvd.py --benchmark` (same names, same defaults)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="small_cnn", help="a name from the app's model registry")
    p.add_argument("--image-size", type=int, default=28, help="side of the square synthetic images, in pixels")
    p.add_argument("--channels", type=int, default=3, help="image channels")
    p.add_argument("--classes", type=int, default=10, help="number of classes")
    p.add_argument("--batch-size", type=int, default=32, help="samples per process per step")
    p.add_argument("--lr", type=float, default=0.025, help="SGD learning rate (momentum 0.9), as the app's default")
    p.add_argument("--amp", choices=("off", "bf16", "fp16"), default="off",
                   help="as the app's --amp: bf16 autocast, or fp16 autocast with a gradient scaler (GPU)")
    p.add_argument("--channels-last", action="store_true",
                   help="as the app's --channels-last: weights and batch in channels-last (NHWC) memory")
    p.add_argument("--num-warmup-batches", type=int, default=10, help="untimed steps first")
    p.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    p.add_argument("--num-batches-per-iter", type=int, default=10, help="steps per timed iteration")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per process (0: cores / processes)")
    p.add_argument("--out", default="", help="write the result as JSON here")
    return p


def threads_for(requested, processes_per_host):
    """The app's rule: one share of the cores per process, unless told otherwise."""
    return requested or max(1, (os.cpu_count() or 1) // processes_per_host)


def fixed_batch(torch, args, seed=0, device="cpu"):
    """The one batch every step trains on, on `device` (channels-last with --channels-last, as the app's)."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.rand(args.batch_size, args.channels, args.image_size, args.image_size, generator=gen)
    labels = torch.randint(0, args.classes, (args.batch_size,), generator=gen)
    if args.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images.to(device), labels.to(device)


def sgd_step(model, optimizer, images, labels, amp="off"):
    """The plain training step the peers time: forward (under autocast with amp bf16 or fp16), cross-entropy,
    backward, optimizer step; fp16 scales the loss and steps through a gradient scaler, as the app does."""
    import contextlib

    import torch
    import torch.nn.functional as F

    model.train()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    scaler = torch.amp.GradScaler(images.device.type) if amp == "fp16" else None

    def autocast():
        return torch.autocast(images.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = F.cross_entropy(model(images), labels)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    return step


def timed_rates(step, samples_per_step, warmup, iters, steps_per_iter, sync=None):
    """Samples/s of each timed iteration of `steps_per_iter` calls to step(), after `warmup` untimed calls.
    sync() (a GPU's torch.cuda.synchronize) runs before each reading of the clock, so queued work counts where it
    belongs."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        step()
    rates = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        for _ in range(steps_per_iter):
            step()
        sync()
        rates.append(samples_per_step * steps_per_iter / (time.perf_counter() - start))
    return rates


def rate_summary(rates_by_process):
    """The figures `train_hvd.py --benchmark` reports: per-process mean +- 1.96 std, and the total."""
    flat = [r for rates in rates_by_process for r in rates]
    return {"img_per_sec_per_rank": statistics.fmean(flat),
            "img_per_sec_per_rank_ci95": 1.96 * statistics.pstdev(flat) if len(flat) > 1 else 0.0,
            "img_per_sec_total": sum(statistics.fmean(r) for r in rates_by_process),
            "img_per_sec_by_rank": rates_by_process}


def spread(values):
    """min / median / max of a list of repeats (NaN-free)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"min": None, "median": None, "max": None, "n": 0}
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def busbw(nbytes, seconds, world_size):
    """Bus bandwidth in bytes/s, as nccl-tests define it for allreduce: algbw x 2(n-1)/n, where algbw is the
    buffer size over the time. It is what each link carries in a ring, comparable across process counts."""
    return nbytes / seconds * 2 * (world_size - 1) / world_size


def write_result(path, result):
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, (list, dict))}, sort_keys=True))
