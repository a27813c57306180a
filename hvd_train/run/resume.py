"""Finding, reading and resuming checkpoints: the one reader of what hvd_train/run/checkpoint.py writes.

Finding: the checkpoint --resume names (`auto`: the newest whole one in checkpoints/, said in one line where newer
ones were passed over or a save was never finished), and the one a run directory offers export and predict (best.pt,
else last.pt). Reading: torch.load(weights_only=True) of a file whose members are all stored as torch.save stores
them, through the gate, checked against the settings of the run that loads it. Resuming: rank 0 reads, every rank
gets the weights, the run state, and its RNG states where the number of ranks is unchanged.
"""
import logging
import os
import pickle
import warnings
import zipfile

import torch

import hvd_utils
from hvd_train.errors import CheckpointError
from hvd_train.gate import RecordError, plain
from hvd_train.run.checkpoint import LEFT_BEHIND, STEP_FILE, VERSION, epoch_files, numbered_files, set_rng_state
from hvd_train.run.directory import BEST_CHECKPOINT, LAST_CHECKPOINT, RunDir
from hvd_train.schedule import lr_factor

log = logging.getLogger("hvd_train")

# The setting behind each field a checkpoint must share with the run that loads it (checkpoint_fits).
FIT_SETTINGS = {"model_name": "--model", "task": "--task", "dataset": "--dataset", "optimizer_name": "--optimizer",
                "num_classes": "the data set's num_classes", "in_channels": "the data set's in_channels",
                "image_size": "--image-size"}


# Finding: which file a run continues from, or export and predict read.
def resolve(run_dir, resume, training=True):
    """The checkpoint named by --resume in the RunDir `run_dir`: a path, or `auto` for the newest intact checkpoint
    in checkpoints/ (last.pt, else the newest whole one beside it, named in one line with why the newer ones were
    passed over; None when there is none yet, so a job script can always pass --resume auto). A save its writer
    never finished (killed mid-write: only its temporary file is there) is named in one line too, with the
    checkpoint resumed from instead (where `training`: --evaluate reads a checkpoint and removes nothing, and may
    run beside a job whose save is under way). A path is taken as given."""
    if resume == "auto":
        path, passed_over = newest_intact(run_dir.checkpoints)
        if training:
            say_unfinished(run_dir, unfinished_saves(run_dir.checkpoints), path)
        if passed_over:
            skipped = "; ".join(f"{os.path.relpath(p, run_dir.root)} ({why})" for p, why in passed_over)
            if path is None:
                raise CheckpointError(f"--resume auto: no checkpoint in {run_dir.checkpoints} is whole: {skipped}; "
                                      f"pass --overwrite to start again, or --resume a checkpoint you have")
            log.warning("--resume auto: passed over %s; resuming from %s, the newest whole checkpoint", skipped,
                        os.path.relpath(path, run_dir.root))
        return path
    if not os.path.isfile(resume):
        raise CheckpointError(f"--resume {resume}: no such file")
    return resume


def say_unfinished(run_dir, unfinished, path):
    """One line for the saves whose writer was stopped before the rename ([(file it was to become, temporary
    file left)]): what was not saved, and what --resume auto continues from instead."""
    if not unfinished:
        return

    def rel(p):
        return os.path.relpath(p, run_dir.root)

    what = "; ".join(f"{rel(target)} (its writer stopped before the rename and left {rel(left)}, which this "
                     f"run removes)" for target, left in unfinished)
    if path is None:
        instead = "no checkpoint was saved before it, so the run starts afresh"
    elif any(target == path for target, _ in unfinished):
        instead = f"resuming from {rel(path)} as it was before that save"
    else:
        instead = f"resuming from {rel(path)} instead"
    log.warning("--resume auto: a save was not finished: %s; %s", what, instead)


def newest_intact(directory):
    """(the newest checkpoint in `directory` that is whole, or None; [(path, why) of each newer one passed over]).
    Newest first: last.pt, then the checkpoints taken within an epoch (they outlive only the newest epoch's), then
    the epochs'."""
    candidates = [os.path.join(directory, LAST_CHECKPOINT), *numbered_files(directory, STEP_FILE)[::-1],
                  *epoch_files(directory)[::-1]]
    passed_over = []
    for path in candidates:
        if os.path.isfile(path):
            why = damage(path)
            if why is None:
                return path, passed_over
            passed_over.append((path, why))
    return None, passed_over


def unfinished_saves(directory):
    """[(the checkpoint a killed writer was saving, the temporary file it left)] in `directory`, by name: the files
    (never links) LEFT_BEHIND matches, which the next Checkpointer removes."""
    if not os.path.isdir(directory):
        return []
    return [(os.path.join(directory, name.split(".tmp.")[0]), os.path.join(directory, name))
            for name in sorted(os.listdir(directory))
            if LEFT_BEHIND.fullmatch(name) and os.path.isfile(os.path.join(directory, name))
            and not os.path.islink(os.path.join(directory, name))]


