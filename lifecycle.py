"""Around the training loop: checks before a run starts, what happens after each epoch, and how a run ends.

train_hvd.py calls these in order; they hold no state of their own.
"""
import logging
import os

import torch

import engine
import hvd_utils
from checkpoint import VERSION
from config import ConfigError
from data import DATASETS, build_datasets, download_fn
from models import MODELS, build_model, model_names, to_channels_last
from reporting import build_summary, seconds_since_start, write_json
from tasks import improved, reached

log = logging.getLogger("hvd_train")


def check_choices(cfg):
    """Unknown names and impossible combinations fail here, before any rank starts Horovod."""
    # The built-in models first: naming one must not need torchvision (a site's own torch may come without it).
    if cfg.model.name not in MODELS and cfg.model.name not in model_names():
        raise ConfigError(f"--model={cfg.model.name!r} is not known; choose small_cnn, vae or a torchvision "
                          f"classification model ({', '.join(model_names()[2:8])}, ...)")
    if cfg.data.dataset not in DATASETS:
        raise ConfigError(f"--dataset={cfg.data.dataset!r} is not known; choose one of: {', '.join(DATASETS)}")
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no GPU is visible to this process (torch.cuda.is_available() is False); "
                          "check CUDA_VISIBLE_DEVICES and the driver, or use --device cpu")
    if cfg.optim.amp == "fp16" and not torch.cuda.is_available():
        raise ConfigError("--amp fp16 needs a GPU (no CUDA device is visible); use --amp bf16 on the CPU")
    if cfg.horovod.sync_bn and not torch.cuda.is_available():
        raise ConfigError("--sync-bn needs GPUs: Horovod's SyncBatchNorm works on CUDA tensors only (no CUDA "
                          "device is visible). On the CPU, leave it off: BatchNorm statistics are averaged over "
                          "the ranks after every epoch anyway")


