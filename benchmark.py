"""`train_hvd.py --benchmark`: images/s of the app's own training step on a synthetic batch held in memory.

What Horovod's pytorch_synthetic_benchmark.py measures, through the code that trains: the same model, optimizer,
Horovod wrapper, learning-rate scheduler, metric sums and non-finite checks as a real run (engine.train_one_epoch),
fed one random batch again and again so that no input pipeline is timed. Warm-up steps first, then num_iters timed
iterations of num_batches_per_iter steps; each rank times its own, and rank 0 reports every rank's figures.
"""
import logging
import math
import os
import statistics
import time

import torch

import engine
import hvd_utils
from checkpoint import CheckpointError
from data import DATASETS, DataInfo
from lifecycle import build_distributed_optimizer, build_model_on
from models import MODELS as SMALL_MODELS, is_channels_last, model_task
from reporting import read_json_or_none, seconds_since_start, write_json
from tasks import TASKS

log = logging.getLogger("hvd_train")


def synthetic_batch(cfg, info, device):
    """One random batch per step (the per-rank batch x batches_per_allreduce), made once, on the device."""
    gen = torch.Generator().manual_seed(cfg.run.seed)
    n = cfg.optim.batch_size * cfg.horovod.batches_per_allreduce
    images = torch.rand(n, info.in_channels, info.image_size, info.image_size, generator=gen)
    labels = torch.randint(0, info.num_classes, (n,), generator=gen)
    if cfg.model.channels_last:  # as an input pipeline would deliver it; the model would convert it every step
        images = images.contiguous(memory_format=torch.channels_last)
    return images.to(device), labels.to(device)


