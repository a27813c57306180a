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
import dataclasses
import logging
import os
import sys
import traceback

import torch

import engine
import hvd_utils
from hvd_utils import elastic
from checkpoint import VERSION, Checkpointer, CheckpointError, claim_output_dir, resolve
from config import ConfigError, parse_config
from data import DATASETS, BadSampleError, DataError, build_datasets, build_loaders, download_fn
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


def prepare_data(cfg):
    if cfg.data.download and download_fn(cfg.data.dataset) is not None:
        # Horovod: one download per host, into the shared --data-dir; the other ranks on the host wait for it.
        hvd_utils.run_on_local_root(lambda: download_fn(cfg.data.dataset)(cfg.data.data_dir),
                                    f"downloading {cfg.data.dataset}")
    return build_datasets(cfg.data)


def main(argv=None):
    cfg = parse_config(argv)
    check_choices(cfg)
    rt = hvd_utils.init(cpu=cfg.run.device == "cpu")
    setup_logging(rt.is_main)
    torch.manual_seed(cfg.run.seed + rt.rank)  # different dropout per rank; the weights come from rank 0 below

    train_set, val_set, info = prepare_data(cfg)
    accumulate = cfg.horovod.batches_per_allreduce
    check_shards(info.num_train, rt.size, cfg.optim.batch_size * accumulate)
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
    if cfg.horovod.elastic and not cfg.run.evaluate:
        return train_elastic(cfg, rt, train_set, val_set, info, model, task, optimizer, scaler, fits, state)
    if cfg.run.evaluate:
        path = hvd_utils.decide_on_root(lambda: resolve(cfg.checkpoint.resume, ckpt_dir), "evaluate")
        if path is None:
            raise CheckpointError(f"--evaluate --resume auto: no checkpoint in {ckpt_dir} to evaluate")
        return evaluate_only(cfg, rt, model, task, val_loader, path, fits)
    # Rank 0 looks at the output directory: continue, replace or refuse, so an earlier run is never clobbered.
    resume_from = hvd_utils.decide_on_root(
        lambda: claim_output_dir(cfg.run.output_dir, cfg.checkpoint.resume, cfg.run.overwrite), "output_dir")
    if resume_from:
        state = hvd_utils.restore(resume_from, model, optimizer, scheduler, scaler, fits, len(train_loader))
    elif cfg.checkpoint.resume:
        log.info("--resume auto: no checkpoint in %s yet, starting afresh", ckpt_dir)
    hvd_utils.broadcast_state(model, optimizer, root_rank=0)

    log_setup(cfg, rt, info, task, model, lr_scale, lr, state["epoch"])

    checkpointer = Checkpointer(ckpt_dir, cfg.checkpoint.keep_last, enabled=rt.is_main)
    reporter = Reporter(cfg.run.output_dir, rt.is_main, cfg.logging.tensorboard, resume=bool(resume_from))
    if rt.is_main:
        write_json(os.path.join(cfg.run.output_dir, "config.json"), cfg.to_dict())

    on_epoch_end = epoch_end_handler(cfg, task, model, optimizer, scheduler, scaler, state, fits, checkpointer,
                                     reporter, world_size=lambda: rt.size, steps_done=lambda: scheduler.last_epoch)
    try:
        engine.fit(model, task, optimizer, scheduler, train_loader, val_loader, train_sampler, rt.device,
                   epochs=cfg.optim.epochs, start_epoch=state["epoch"] + 1, accumulate=accumulate,
                   amp=cfg.optim.amp, scaler=scaler, clip_grad=cfg.optim.clip_grad,
                   log_every=cfg.logging.log_every, show_progress=rt.is_main and cfg.logging.progress,
                   progress_every=cfg.logging.progress_every, on_epoch_end=on_epoch_end)
    finally:
        reporter.close()
    return finish(cfg, rt, model, task, state, lr, reporter)