def check_shards(num_train, world_size, batch_per_step):
    """Every rank needs samples of its own, and at least one full batch of them."""
    if num_train < world_size:
        raise ConfigError(f"{num_train} training sample(s) cannot be shared by {world_size} ranks: use fewer ranks "
                          f"or more data")
    shard = -(-num_train // world_size)  # DistributedSampler's shard size, padding included
    if batch_per_step > shard:
        raise ConfigError(f"a step takes {batch_per_step} samples per rank (--batch-size x --batches-per-allreduce) "
                          f"but each of the {world_size} ranks holds only {shard} of the {num_train} training "
                          f"samples; lower --batch-size or use fewer ranks")


def build_model_on(cfg, info, device):
    """The configured model for info's images, on `device` (with hvd.SyncBatchNorm layers under --sync-bn, laid
    out channels-last under --channels-last)."""
    try:
        model = build_model(cfg.model.name, info.in_channels, info.num_classes, info.image_size)
    except ValueError as e:  # e.g. an image size the model cannot take: a setting to change, not a crash
        raise ConfigError(str(e)) from None
    if cfg.horovod.sync_bn:
        model = hvd_utils.sync_batch_norm(model)
    if cfg.model.channels_last:
        try:
            model = to_channels_last(model)
        except ValueError as e:
            raise ConfigError(f"model.channels_last (--channels-last): {cfg.model.name}: {e}; leave it off") from None
    return model.to(device)  # keeps the weights' layout


def build_distributed_optimizer(cfg, model, world_size):
    """(optimizer, lr scale, scaled lr): the configured optimizer at the scaled rate, wrapped by Horovod."""
    lr_scale = hvd_utils.lr_scale(world_size, cfg.horovod.batches_per_allreduce, cfg.horovod.use_adasum)
    lr = cfg.optim.lr * lr_scale
    optimizer = engine.build_optimizer(model, cfg.optim, lr)
    # One process that stays one (not elastic) has nothing to average: unwrapped, its steps skip a round trip
    # through Horovod's background thread per step (bench/NOTES.md).
    if world_size > 1 or cfg.horovod.elastic:
        optimizer = hvd_utils.distributed_optimizer(
            optimizer, model, batches_per_allreduce=cfg.horovod.batches_per_allreduce,
            fp16_allreduce=cfg.horovod.fp16_allreduce, use_adasum=cfg.horovod.use_adasum,
            gradient_predivide_factor=cfg.horovod.gradient_predivide_factor)
    return optimizer, lr_scale, lr


def prepare_data(cfg):
    if cfg.data.download and download_fn(cfg.data.dataset) is not None:
        # Horovod: one download per host, into the shared --data-dir; the other ranks on the host wait for it.
        hvd_utils.run_on_local_root(lambda: download_fn(cfg.data.dataset)(cfg.data.data_dir),
                                    f"downloading {cfg.data.dataset}")
    return build_datasets(cfg.data)


def epoch_end_handler(cfg, task, model, optimizer, scheduler, scaler, state, fits, checkpointer, reporter,
                      world_size, steps_done):
    """What happens after each epoch on every rank: history and best metric, reports, and the checkpoint.
    Returns true when the --stop-at target is reached, which ends training after this epoch."""
    def on_epoch_end(epoch, record):
        record["wall_seconds"] = seconds_since_start()  # time to accuracy, counted from process start
        if state["history"] and state["history"][-1]["epoch"] >= epoch:
            forget_from(task, state, epoch)
        state["history"].append(record)
        better = improved(task, record[task.best_metric], state["best_metric"])
        if better:
            state["best_metric"], state["best_epoch"] = record[task.best_metric], epoch
        stop = reached(task, record[task.best_metric], cfg.run.stop_at)
        if stop:
            state["stopped_at"] = epoch
            log.info("--stop-at %g: %s reached %.4g at epoch %d; stopping", cfg.run.stop_at, task.best_metric,
                     record[task.best_metric], epoch)
        reporter.epoch(record)
        if epoch % cfg.checkpoint.every_epochs == 0 or epoch == cfg.optim.epochs or stop:
            rng = hvd_utils.gather_rng_states()  # a collective: every rank, every checkpoint
            checkpointer.save({
                "version": VERSION, "epoch": epoch, "step": steps_done(), "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler else None,
                "scaler": scaler.state_dict() if scaler else None, "best_metric": state["best_metric"],
                "best_epoch": state["best_epoch"], "history": state["history"], "config": cfg.to_dict(),
                "world_size": world_size(), "rng": rng, **fits}, epoch, is_best=better)
        return stop
    return on_epoch_end


def forget_from(task, state, epoch):
    """Drops the records of `epoch` and later, and the best metric among them. An elastic reset rolls training back
    to its last commit, which may lie before the end of an epoch that was already closed: that epoch ends again."""
    state["history"] = [h for h in state["history"] if h["epoch"] < epoch]
    if state["best_epoch"] is not None and state["best_epoch"] >= epoch:
        state["best_metric"] = state["best_epoch"] = None
        for h in state["history"]:
            if improved(task, h[task.best_metric], state["best_metric"]):
                state["best_metric"], state["best_epoch"] = h[task.best_metric], h["epoch"]


def log_setup(cfg, rt, info, task, model, lr_scale, lr, resumed_epoch):
    """The batch and learning-rate arithmetic, and who is running where: the first thing to check in a log."""
    accumulate = cfg.horovod.batches_per_allreduce
    log.info("hvd-train %s: %d rank(s), %d per host, device %s, %d CPU thread(s) per rank, controller %s, "
             "tensor ops %s, fusion %g MB, cycle %g ms", cfg.run.name or "default", rt.size, rt.local_size,
             rt.device, rt.threads, rt.controller, rt.tensor_ops, rt.fusion_threshold_mb, rt.cycle_time_ms)
    log.info("data %s: %d train / %d val samples of %dx%dx%d; model %s (%s, %.2fM parameters)", cfg.data.dataset,
             info.num_train, info.num_val, info.in_channels, info.image_size, info.image_size, cfg.model.name,
             task.name, sum(p.numel() for p in model.parameters()) / 1e6)
    log.info("batch %d per rank x %d ranks x %d per allreduce = %d global; lr %g base x %d = %g, %s schedule, "
             "%g warmup epochs; amp %s%s%s", cfg.optim.batch_size, rt.size, accumulate,
             cfg.optim.batch_size * rt.size * accumulate, cfg.optim.lr, lr_scale, lr, cfg.optim.lr_schedule,
             cfg.optim.warmup_epochs, cfg.optim.amp, ", channels-last" if cfg.model.channels_last else "",
             f"; resuming after epoch {resumed_epoch}" if resumed_epoch else "")


def evaluate_only(cfg, rt, model, task, val_loader, path, fits):
    meta = hvd_utils.load_weights(path, model, fits)
    metrics = engine.evaluate_all(model, task, val_loader, rt.device, cfg.optim.amp)
    log.info("evaluated %s (epoch %d) on %d samples: %s", path, meta["epoch"], metrics["count"],
             "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "count"))
    if rt.is_main:
        os.makedirs(cfg.run.output_dir, exist_ok=True)
        write_json(os.path.join(cfg.run.output_dir, "evaluation.json"),
                   {"checkpoint": path, "epoch": meta["epoch"], "world_size": rt.size, **metrics})
    return 0


def finish(cfg, rt, model, task, state, lr, reporter):
    # Every rank must end with the same weights; a difference means gradients were not averaged.
    fingerprints = hvd_utils.fingerprints_by_rank(model)
    if rt.is_main:
        summary = build_summary(cfg, rt, task, state, lr, fingerprints)
        summary["curves_png"] = (reporter.plot(state["history"], os.path.join(cfg.run.output_dir, "curves.png"))
                                 if cfg.logging.plot else None)
        write_json(os.path.join(cfg.run.output_dir, "summary.json"), summary)
        log.info("done: best %s %.4g (epoch %s), %.0f train samples/s, %.1fs wall; summary in %s",
                 task.best_metric, state["best_metric"], state["best_epoch"], summary["train_samples_per_sec"],
                 summary["wall_seconds"], os.path.join(cfg.run.output_dir, "summary.json"))
    if len(set(fingerprints)) != 1:
        log.error("ranks ended with different parameters (fingerprints %s): gradients were not averaged",
                  fingerprints)
        return 1
    return 0
