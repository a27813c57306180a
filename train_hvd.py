"""hvd-train: data-parallel PyTorch training with Horovod.

Launch (every setting has a default, so each of these trains the small CNN on scikit-learn's digits):

    python train_hvd.py                                          # one process
    horovodrun -np 2 -H localhost:2 python train_hvd.py          # 2 ranks on this machine
    horovodrun -np 8 -H host1:4,host2:4 python train_hvd.py      # 2 hosts, 4 ranks (GPUs) each
    horovodrun -np 8 -hostfile hostfiles/example.txt python train_hvd.py
    mpirun -np 8 -H host1:4,host2:4 -bind-to none -map-by slot -x PATH -x LD_LIBRARY_PATH python train_hvd.py

Recipes and overrides: `python train_hvd.py --config configs/cifar10_resnet18.yaml --epochs 5 --amp bf16`.
Continue a run: `--resume auto`; evaluate a checkpoint: `--evaluate --resume runs/x/checkpoints/best.pt`.
All settings: `python train_hvd.py --help`. Rank 0 prints and writes everything in --output-dir.
"""
import logging
import os
import sys

import torch

import engine
import hvd_utils
from checkpoint import VERSION, Checkpointer, CheckpointError, resolve
from config import ConfigError, parse_config
from data import DATASETS, DataError, build_datasets, build_loaders, download_fn
from models import build_model, model_names, model_task
from reporting import Reporter, build_summary, write_json
from tasks import TASKS, improved

log = logging.getLogger("hvd_train")


def setup_logging(is_main):
    # Only rank 0 speaks; the others report warnings and errors only.
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, format="%(message)s", stream=sys.stdout)


def check_choices(cfg):
    """Unknown names and impossible combinations fail here, before any rank starts Horovod."""
    if cfg.model.name not in model_names():
        raise ConfigError(f"--model={cfg.model.name!r} is not known; choose small_cnn, vae or a torchvision "
                          f"classification model ({', '.join(model_names()[2:8])}, ...)")
    if cfg.data.dataset not in DATASETS:
        raise ConfigError(f"--dataset={cfg.data.dataset!r} is not known; choose one of: {', '.join(DATASETS)}")
    if cfg.optim.amp == "fp16" and not torch.cuda.is_available():
        raise ConfigError("--amp fp16 needs a GPU (no CUDA device is visible); use --amp bf16 on the CPU")
    if cfg.horovod.sync_bn and not torch.cuda.is_available():
        raise ConfigError("--sync-bn needs GPUs: Horovod's SyncBatchNorm works on CUDA tensors only (no CUDA "
                          "device is visible). On the CPU, leave it off: BatchNorm statistics are averaged over "
                          "the ranks after every epoch anyway")


def prepare_data(cfg):
    if cfg.data.download and download_fn(cfg.data.dataset) is not None:
        # Horovod: one download per host, into the shared --data-dir; the other ranks on the host wait for it.
        hvd_utils.run_on_local_root(lambda: download_fn(cfg.data.dataset)(cfg.data.data_dir),
                                    f"downloading {cfg.data.dataset}")
    return build_datasets(cfg.data)


