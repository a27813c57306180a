"""hvd-train: data-parallel PyTorch training with Horovod.

Launch (every setting has a default, so each of these trains the small CNN on scikit-learn's digits):

    python train_hvd.py                                          # one process
    horovodrun -np 2 -H localhost:2 python train_hvd.py          # 2 ranks on this machine
    horovodrun -np 8 -H host1:4,host2:4 python train_hvd.py      # 2 hosts, 4 ranks (GPUs) each
    horovodrun -np 8 -hostfile hostfiles/example.txt python train_hvd.py
    mpirun -np 8 -H host1:4,host2:4 -bind-to none -map-by slot -x PATH -x LD_LIBRARY_PATH python train_hvd.py

Recipes and overrides: `python train_hvd.py --config configs/cifar10_resnet18.yaml --epochs 5 --amp bf16`.
Images/s on synthetic data, like Horovod's pytorch_synthetic_benchmark.py: `--benchmark --model resnet50`.
Continue a run: `--resume auto`; evaluate a checkpoint: `--evaluate --resume runs/x/checkpoints/best.pt`.
All settings: `python train_hvd.py --help`. Rank 0 prints and writes everything in --output-dir.
"""
import logging
import os
import sys
import traceback

import torch

import engine
import hvd_utils
from checkpoint import Checkpointer, CheckpointError, claim_output_dir, resolve
from config import ConfigError, parse_config
from data import BadSampleError, DataError, build_loaders
from elastic_training import train_elastic
from benchmark import run_benchmark
from lifecycle import (build_distributed_optimizer, build_model_on, check_choices, check_shards, epoch_end_handler,
                       evaluate_only, finish, log_setup, prepare_data)
from models import model_task
from reporting import Reporter, write_json
from tasks import TASKS

log = logging.getLogger("hvd_train")


def setup_logging(is_main):
    # Only rank 0 speaks; the others report warnings and errors only.
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, format="%(message)s", stream=sys.stdout)


def main(argv=None):
    cfg = parse_config(argv)
    check_choices(cfg)
    rt = hvd_utils.init(cpu=cfg.run.device == "cpu", fusion_threshold_mb=cfg.horovod.fusion_threshold_mb,
                        cycle_time_ms=cfg.horovod.cycle_time_ms, tune=not cfg.horovod.elastic)
    setup_logging(rt.is_main)
    torch.manual_seed(cfg.run.seed + rt.rank)  # different dropout per rank; the weights come from rank 0 below
    if cfg.benchmark.enabled:
        return run_benchmark(cfg, rt)

    train_set, val_set, info = prepare_data(cfg)
    accumulate = cfg.horovod.batches_per_allreduce
    check_shards(info.num_train, rt.size, cfg.optim.batch_size * accumulate)
    train_loader, val_loader, train_sampler = build_loaders(
        train_set, val_set, cfg.optim.batch_size * accumulate, rt.rank, rt.size, cfg.run.seed,
        workers=cfg.data.workers, pin_memory=rt.device.type == "cuda")
    task = TASKS[model_task(cfg.model.name)]
    model = build_model_on(cfg, info, rt.device)
    # Horovod: the learning rate scaled with the global batch; gradients averaged across ranks by the optimizer.
    optimizer, lr_scale, lr = build_distributed_optimizer(cfg, model, rt.size)
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
