"""--evaluate --resume PATH|auto: a checkpoint's metrics on the validation set, over every rank's shard."""
import logging
import os
from typing import TYPE_CHECKING, Any, Sequence

import hvd_utils
from hvd_train.data import build_loaders
from hvd_train.errors import CheckpointError
from hvd_train.files import write_json
from hvd_train.run.checkpoint import checkpoint_fits, checkpoint_to_resume, load_everywhere
from hvd_train.run.directory import RunDir
from hvd_train.tasks import visible
from hvd_train.trainer import Feed, evaluate_all, weight_average
from hvd_train.training import build_model_for, build_task, loader_spec, prepare_data, try_the_metrics

if TYPE_CHECKING:
    from hvd_train.config import Config

log = logging.getLogger("hvd_train")


def run(cfg: "Config", rt: hvd_utils.Runtime) -> int:
    train_set, val_set, info = prepare_data(cfg)
    _, val_loader, _ = build_loaders(train_set, val_set, loader_spec(cfg, rt.device), rt.rank, rt.size)
    run_dir = RunDir(cfg.run.output_dir)
    path = hvd_utils.decide_on_root(lambda: checkpoint_to_resume(run_dir, cfg.checkpoint.resume, training=False),
                                    "evaluate")
    if path is None:
        raise CheckpointError(f"--evaluate --resume auto: no checkpoint in {run_dir.checkpoints} to evaluate")
    task = build_task(cfg, info)
    model = build_model_for(cfg, info, rt.device)
    ema = weight_average(cfg, model)  # --model-ema runs: the checkpoint's average is measured too
    try_the_metrics(model, task, info, rt.device)  # before the checkpoint's weights: a refusal reads no file
    meta = load_everywhere(path, model, checkpoint_fits(cfg, info, task, continuing=False), ema=ema)
    feed = Feed.of_run(cfg, info, rt.device, rt.rank)
    metrics = evaluate_all(model, task, val_loader, feed, cfg.optim.amp)
    say(path, meta, "", metrics, task.helpers)
    if ema is not None:
        averaged = evaluate_all(ema.module, task, val_loader, feed, cfg.optim.amp)
        say(path, meta, " (the weights' average)", averaged, task.helpers)
        metrics.update({f"ema_{k}": v for k, v in averaged.items() if k != "count"})
    if rt.is_main:
        os.makedirs(run_dir.root, exist_ok=True)
        write_json(run_dir.evaluation, {"checkpoint": path, "epoch": meta["epoch"], "world_size": rt.size, **metrics})
    return 0


def say(path: str, meta: dict[str, Any], what: str, metrics: dict[str, Any], helpers: Sequence[str] = ()) -> None:
    log.info("evaluated %s%s (epoch %d) on %d samples: %s", path, what, meta["epoch"], metrics["count"],
             "  ".join(f"{k} {v:.4f}" for k, v in visible(metrics, helpers).items() if k != "count"))