def main(argv=None):
    cfg = parse_config(argv)
    check_choices(cfg)
    rt = hvd_utils.init()
    setup_logging(rt.is_main)
    torch.manual_seed(cfg.run.seed + rt.rank)  # different dropout per rank; the weights come from rank 0 below

    train_set, val_set, info = prepare_data(cfg)
    accumulate = cfg.horovod.batches_per_allreduce
    train_loader, val_loader, train_sampler = build_loaders(
        train_set, val_set, cfg.optim.batch_size * accumulate, rt.rank, rt.size, cfg.run.seed,
        workers=cfg.data.workers, pin_memory=rt.device.type == "cuda")
    task = TASKS[model_task(cfg.model.name)]
    try:
        model = build_model(cfg.model.name, info.in_channels, info.num_classes, info.image_size)
    except ValueError as e:  # e.g. an image size the model cannot take: a setting to change, not a crash
        raise ConfigError(str(e)) from None
    if cfg.horovod.sync_bn:
        model = hvd_utils.sync_batch_norm(model)
    model.to(rt.device)

    # Horovod: scale the learning rate with the global batch.
    lr_scale = hvd_utils.lr_scale(rt.size, accumulate, cfg.horovod.use_adasum)
    lr = cfg.optim.lr * lr_scale
    optimizer = hvd_utils.distributed_optimizer(
        engine.build_optimizer(model, cfg.optim, lr), model, batches_per_allreduce=accumulate,
        fp16_allreduce=cfg.horovod.fp16_allreduce, use_adasum=cfg.horovod.use_adasum,
        gradient_predivide_factor=cfg.horovod.gradient_predivide_factor)
    scheduler = engine.make_scheduler(optimizer, cfg.optim, len(train_loader), lr_scale)
    scaler = torch.amp.GradScaler("cuda") if cfg.optim.amp == "fp16" else None

    ckpt_dir = os.path.join(cfg.run.output_dir, "checkpoints")
    fits = {"model_name": cfg.model.name, "task": task.name, "num_classes": info.num_classes}
    state = {"epoch": 0, "best_metric": None, "best_epoch": None, "history": []}
    if cfg.run.evaluate:
        return evaluate_only(cfg, rt, model, task, val_loader, resolve_everywhere(cfg, ckpt_dir), fits)
    if cfg.checkpoint.resume:
        state = hvd_utils.restore(resolve_everywhere(cfg, ckpt_dir), model, optimizer, scheduler, scaler, fits)
    hvd_utils.broadcast_state(model, optimizer, root_rank=0)

    log_setup(cfg, rt, info, task, model, lr_scale, lr, state["epoch"])

    checkpointer = Checkpointer(ckpt_dir, cfg.checkpoint.keep_last, enabled=rt.is_main)
    reporter = Reporter(cfg.run.output_dir, rt.is_main, cfg.logging.tensorboard, resume=bool(cfg.checkpoint.resume))
    if rt.is_main:
        write_json(os.path.join(cfg.run.output_dir, "config.json"), cfg.to_dict())

    def on_epoch_end(epoch, record):
        state["history"].append(record)
        better = improved(task, record[task.best_metric], state["best_metric"])
        if better:
            state["best_metric"], state["best_epoch"] = record[task.best_metric], epoch
        reporter.epoch(record)
        if epoch % cfg.checkpoint.every_epochs == 0 or epoch == cfg.optim.epochs:
            rng = hvd_utils.gather_rng_states()  # a collective: every rank, every checkpoint
            checkpointer.save({
                "version": VERSION, "epoch": epoch, "step": epoch * len(train_loader), "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler else None, "best_metric": state["best_metric"],
                "best_epoch": state["best_epoch"], "history": state["history"], "config": cfg.to_dict(),
                "world_size": rt.size, "rng": rng, **fits}, epoch, is_best=better)

    try:
        engine.fit(model, task, optimizer, scheduler, train_loader, val_loader, train_sampler, rt.device,
                   epochs=cfg.optim.epochs, start_epoch=state["epoch"] + 1, accumulate=accumulate,
                   amp=cfg.optim.amp, scaler=scaler, clip_grad=cfg.optim.clip_grad,
                   log_every=cfg.logging.log_every, show_progress=rt.is_main and cfg.logging.progress,
                   progress_every=cfg.logging.progress_every, on_epoch_end=on_epoch_end)
    finally:
        reporter.close()
    return finish(cfg, rt, model, task, state, lr, reporter)


def log_setup(cfg, rt, info, task, model, lr_scale, lr, resumed_epoch):
    """The batch and learning-rate arithmetic, and who is running where: the first thing to check in a log."""
    accumulate = cfg.horovod.batches_per_allreduce
    log.info("hvd-train %s: %d rank(s), %d per host, device %s, %d CPU thread(s) per rank, controller %s, "
             "tensor ops %s", cfg.run.name or "default", rt.size, rt.local_size, rt.device, rt.threads,
             rt.controller, rt.tensor_ops)
    log.info("data %s: %d train / %d val samples of %dx%dx%d; model %s (%s, %.2fM parameters)", cfg.data.dataset,
             info.num_train, info.num_val, info.in_channels, info.image_size, info.image_size, cfg.model.name,
             task.name, sum(p.numel() for p in model.parameters()) / 1e6)
    log.info("batch %d per rank x %d ranks x %d per allreduce = %d global; lr %g base x %d = %g, %s schedule, "
             "%g warmup epochs; amp %s%s", cfg.optim.batch_size, rt.size, accumulate,
             cfg.optim.batch_size * rt.size * accumulate, cfg.optim.lr, lr_scale, lr, cfg.optim.lr_schedule,
             cfg.optim.warmup_epochs, cfg.optim.amp, f"; resuming after epoch {resumed_epoch}" if resumed_epoch
             else "")


def resolve_everywhere(cfg, ckpt_dir):
    # Every rank resolves the same path from the same arguments; only rank 0 will read the file.
    return resolve(cfg.checkpoint.resume, ckpt_dir)


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


def cli():
    code = 1
    try:
        code = main()
    except (ConfigError, DataError, CheckpointError, engine.NonFiniteLossError) as e:
        # Raised on every rank at the same point (checked on all, or sent from rank 0), so none waits on another;
        # rank 0 alone says it. Exit 2: a setting or a file to fix; 3: the training diverged.
        if hvd_utils.launcher_rank() == 0:
            print(f"train_hvd.py: error: {e}", file=sys.stderr)
        code = 3 if isinstance(e, engine.NonFiniteLossError) else 2
    finally:
        hvd_utils.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    cli()