def damage(path):
    """Why the checkpoint file at `path` cannot be resumed from, or None: cut short (no whole zip archive), or a
    member whose bytes no longer match their checksum (every member is read)."""
    try:
        if not zipfile.is_zipfile(path):
            return "cut short: not a whole zip archive"
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
        return f"its member {bad} fails its checksum" if bad else None
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        return f"unreadable ({e})"


def find_checkpoint(source):
    """The checkpoint `source` names: the file itself, or a run directory's best.pt (last.pt without one)."""
    if os.path.isdir(source):
        run_dir = RunDir(source)
        for name in (BEST_CHECKPOINT, LAST_CHECKPOINT):
            for path in (run_dir.checkpoint(name), run_dir.path(name)):  # its checkpoints/, or given that folder
                if os.path.isfile(path):
                    return path
        raise CheckpointError(f"{source}: no checkpoints/best.pt or checkpoints/last.pt in this directory; give a "
                              f"run's output directory (--output-dir) or a checkpoint file")
    if not os.path.isfile(source):
        raise CheckpointError(f"{source}: no such file or directory; give a run's output directory or a checkpoint")
    return source


# Reading one file: bounded, data only, one of ours, and fit for the run that loads it.
def unbounded_members(path):
    """Why reading the torch.save archive at `path` could take more memory than the file holds, or None. torch.save
    stores every member as it is; torch.load inflates a compressed one in memory whatever its size, so a small file
    of DEFLATE-compressed zeros would take gigabytes before its contents could be checked."""
    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
    for member in members:
        if member.compress_type != zipfile.ZIP_STORED or member.file_size != member.compress_size:
            return (f"its member {member.filename} is compressed ({member.compress_size:,} bytes that would inflate "
                    f"to {member.file_size:,}); torch.save stores every member uncompressed")
    if sum(m.file_size for m in members) > os.path.getsize(path):
        return "its members claim more bytes than the file holds"
    return None


def load(path):
    """Read a checkpoint safely (weights_only, every member stored) and check it is one of ours."""
    if os.path.isdir(path):
        raise CheckpointError(f"{path}: is a directory; give a checkpoint file such as {path}/last.pt")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: not a checkpoint, or one cut short (torch.save writes a zip archive and this "
                              f"is not a whole one)")
    unbounded = unbounded_members(path)
    if unbounded:
        raise CheckpointError(f"{path}: not a checkpoint torch.save wrote: {unbounded}; it is refused unread")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols, meaningless to a user
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's own message advises weights_only=False, which would run the file's code: not for our users.
        raise CheckpointError(f"{path}: not an hvd-train checkpoint (it holds Python objects other than tensors "
                              f"and plain values, and is refused: loading those could run code)") from None
    except Exception as e:  # a zip archive cut short or damaged
        raise CheckpointError(f"{path}: damaged or incomplete checkpoint ({type(e).__name__}); resume from an "
                              f"earlier one in the same directory") from None
    try:  # the gate (hvd_train/gate.py): its plain values bounded as a tree, shared references counted each time
        plain(ckpt, path)
    except RecordError as e:
        raise CheckpointError(f"{e}; it is refused") from None
    if not isinstance(ckpt, dict) or ckpt.get("version") != VERSION:
        raise CheckpointError(f"{path}: not an hvd-train checkpoint (version {VERSION} expected)")
    return ckpt


def check_fits(ckpt, path, expect):
    """Every setting in `expect` the checkpoint records must match (older checkpoints record fewer)."""
    for key, value in expect.items():
        if key in ckpt and ckpt[key] != value:
            setting = FIT_SETTINGS.get(key, key)
            raise CheckpointError(f"{path} was written with {key}={ckpt[key]!r}, this run has {key}={value!r}: a "
                                  f"checkpoint fits only a run with the same {key} ({setting}); use the "
                                  f"checkpoint's setting, or another file")


def read_into(path, model, expect, optimizer=None, ema=None):
    """Load checkpoint `path` into the model (and the optimizer, and the weights' average, when given) after
    checking it fits `expect`; returns its other fields (counters, history, scaler, world size, RNG states). A
    checkpoint without an average starts one from its weights."""
    ckpt = load(path)
    check_fits(ckpt, path, expect)
    try:
        model.load_state_dict(ckpt["model"])
        if optimizer is not None:
            optimizer.load_state_dict(ckpt["optimizer"])
        if ema is not None and isinstance(ckpt.get("ema"), dict):
            ema.load_state_dict(ckpt["ema"])
        elif ema is not None:
            ema.restart(model)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: its weights do not fit this model ({str(e).splitlines()[0]})")
    planned = (ckpt.get("config") or {}).get("optim", {}).get("epochs")
    return {**{k: v for k, v in ckpt.items() if k not in ("model", "optimizer", "config", "ema")},
            "planned_epochs": planned}


