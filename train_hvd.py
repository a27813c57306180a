"""hvd-train: data-parallel PyTorch training with Horovod.

Launch (every flag has a default, so each of these trains the small CNN on scikit-learn's digits):

    python train_hvd.py                                          # one process
    horovodrun -np 2 -H localhost:2 python train_hvd.py          # 2 ranks on this machine
    horovodrun -np 8 -H host1:4,host2:4 python train_hvd.py      # 2 hosts, 4 ranks (GPUs) each
    horovodrun -np 8 -hostfile hostfiles/example.txt python train_hvd.py
    mpirun -np 8 -H host1:4,host2:4 -bind-to none -map-by slot -x PATH -x LD_LIBRARY_PATH python train_hvd.py

Settings: `python train_hvd.py --help`. Rank 0 prints one line per epoch and writes <output dir>/summary.json.
"""
import json
import logging
import os
import sys
import time

import psutil
import torch

import engine
import hvd_utils
from config import ConfigError, parse_config
from data import DATASETS, build_datasets, build_loaders
from models import MODELS, build_model

log = logging.getLogger("hvd_train")


def setup_logging(is_main):
    # Only rank 0 speaks; the others report warnings and errors only.
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, format="%(message)s", stream=sys.stdout)


def write_json(path, obj):
    """Write via a temporary file and rename, so a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def check_names(cfg):
    """Unknown names fail here, before any rank starts Horovod and could wait for one that has stopped."""
    for flag, name, known in (("--model", cfg.model.name, MODELS), ("--dataset", cfg.data.dataset, DATASETS)):
        if name not in known:
            raise ConfigError(f"{flag}={name!r} is not known; choose one of: {', '.join(sorted(known))}")


def main(argv=None):
    cfg = parse_config(argv)
    check_names(cfg)
    rt = hvd_utils.init()
    setup_logging(rt.is_main)
    torch.manual_seed(cfg.run.seed + rt.rank)  # different dropout per rank; the weights come from rank 0 below

    train_set, val_set, info = build_datasets(cfg.data.dataset, cfg.data.val_fraction, cfg.data.split_seed)
    train_loader, val_loader, train_sampler = build_loaders(
        train_set, val_set, cfg.optim.batch_size, rt.rank, rt.size, cfg.run.seed,
        workers=cfg.data.workers, pin_memory=rt.device.type == "cuda")
    model = build_model(cfg.model.name, info.in_channels, info.num_classes, info.image_size).to(rt.device)

    lr = hvd_utils.scaled_lr(cfg.optim.lr, rt.size)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.optim.momentum,
                                weight_decay=cfg.optim.weight_decay)
    optimizer = hvd_utils.distributed_optimizer(optimizer, model)
    hvd_utils.broadcast_state(model, optimizer, root_rank=0)

    log.info("hvd-train: %d rank(s), %d per host, device %s, %d CPU thread(s) per rank, controller %s, "
             "tensor ops %s", rt.size, rt.local_size, rt.device, rt.threads, rt.controller, rt.tensor_ops)
    log.info("data %s: %d train / %d val samples; model %s", cfg.data.dataset, info.num_train, info.num_val,
             cfg.model.name)
    log.info("batch %d per rank x %d ranks = %d global; lr %g base x %d ranks = %g peak, %s schedule",
             cfg.optim.batch_size, rt.size, cfg.optim.batch_size * rt.size, cfg.optim.lr, rt.size, lr,
             cfg.optim.lr_schedule)

    result = engine.fit(model, optimizer, train_loader, val_loader, train_sampler, cfg.optim.epochs,
                        rt.device, schedule=cfg.optim.lr_schedule)

    # Every rank must end with the same weights; a difference means gradients were not averaged.
    fingerprints = hvd_utils.fingerprints_by_rank(model)
    in_sync = len(set(fingerprints)) == 1
    if rt.is_main:
        summary = {
            "world_size": rt.size, "local_size": rt.local_size, "device": str(rt.device),
            "controller": rt.controller, "tensor_ops": rt.tensor_ops, "threads_per_rank": rt.threads,
            "dataset": cfg.data.dataset, "model": cfg.model.name, "epochs": cfg.optim.epochs,
            "batch_size_per_rank": cfg.optim.batch_size, "global_batch_size": cfg.optim.batch_size * rt.size,
            "base_lr": cfg.optim.lr, "lr": lr, "lr_schedule": cfg.optim.lr_schedule,
            "best_val_acc1": result["best_val_acc1"], "final_val_acc1": result["final_val_acc1"],
            "final_val_loss": result["final_val_loss"], "train_samples_per_sec": result["train_samples_per_sec"],
            "params_in_sync": in_sync, "params_fingerprints": fingerprints,
            # From the process's own start, imports and Horovod start-up included: what a user waits for.
            "wall_seconds": time.time() - psutil.Process().create_time(), "history": result["history"],
        }
        os.makedirs(cfg.run.output_dir, exist_ok=True)
        write_json(os.path.join(cfg.run.output_dir, "config.json"), cfg.to_dict())
        write_json(os.path.join(cfg.run.output_dir, "summary.json"), summary)
        log.info("done: best val top-1 %.2f%%, final %.2f%%, %.0f train samples/s, %.1fs wall; summary in %s",
                 summary["best_val_acc1"], summary["final_val_acc1"], summary["train_samples_per_sec"],
                 summary["wall_seconds"], os.path.join(cfg.run.output_dir, "summary.json"))
    if not in_sync:
        log.error("ranks ended with different parameters (fingerprints %s): gradients were not averaged",
                  fingerprints)
        return 1
    return 0


def cli():
    try:
        code = main()
    except ConfigError as e:
        # Raised before Horovod starts and the same on every rank, so no rank waits on another; rank 0 says it.
        if hvd_utils.launcher_rank() == 0:
            print(f"train_hvd.py: error: {e}", file=sys.stderr)
        code = 2
    finally:
        hvd_utils.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    cli()
