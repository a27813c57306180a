"""`train_hvd.py --benchmark`: images/s of the app's own training step on a synthetic batch held in memory.

What Horovod's pytorch_synthetic_benchmark.py measures, through the code that trains: the same model, optimizer,
Horovod wrapper, learning-rate schedule, metric sums and non-finite checks as a real run (train_one_epoch, in
hvd_train/trainer.py), fed one random batch again and again so that no input pipeline is timed. Warm-up steps
first, then num_iters timed iterations of num_batches_per_iter steps; each rank times its own, and rank 0 reports
every rank's figures.
"""
import logging
import math
import os
import statistics
import time
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
from torch.utils.data import default_collate

import hvd_utils
from hvd_train import training
from hvd_train.data import DataInfo, is_streamed, native_size
from hvd_train.errors import ConfigError, NonFiniteLossError
from hvd_train.files import write_json
from hvd_train.models import MODELS as SMALL_MODELS
from hvd_train.models import is_channels_last
from hvd_train.provenance import is_import_path
from hvd_train.run.directory import RunDir
from hvd_train.run.reports import JobFacts, peak_rss_bytes, seconds_since_start
from hvd_train.tasks import samples_in
from hvd_train.trainer import Feed, Hooks, batching, image_figures, train_one_epoch
from hvd_train.training import attach_profiler, prepare_data

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from hvd_train.config import BenchmarkConfig, Config
    from hvd_train.trainer import Batching, Trainer

log = logging.getLogger("hvd_train")


def samples_batch(train_set: "Dataset", info: DataInfo, device: torch.device, n: int) -> Any:
    """One batch of the data set's own first `n` samples (cycled where it has fewer), collated as the loader
    collates them, held on the device as the feed hands batches to the model: a user's task may take any sample
    structure (dicts, nested), which only its data has."""
    return Feed(device, *image_figures(info))(default_collate([train_set[i % len(train_set)] for i in range(n)]))


def uses_own_data(cfg: "Config") -> bool:
    """A user's task or data set: its batches are timed as its data makes them, not as random images."""
    return is_import_path(cfg.model.task) or is_import_path(cfg.data.dataset)


def synthetic_batch(cfg: "Config", info: DataInfo, device: torch.device, n: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One random batch per step of `n` samples (the per-rank batch x batches_per_allreduce), made once, on the
    device."""
    gen = torch.Generator().manual_seed(cfg.run.seed)
    images = torch.rand(n, info.in_channels, info.image_size, info.image_size, generator=gen)
    labels = torch.randint(0, info.num_classes, (n,), generator=gen)
    if cfg.model.channels_last:  # as an input pipeline would deliver it; the model would convert it every step
        images = images.contiguous(memory_format=torch.channels_last)
    return images.to(device), labels.to(device)


class _AtStart(Hooks):
    """The rate of the schedule's first step, at every step: a benchmark times steps, it does not train."""

    def position(self, epoch: int, step: int, steps: int) -> float:
        return 0.0


def time_iterations(trainer: "Trainer", batch: Any, b: "BenchmarkConfig") -> tuple[Optional[float], list[float]]:
    """(seconds of the first step, images/s of each timed iteration) on this rank: b.num_warmup_batches steps
    outside the timed ones (the first timed alone: it holds torch.compile's compilation), then b.num_iters timed
    runs of b.num_batches_per_iter steps through train_one_epoch (hvd_train/trainer.py). No warm-up: no first-step
    time (None)."""
    samples, hooks = samples_in(batch), _AtStart()
    first_step_seconds = None
    if b.num_warmup_batches:
        start = time.perf_counter()
        train_one_epoch(trainer, [batch], 1, hooks)
        first_step_seconds = time.perf_counter() - start
    if b.num_warmup_batches > 1:
        train_one_epoch(trainer, [batch] * (b.num_warmup_batches - 1), 1, hooks)
    rates = []
    for _ in range(b.num_iters):
        start = time.perf_counter()
        train_one_epoch(trainer, [batch] * b.num_batches_per_iter, 1, hooks)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)  # the last kernels belong to this iteration's time
        rates.append(samples * b.num_batches_per_iter / (time.perf_counter() - start))
    return first_step_seconds, rates


def summarize(rates_by_rank: list[list[float]]) -> dict[str, float]:
    """Per-rank images/s as mean and 1.96 x standard deviation over every rank's iterations (the spread of
    Horovod's benchmark), and the total: the sum of the ranks' own means."""
    flat = [r for rates in rates_by_rank for r in rates]
    per_rank = statistics.fmean(flat)
    ci95 = 1.96 * statistics.pstdev(flat) if len(flat) > 1 else 0.0
    total = sum(statistics.fmean(rates) for rates in rates_by_rank)
    return {"img_per_sec_per_rank": per_rank, "img_per_sec_per_rank_ci95": ci95, "img_per_sec_total": total,
            "img_per_sec_total_ci95": ci95 * len(rates_by_rank)}


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far: the GPU's allocations on a GPU, else the resident set's high-water mark."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_bytes()


def build_trainer(cfg: "Config", info: DataInfo, rt: hvd_utils.Runtime) -> "Trainer":
    """The Trainer of a training run, built by the recipe's steps (train_hvd.py), Horovod's optimizer included."""
    model, task = training.model_and_task(cfg, info, rt.device)
    scaled = batching(cfg, rt.size)  # made once: the optimizer's rate, then the Trainer's
    optimizer = training.optimizer(cfg, model, lr=scaled.lr)
    optimizer = hvd_utils.distributed_optimizer(optimizer, model, training.wire_options(cfg))
    return training.trainer(cfg, info, rt, model, task, optimizer, scaled)