def train_elastic(cfg, rt, train_set, val_set, info, model, task, optimizer, scaler, fits, state):
    """--elastic: the same training inside Horovod's elastic loop, for jobs whose workers come and go.

    Nothing here runs a collective before that loop: a worker that joins later starts this script while the others
    are inside the loop. The output directory is claimed, and a checkpoint loaded, inside it, once.
    """
    if not elastic.under_elastic_launcher():
        raise ConfigError("--elastic needs horovodrun's elastic mode: horovodrun -np N --min-np M --max-np K "
                          "--host-discovery-script hostfiles/discover_hosts.py python train_hvd.py --elastic")
    accumulate, batch = cfg.horovod.batches_per_allreduce, cfg.optim.batch_size * cfg.horovod.batches_per_allreduce
    sampler = elastic.sampler(train_set, cfg.run.seed)
    sampler.set_epoch(1)
    loader_args = dict(seed=cfg.run.seed, workers=cfg.data.workers, pin_memory=rt.device.type == "cuda",
                       train_sampler=sampler)
    train_loader = build_loaders(train_set, val_set, batch, rt.rank, rt.size, **loader_args)[0]
    ckpt_dir = os.path.join(cfg.run.output_dir, "checkpoints")
    progress = {"epoch": 1, "batch": 0, "resets": 0, "redone": 0}
    st = elastic.state(model, optimizer, sampler, epoch=1, batch=0, steps=0, claimed=False)
    checkpointer = Checkpointer(ckpt_dir, cfg.checkpoint.keep_last, enabled=False)
    reporter = Reporter(cfg.run.output_dir, False, cfg.logging.tensorboard)

    def lr_scale_now():
        return hvd_utils.lr_scale(elastic.world()[1], accumulate, cfg.horovod.use_adasum)

    def take_roles():
        # Rank 0 of the current workers writes; after a reset that may be another process than before.
        is_main = elastic.world()[0] == 0
        logging.getLogger().setLevel(logging.INFO if is_main else logging.WARNING)
        checkpointer.enabled = is_main
        reporter.set_enabled(is_main)

    def on_reset():
        if progress["epoch"] == st.epoch:
            progress["redone"] += progress["batch"] - st.batch
        progress["resets"] += 1
        take_roles()
        log.info("workers changed: now %d; continuing from epoch %d, step %d (the last commit)", elastic.world()[1],
                 st.epoch, st.batch)

    st.register_reset_callbacks([on_reset])
    on_epoch_end = epoch_end_handler(cfg, task, model, optimizer, None, scaler, state, fits, checkpointer, reporter,
                                     world_size=lambda: elastic.world()[1], steps_done=lambda: st.steps)

    def make_val_loader():
        rank, size, _ = elastic.world()
        return build_loaders(train_set, val_set, batch, rank, size, **loader_args)[1]

    @elastic.run
    def train(st):
        if not st.claimed:
            resume_from = hvd_utils.decide_on_root(
                lambda: claim_output_dir(cfg.run.output_dir, cfg.checkpoint.resume, cfg.run.overwrite), "output_dir")
            if resume_from:
                meta = hvd_utils.load_weights(resume_from, model, fits, optimizer=optimizer)  # rank 0 reads
                state.update({k: meta[k] for k in ("best_metric", "best_epoch", "history")})
                st.epoch, st.steps = meta["epoch"] + 1, meta["step"] or 0
                sampler.set_epoch(st.epoch)
            st.claimed = True
            take_roles()
            if elastic.world()[0] == 0:
                write_json(os.path.join(cfg.run.output_dir, "config.json"), cfg.to_dict())
            log_setup(cfg, rt, info, task, model, lr_scale_now(), cfg.optim.lr * lr_scale_now(), st.epoch - 1)
            st.commit()
        engine.fit_elastic(st, model, task, optimizer, train_loader, sampler, make_val_loader, rt.device,
                           optim_cfg=cfg.optim, lr_scale_fn=lr_scale_now, commit_every=cfg.horovod.commit_every,
                           progress=progress, accumulate=accumulate, amp=cfg.optim.amp, scaler=scaler,
                           clip_grad=cfg.optim.clip_grad, log_every=cfg.logging.log_every,
                           show_progress=cfg.logging.progress and elastic.world()[0] == 0,
                           progress_every=cfg.logging.progress_every, on_epoch_end=on_epoch_end)

    try:
        train(st)
    finally:
        reporter.close()
    rank, size, local_size = elastic.world()
    now = dataclasses.replace(rt, rank=rank, size=size, local_size=local_size)
    state["elastic"] = {"resets": progress["resets"], "steps_redone": progress["redone"],
                        "commit_every": cfg.horovod.commit_every, "steps": st.steps}
    return finish(cfg, now, model, task, state, cfg.optim.lr * lr_scale_now(), reporter)


def epoch_end_handler(cfg, task, model, optimizer, scheduler, scaler, state, fits, checkpointer, reporter,
                      world_size, steps_done):
    """What happens after each epoch on every rank: history and best metric, reports, and the checkpoint."""
    def on_epoch_end(epoch, record):
        state["history"].append(record)
        better = improved(task, record[task.best_metric], state["best_metric"])
        if better:
            state["best_metric"], state["best_epoch"] = record[task.best_metric], epoch
        reporter.epoch(record)
        if epoch % cfg.checkpoint.every_epochs == 0 or epoch == cfg.optim.epochs:
            rng = hvd_utils.gather_rng_states()  # a collective: every rank, every checkpoint
            checkpointer.save({
                "version": VERSION, "epoch": epoch, "step": steps_done(), "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler else None,
                "scaler": scaler.state_dict() if scaler else None, "best_metric": state["best_metric"],
                "best_epoch": state["best_epoch"], "history": state["history"], "config": cfg.to_dict(),
                "world_size": world_size(), "rng": rng, **fits}, epoch, is_best=better)
    return on_epoch_end


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
    except BadSampleError as e:
        # Met by this rank alone, mid-epoch: it names the file; the other ranks stop as their peer is gone.
        print(f"train_hvd.py: rank {hvd_utils.launcher_rank()}: error: {e}", file=sys.stderr)
        code = 2
    except hvd_utils.PeerFailure:
        # This rank was waiting in a collective when another one failed: that rank reports the cause.
        print(f"train_hvd.py: rank {hvd_utils.launcher_rank()}: stopping because another rank failed "
              f"(its error is reported above or by the launcher)", file=sys.stderr)
        code = 1
    except Exception:
        # A bug or a fault on this rank alone: its traceback, once, with the rank named.
        print(f"train_hvd.py: rank {hvd_utils.launcher_rank()} failed:\n{traceback.format_exc()}", file=sys.stderr)
        code = 1
    finally:
        hvd_utils.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    cli()