def time_iterations(model, task, optimizer, scheduler, batch, device, *, warmup, iters, batches_per_iter, **step):
    """Images/s of each timed iteration on this rank: `warmup` untimed steps, then `iters` timed runs of
    `batches_per_iter` steps through engine.train_one_epoch (**step: accumulate, amp, scaler, clip_grad, log_every).
    """
    images = batch[0]
    if warmup:
        engine.train_one_epoch(model, task, [batch] * warmup, optimizer, scheduler, device, **step)
    rates = []
    for _ in range(iters):
        start = time.perf_counter()
        engine.train_one_epoch(model, task, [batch] * batches_per_iter, optimizer, scheduler, device, **step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the last kernels belong to this iteration's time
        rates.append(images.shape[0] * batches_per_iter / (time.perf_counter() - start))
    return rates


def summarize(rates_by_rank):
    """Per-rank images/s as mean and 1.96 x standard deviation over every rank's iterations (the spread of
    Horovod's benchmark), and the total: the sum of the ranks' own means."""
    flat = [r for rates in rates_by_rank for r in rates]
    per_rank = statistics.fmean(flat)
    ci95 = 1.96 * statistics.pstdev(flat) if len(flat) > 1 else 0.0
    total = sum(statistics.fmean(rates) for rates in rates_by_rank)
    return {"img_per_sec_per_rank": per_rank, "img_per_sec_per_rank_ci95": ci95, "img_per_sec_total": total,
            "img_per_sec_total_ci95": ci95 * len(rates_by_rank)}


def claim_benchmark_dir(output_dir, overwrite):
    """A benchmark writes summary.json: it may replace an earlier benchmark's, never a training run's."""
    summary = read_json_or_none(os.path.join(output_dir, "summary.json"))
    holds_run = os.path.exists(os.path.join(output_dir, "checkpoints")) or (
        summary is not None and summary.get("mode") != "benchmark")
    if holds_run and not overwrite:
        raise CheckpointError(f"{output_dir} holds a training run; give the benchmark another --output-dir, or "
                              f"replace the run with --overwrite")


def run_benchmark(cfg, rt):
    """Time the training step on every rank; rank 0 prints the figures and writes summary.json."""
    channels, classes = cfg.data.synthetic_channels, cfg.data.synthetic_classes
    # Without --image-size: ImageNet-sized images for torchvision models (as in Horovod's benchmark), MNIST-sized
    # ones for the small models made for those.
    size = cfg.data.image_size or (DATASETS["mnist"][2] if cfg.model.name in SMALL_MODELS else DATASETS["synthetic"][2])
    info = DataInfo(channels, classes, size, 0, 0)
    hvd_utils.decide_on_root(lambda: claim_benchmark_dir(cfg.run.output_dir, cfg.run.overwrite), "output_dir")
    task = TASKS[model_task(cfg.model.name)]
    model = build_model_on(cfg, info, rt.device)
    optimizer, lr_scale, lr = build_distributed_optimizer(cfg, model, rt.size)
    b = cfg.benchmark
    scheduler = engine.make_scheduler(optimizer, cfg.optim, b.num_warmup_batches + b.num_iters * b.num_batches_per_iter,
                                      lr_scale)
    scaler = torch.amp.GradScaler("cuda") if cfg.optim.amp == "fp16" else None
    hvd_utils.broadcast_state(model, optimizer, root_rank=0)
    log.info("benchmark: model %s, %dx%dx%d images, batch %d per rank x %d rank(s), %d warm-up steps, %d "
             "iterations of %d steps; device %s, %d CPU thread(s) per rank, controller %s, amp %s%s", cfg.model.name,
             channels, info.image_size, info.image_size, cfg.optim.batch_size, rt.size, b.num_warmup_batches,
             b.num_iters, b.num_batches_per_iter, rt.device, rt.threads, rt.controller, cfg.optim.amp,
             ", channels-last" if cfg.model.channels_last else "")

    rates = time_iterations(model, task, optimizer, scheduler, synthetic_batch(cfg, info, rt.device), rt.device,
                            warmup=b.num_warmup_batches, iters=b.num_iters, batches_per_iter=b.num_batches_per_iter,
                            accumulate=cfg.horovod.batches_per_allreduce, amp=cfg.optim.amp, scaler=scaler,
                            clip_grad=cfg.optim.clip_grad, log_every=cfg.logging.log_every)
    rates_by_rank = hvd_utils.gather_floats(rates, name="benchmark_rates")  # a collective: every rank
    if not all(math.isfinite(r) for rs in rates_by_rank for r in rs):
        raise engine.NonFiniteLossError("benchmark timings are not finite")
    figures = summarize(rates_by_rank)
    if rt.is_main:
        for i, rate in enumerate(rates_by_rank[0]):
            log.info("iter #%d: %.1f img/sec per rank (rank 0)", i, rate)
        log.info("img/sec per rank: %.1f +-%.1f", figures["img_per_sec_per_rank"],
                 figures["img_per_sec_per_rank_ci95"])
        log.info("total img/sec on %d rank(s): %.1f +-%.1f", rt.size, figures["img_per_sec_total"],
                 figures["img_per_sec_total_ci95"])
        os.makedirs(cfg.run.output_dir, exist_ok=True)
        write_json(os.path.join(cfg.run.output_dir, "summary.json"), {
            "mode": "benchmark", "config_name": cfg.run.name or "default", "model": cfg.model.name,
            "image_size": info.image_size, "channels": channels, "batch_size_per_rank": cfg.optim.batch_size,
            "batches_per_allreduce": cfg.horovod.batches_per_allreduce, "world_size": rt.size,
            "local_size": rt.local_size, "device": str(rt.device), "threads_per_rank": rt.threads,
            "controller": rt.controller, "tensor_ops": rt.tensor_ops, "amp": cfg.optim.amp,
            "channels_last": is_channels_last(model),  # the weights' layout as trained, not just the setting
            "fusion_threshold_mb": rt.fusion_threshold_mb, "cycle_time_ms": rt.cycle_time_ms,
            "fp16_allreduce": cfg.horovod.fp16_allreduce, "num_warmup_batches": b.num_warmup_batches,
            "num_iters": b.num_iters, "num_batches_per_iter": b.num_batches_per_iter, **figures,
            "img_per_sec_by_rank": rates_by_rank, "wall_seconds": seconds_since_start(), "config": cfg.to_dict()})
    return 0