def run(cfg: "Config", rt: hvd_utils.Runtime) -> int:
    """Time the training step on every rank; rank 0 prints the figures and writes summary.json."""
    channels: Optional[int]  # a data set of the user's may not say
    channels, classes = cfg.data.synthetic_channels, cfg.data.synthetic_classes
    # Without --image-size: ImageNet-sized images for torchvision models (as in Horovod's benchmark), MNIST-sized
    # ones for the small models made for those.
    native = native_size("mnist" if cfg.model.name in SMALL_MODELS else "synthetic")
    size = cfg.data.image_size or native
    info = DataInfo(channels, classes, size, 0, 0)
    if uses_own_data(cfg):
        train_set, _, info = prepare_data(cfg)
        if is_streamed(train_set):
            raise ConfigError("--benchmark times a batch held in memory: with --dataset shards, leave out --task, "
                              "or benchmark your data set's own factory")
        channels = info.in_channels
    run_dir = RunDir(cfg.run.output_dir)
    hvd_utils.decide_on_root(lambda: run_dir.acquire_for_benchmark(cfg.run.overwrite), "output_dir")
    trainer = build_trainer(cfg, info, rt)
    attach_profiler(trainer, cfg, rt, run_dir)
    trainer.opts.show_progress = False  # steps are timed: no bar
    hvd_utils.broadcast_state(trainer.model, trainer.optimizer, root_rank=0)
    b = cfg.benchmark
    # --powersgd-rank: from its start step (10% of the timed and warm-up steps unless given)
    hvd_utils.prepare_compression(trainer.optimizer, trainer.scaler,
                                  b.num_warmup_batches + b.num_iters * b.num_batches_per_iter)
    inputs = f"{cfg.data.dataset}'s samples" if uses_own_data(cfg) else \
        f"{channels}x{info.image_size}x{info.image_size} images"
    log.info("benchmark: model %s, %s, batch %d per rank x %d rank(s), %d warm-up steps, %d "
             "iterations of %d steps; device %s, %d CPU thread(s) per rank, controller %s, amp %s%s%s", cfg.model.name,
             inputs, cfg.optim.batch_size, rt.size, b.num_warmup_batches,
             b.num_iters, b.num_batches_per_iter, rt.device, rt.threads, rt.controller, cfg.optim.amp,
             ", channels-last" if cfg.model.channels_last else "",
             f", torch.compile mode {cfg.model.compile_mode}" if cfg.model.compile else "")

    own = uses_own_data(cfg)
    n = cast("Batching", trainer.batching).per_rank  # (build_trainer sets it)
    batch = samples_batch(train_set, info, rt.device, n) if own else synthetic_batch(cfg, info, rt.device, n)
    first_step_seconds, rates = time_iterations(trainer, batch, b)
    if trainer.profiler is not None:
        trainer.profiler.close()
    rates_by_rank = hvd_utils.gather_floats(rates, name="benchmark_rates")  # a collective: every rank
    if not all(math.isfinite(r) for rs in rates_by_rank for r in rs):
        raise NonFiniteLossError("benchmark timings are not finite")
    figures = summarize(rates_by_rank)
    # What each rank holds: its optimizer state (1/N of it under --shard-optimizer), and its peak memory.
    held = hvd_utils.gather_floats([hvd_utils.optimizer_state_bytes(trainer.optimizer), peak_memory_bytes(rt.device)],
                                   name="benchmark_memory")
    if rt.is_main:
        for i, rate in enumerate(rates_by_rank[0]):
            log.info("iter #%d: %.1f img/sec per rank (rank 0)", i, rate)
        if first_step_seconds is not None:
            log.info("first step: %.2f s%s", first_step_seconds, " (torch.compile compiles the model in it)"
                     if cfg.model.compile else "")
        log.info("img/sec per rank: %.1f +-%.1f", figures["img_per_sec_per_rank"],
                 figures["img_per_sec_per_rank_ci95"])
        log.info("total img/sec on %d rank(s): %.1f +-%.1f", rt.size, figures["img_per_sec_total"],
                 figures["img_per_sec_total_ci95"])
        os.makedirs(run_dir.root, exist_ok=True)
        write_json(run_dir.summary, {
            "mode": "benchmark", **JobFacts.of(cfg, rt).as_dict(), "image_size": info.image_size, "channels": channels,
            "batches_per_allreduce": cfg.horovod.batches_per_allreduce, "amp": cfg.optim.amp,
            "channels_last": is_channels_last(trainer.model),  # the weights' layout as trained, not just the setting
            "fp16_allreduce": cfg.horovod.fp16_allreduce, "bf16_allreduce": cfg.horovod.bf16_allreduce,
            "optimizer": cfg.optim.optimizer,
            "shard_optimizer": cfg.horovod.shard_optimizer,
            "parameters": sum(p.numel() for p in trainer.model.parameters()),
            "optimizer_state_bytes_by_rank": [int(h[0]) for h in held],
            "peak_memory_bytes_by_rank": [int(h[1]) for h in held],
            "first_step_seconds": first_step_seconds, "num_warmup_batches": b.num_warmup_batches,
            "num_iters": b.num_iters, "num_batches_per_iter": b.num_batches_per_iter, **figures,
            "img_per_sec_by_rank": rates_by_rank, "wall_seconds": seconds_since_start(), "config": cfg.to_dict()})
    return 0