# Resuming: rank 0 reads, every rank continues from what it read.
def checkpoint_fits(cfg, info, task, continuing=True):
    """The settings a checkpoint must share with this run to be loaded into it: the model's shape always; to
    continue training also the data it was trained on and the optimizer whose state it holds."""
    fits = {"model_name": cfg.model.name, "task": task.name, "num_classes": info.num_classes,
            "in_channels": info.in_channels, "image_size": info.image_size}
    if continuing:
        fits.update(dataset=cfg.data.dataset, optimizer_name=cfg.optim.optimizer)
    return fits


def resume(path, trainer, state, fits):
    """Continue from checkpoint `path` on every rank: read_checkpoint, then rank 0's weights and optimizer state to
    the others (as an elastic run does inside Horovod's loop; train_hvd.py shows that broadcast as its own step)."""
    read_checkpoint(path, trainer, state, fits)
    hvd_utils.broadcast_state(trainer.model, trainer.optimizer, root_rank=0)


def read_checkpoint(path, trainer, state, fits):
    """Rank 0 reads checkpoint `path` into its model and optimizer (Horovod's broadcast, next, gives them to every
    rank); every rank gets the weights' average (--model-ema), the scaler, its RNG states where the number of ranks
    is unchanged, and the run state (the learning rate follows from its epoch). A checkpoint that has reached
    --epochs is refused: there is nothing to train, and no summary may pretend so."""
    meta = hvd_utils.decide_on_root(lambda: read_into(path, trainer.model, fits, trainer.optimizer, trainer.ema),
                                    "checkpoint")
    if trainer.ema is not None:
        hvd_utils.broadcast_module(trainer.ema)
    if meta["epoch"] >= trainer.epochs:
        raise CheckpointError(f"--resume {path}: nothing to train: the checkpoint is at epoch {meta['epoch']} and "
                              f"--epochs is {trainer.epochs}; pass a larger --epochs to train further, or "
                              f"--evaluate --resume {path} to measure it")
    if trainer.scaler is not None and meta.get("scaler"):
        trainer.scaler.load_state_dict(meta["scaler"])
    restore_rng(meta)
    state.load(meta)
    state.resumed(path, hvd_utils.world_size(), meta.get("world_size"))
    say_schedule_change(trainer.schedule, meta.get("planned_epochs"), meta["epoch"])
    return meta.get("rank_buffers") or {}


def restore_rank_buffers(trainer, rank_buffers, partial):
    """After the broadcast of rank 0's state, each rank's own BatchNorm statistics (of the model and of the
    average) from a checkpoint taken within an epoch; on another number of ranks than wrote it, their average,
    said in one line."""
    averaged = hvd_utils.restore_buffers_by_rank(trainer.model, rank_buffers.get("model"))
    if trainer.ema is not None:
        averaged = hvd_utils.restore_buffers_by_rank(trainer.ema.module, rank_buffers.get("ema")) or averaged
    if averaged:
        log.info("the checkpoint was taken within epoch %d on %d ranks, whose BatchNorm statistics differ: each of "
                 "the %d ranks now goes on from their average", partial["epoch"], partial["world_size"],
                 hvd_utils.world_size())


def say_schedule_change(schedule, planned, epoch):
    """A resume with another --epochs than the checkpoint's run planned changes the cosine schedule from here on
    (it decays to 0 at the new end): said in one line, with the rate it changes."""
    c = schedule.cfg
    if not planned or planned == c.epochs or c.lr_schedule != "cosine":
        return
    before = c.lr * schedule.lr_scale * lr_factor(epoch, planned, c.lr_schedule, c.warmup_epochs,
                                                  1.0 / schedule.lr_scale)
    log.info("--epochs %d where the checkpoint's run planned %d: the cosine schedule now decays to 0 over %d epochs, "
             "so the learning rate after epoch %d is %.4g (it was %.4g on the old plan)", c.epochs, planned, c.epochs,
             epoch, schedule.lr(epoch), before)


def load_everywhere(path, model, expect, optimizer=None, ema=None):
    """Rank 0 loads checkpoint `path` (checked against `expect`: model_name, task, num_classes, dataset, ...), then
    every rank gets its weights and optimizer state (and the weights' average, under --model-ema): the one loader of
    resuming, elastic and evaluation runs. Returns the checkpoint's other fields, the same on every rank."""
    meta = hvd_utils.decide_on_root(lambda: read_into(path, model, expect, optimizer, ema), "checkpoint")
    hvd_utils.broadcast_state(model, optimizer)
    if ema is not None:
        hvd_utils.broadcast_module(ema)
    return meta


def restore_rng(meta):
    """This rank's RNG states from a checkpoint's, where it was written by as many ranks as there are now (with
    another number of ranks, rank r's stream would not continue anyway)."""
    if meta.get("world_size") == hvd_utils.world_size() and meta.get("rng"):
        set_rng_state(meta["rng"][hvd_utils.rank()])
