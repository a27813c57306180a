"""What rank 0 logs before training: the setup lines a user checks first (who runs where, the data, the batch and
learning-rate arithmetic, augmentation, compression), and the line of a resume on another number of ranks.

reporting.py writes what comes after: the epochs' records and the summary.
"""
import logging
import os

import hvd_utils
from hvd_train.schedule import batching
from hvd_train.uris import redact_text

log = logging.getLogger("hvd_train")


def log_setup(cfg, rt, info, trainer, resumed_epoch):
    """The batch and learning-rate arithmetic, and who is running where: the first thing to check in a log."""
    scaled = trainer.batching
    log.info("hvd-train %s: %d rank(s), %d per host, device %s, %d CPU thread(s) per rank, controller %s, "
             "tensor ops %s, fusion %g MB, cycle %g ms", cfg.run.name or "default", rt.size, rt.local_size,
             rt.device, rt.threads, rt.controller, rt.tensor_ops, rt.fusion_threshold_mb, rt.cycle_time_ms)
    if rt.autotune:
        log.info("Horovod autotune is on: it tunes %s while training, from the values above%s",
                 " and ".join(name for name, var in (("the fusion threshold", "HOROVOD_FUSION_THRESHOLD"),
                                                     ("the cycle time", "HOROVOD_CYCLE_TIME"))
                              if var not in os.environ) or "nothing (both are fixed in the environment)",
                 f"; its log: {os.environ['HOROVOD_AUTOTUNE_LOG']}" if os.environ.get("HOROVOD_AUTOTUNE_LOG") else "")
    log.info("data %s: %d train / %d val samples%s; model %s (task %s, %.2fM parameters)",
             describe_call(cfg.data.dataset, info.called_with),
             info.num_train, info.num_val, describe_samples(info), cfg.model.name, trainer.task.name,
             sum(p.numel() for p in trainer.model.parameters()) / 1e6)
    log.info("batch %d per rank x %d ranks x %d per allreduce = %d global; lr %g base x %g = %g, %s schedule, "
             "%g warmup epochs; amp %s%s%s", cfg.optim.batch_size, rt.size, cfg.horovod.batches_per_allreduce,
             scaled.global_batch, cfg.optim.lr, scaled.lr_scale, scaled.lr,
             cfg.optim.lr_schedule, cfg.optim.warmup_epochs, cfg.optim.amp,
             ", channels-last" if cfg.model.channels_last else "",
             f"; resuming after epoch {resumed_epoch}" if resumed_epoch else "")
    extras = (("mixup", cfg.aug.mixup), ("cutmix", cfg.aug.cutmix), ("label smoothing", cfg.aug.smoothing),
              ("drop-path", cfg.model.drop_path))
    extra = "".join(f"; {name} {value:g}" for name, value in extras if value) + \
        (f"; EMA of the weights (decay {cfg.model.ema_decay:g})" if cfg.model.ema else "")
    if info.in_channels and info.image_size:  # images: what they go through
        log.info("augmentation: %s%s", describe_augmentation(cfg), extra)
    elif extra:  # tokens, tables, ...: the data set's samples as they are, and what training adds
        log.info("regularization:%s", extra[1:])
    if cfg.horovod.shard_optimizer and rt.size > 1:
        log.info("optimizer state sharded over %d ranks (ZeRO-1, --shard-optimizer): %s state for %.2fM "
                 "parameters on this rank; checkpoints hold it whole", rt.size, cfg.optim.optimizer,
                 sum(g.length for g in trainer.optimizer.groups) / 1e6)
    log_compression(cfg, rt, trainer.optimizer)
    if cfg.model.compile:
        log.info("torch.compile (mode %s): the first training step compiles the model (and the first validation "
                 "batch again, for eval mode), so epoch 1 takes longer", cfg.model.compile_mode)


def log_compression(cfg, rt, optimizer):
    """--powersgd-rank: the rank, the start step, which tensors it compresses and a step's bytes with and without."""
    plan = hvd_utils.describe_compression(optimizer)
    if plan is None:
        if cfg.horovod.powersgd_rank:
            log.info("PowerSGD: off on one rank (there is nothing to average)")
        return
    log.info("PowerSGD rank %d from optimizer step %d: %d tensors compressed, %d averaged as they are; a step "
             "sends %.3g MB per rank instead of %.3g MB (%.1fx fewer bytes)", plan["rank"], plan["start_step"],
             plan["compressed"], plan["plain"], plan["bytes_powersgd"] / 1e6, plan["bytes_plain"] / 1e6,
             plan["ratio"])
    if plan["restarted"]:
        log.info("PowerSGD: %s", plan["restarted"])


def log_rescale(cfg, resumed, steps_per_epoch, now):
    """One line when a run resumes on another number of ranks than it was checkpointed on (`resumed`: the
    state's last resume record; `now`: the run's Batching on the ranks it has): the learning rate and the global
    batch scale with the ranks, and the schedule, which runs by epochs, goes on from the same epoch with another
    number of steps per epoch."""
    old, new = resumed.get("previous_world_size"), resumed["world_size"]
    if not old or old == new:
        return
    before = batching(cfg, old)  # the arithmetic of the run that wrote the checkpoint, on its number of ranks
    log.info("resuming on %d rank(s) a run checkpointed on %d: learning rate %g -> %g, global batch %d -> %d (both "
             "follow the ranks); the schedule goes on by epochs from epoch %d/%d, now of %d steps", new, old, before.lr,
             now.lr, before.global_batch, now.global_batch, resumed["epoch"] + 1, cfg.optim.epochs, steps_per_epoch)


SHORT_REPR = 80  # characters of a list's, a tuple's or a dict's repr that the data line shows; longer: its length


def describe_call(name, kwargs):
    """'mydata:sets(seed=42, image_size=64)': factory `name` with the keyword arguments the run passed it, on one
    line, URIs redacted; just the name where they are not known (None). Numbers, strings (whole: a path is worth
    reading), None and short containers of them as repr shows them; tensors and other objects by their type."""
    if kwargs is None:
        return name
    return redact_text(f"{name}({', '.join(f'{key}={_shown_argument(value)}' for key, value in kwargs.items())})")


def _shown_argument(value):
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, int):
        return repr(int(value))
    if isinstance(value, float):
        return repr(float(value))
    if isinstance(value, (list, tuple, dict)):
        items = list(value.keys()) + list(value.values()) if isinstance(value, dict) else list(value)
        shown = repr(value)
        if all(v is None or isinstance(v, (bool, int, float, str)) for v in items) and len(shown) <= SHORT_REPR:
            return shown
        return f"<{type(value).__name__} of {len(value)}>"
    return f"<{type(value).__name__}>"


def describe_samples(info):
    """' of 3x32x32, 10 classes' for images; the facts a user's data set gave otherwise."""
    if info.in_channels and info.image_size:
        shape = f" of {info.in_channels}x{info.image_size}x{info.image_size}"
        return shape + (f", {info.num_classes} classes" if info.num_classes else "")
    facts = {k: v for k, v in info.facts().items() if isinstance(v, (int, float, str, bool))}
    return f" ({', '.join(f'{k} {v}' for k, v in facts.items())})" if facts else ""


def describe_augmentation(cfg):
    """What training samples go through, in one line."""
    from hvd_train.data.augment import Augmentation
    from hvd_train.data.catalog import KIND_OF

    return Augmentation.from_config(cfg.aug).describe(KIND_OF.get(cfg.data.dataset, "own"))
