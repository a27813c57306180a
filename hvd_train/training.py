"""The steps of a training run, in the order train_hvd.py calls them, shared by fixed and elastic runs.

data -> loaders -> model and task -> optimizer -> Trainer -> the output directory claimed (and a checkpoint read on
rank 0) -> Horovod's broadcast (train_hvd.py) -> fit -> summary. An elastic run (modes/elastic.py) takes the same
parts and differs only in where the claim, the broadcast and fit happen: inside Horovod's elastic loop.
"""
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

import hvd_utils
from hvd_train.guards import interrupt, time_limit, watchdog
from hvd_train.build import (attach_profiler, build_model_for, build_optimizer, build_task, load_initial_weights,
                             loader_spec, prepare_data, try_a_sample, try_the_metrics)
from hvd_train.checks import check_shards
from hvd_train.errors import ConfigError
from hvd_train.data import DataInfo, LoaderSpec, build_loaders, check_world, is_streamed
from hvd_train.data import continue_epoch as continue_epoch_of
from hvd_train.engine import Hooks, StepOptions, Trainer
from hvd_train.feed import Feed
from hvd_train import engine
from hvd_train.regularize import Mixing, weight_average
from hvd_train.run.reporting import finish as write_summary
from hvd_train.run.setup_lines import log_rescale, log_setup
from hvd_train.run.directory import RunDir, write_config
from hvd_train.run.saves import StepSaves
from hvd_train.run.resume import checkpoint_fits, read_checkpoint, restore_rank_buffers
from hvd_train.run.state import AfterEpoch, RunState, outputs_for
from hvd_train.schedule import LRSchedule, batching
from hvd_train.timing import OFF, StepClock
from hvd_train.run.tracking import local_mlflow, open_trackers
from hvd_train.weights import freeze_configured

log = logging.getLogger("hvd_train")


@dataclass(frozen=True)
class Data:
    """The data sets of a run, their facts, and how the loaders read them (a step's samples per rank, workers)."""
    train_set: object
    val_set: object
    info: DataInfo
    spec: LoaderSpec

    @property
    def streamed(self):
        return is_streamed(self.train_set)


def load_data(cfg, rt):
    """The configured data sets (downloaded once per host where asked), checked against the number of ranks: every
    rank must get at least one full batch a step."""
    train_set, val_set, info = prepare_data(cfg)
    spec = loader_spec(cfg, rt.device)
    if is_streamed(train_set):
        check_world(train_set, rt.size, spec)
    else:
        check_shards(info.num_train, rt.size, spec.batch_size)
    return Data(train_set, val_set, info, spec)


def loaders(data, sampler, rank, size):
    """(training loader, validation loader, what set_epoch is called on) for `size` ranks: the training loader reads
    through `sampler` (tar shards: the loader deals its shards itself, and is its own sampler); validation reads
    every sample exactly once over all ranks."""
    return build_loaders(data.train_set, data.val_set, data.spec, rank, size, train_sampler=sampler)


def model_and_task(cfg, info, device):
    """The configured model on `device` and its task (the loss and metrics); --freeze applied. Every rank builds
    its own random weights here: Horovod's broadcast gives them rank 0's next."""
    model = build_model_for(cfg, info, device)
    task = build_task(cfg, info)
    try_a_sample(model, task, info, device, cfg)  # lazy shapes taken; a classifier's samples checked
    try_the_metrics(model, task, info, device)  # a task of one's own: its sums and figures reduce
    freeze_configured(model, cfg.model)  # before the optimizer: frozen parameters are not given to it
    return model, task


def optimizer(cfg, model, lr):
    """The configured optimizer (torch's SGD, Adam, AdamW, or any of timm's) at learning rate `lr`."""
    return build_optimizer(model, cfg.optim, lr)


def allreduce_options(cfg):
    """How Horovod's DistributedOptimizer averages: the horovod.* settings."""
    h = cfg.horovod
    return dict(batches_per_allreduce=h.batches_per_allreduce, fp16_allreduce=h.fp16_allreduce,
                bf16_allreduce=h.bf16_allreduce, use_adasum=h.use_adasum,
                gradient_predivide_factor=h.gradient_predivide_factor, elastic=h.elastic, shard=h.shard_optimizer,
                powersgd=(h.powersgd_rank, None if h.powersgd_start_step < 0 else h.powersgd_start_step,
                          h.powersgd_min_compression) if h.powersgd_rank else None)


def trainer(cfg, info, rt, model, task, optimizer, scaled=None):
    """What the training loop drives: the parts above, the learning-rate schedule, the fp16 scaler, the average of
    the weights (--model-ema) and mixup/CutMix, and the run's batch arithmetic on rt.size ranks (`scaled`, where
    the caller made it for the optimizer's rate), which everything after reads from the Trainer."""
    scaled = scaled or batching(cfg, rt.size)
    mixing = Mixing(cfg.aug, info.num_classes, cfg.run.seed, rt.rank) if cfg.aug.mixing else None
    return Trainer(model=model, task=task, optimizer=optimizer,
                   schedule=LRSchedule(cfg.optim, scaled.lr_scale), device=rt.device,
                   opts=StepOptions.from_config(cfg, rt.is_main), epochs=cfg.optim.epochs,
                   scaler=torch.amp.GradScaler("cuda") if cfg.optim.amp == "fp16" else None,
                   ema=weight_average(cfg, model), mixing=mixing, feed=Feed.of_run(cfg, info, rt.device, rt.rank),
                   batching=scaled, clock=StepClock(rt.device) if cfg.logging.step_timing else OFF)


@dataclass
class Run:
    """A run that holds its output directory: what it trains, where it writes, what it has done so far."""
    cfg: object
    rt: hvd_utils.Runtime
    info: DataInfo
    trainer: Trainer
    run_dir: RunDir
    state: RunState
    resumed_from: Optional[str] = None
    rank_buffers: dict = field(default_factory=dict)  # each rank's BatchNorm statistics, where the checkpoint has them
    outputs: object = None  # set by fit(): checkpointer, reporter


@contextlib.contextmanager
def claim(cfg, rt, info, trainer):
    """--init-from read on rank 0; rank 0 claims --output-dir (continue, replace or refuse: an earlier run is never
    clobbered) and holds its lock until the block ends; on --resume, rank 0 reads the checkpoint into its model and
    optimizer, and every rank gets the run's state. Horovod's broadcast, next, gives every rank rank 0's weights."""
    # Before the claim: a file that does not fit leaves nothing behind (a resume then replaces these weights).
    load_initial_weights(cfg, trainer.model)
    run_dir = RunDir(cfg.run.output_dir)
    resume_from = hvd_utils.decide_on_root(
        lambda: run_dir.claim(cfg.checkpoint.resume, cfg.run.overwrite, local_mlflow(cfg)), "output_dir")
    # Held until the block ends; stopped before training starts (a refusal of the checkpoint, say), the run leaves
    # no directory it made (RunDir.held).
    with run_dir.held():
        state, rank_buffers = RunState(), {}
        if resume_from:  # refused on every rank before anything is written
            rank_buffers = read_checkpoint(resume_from, trainer, state, checkpoint_fits(cfg, info, trainer.task))
        elif cfg.checkpoint.resume:
            log.info("--resume auto: no checkpoint in %s yet, starting afresh", run_dir.checkpoints)
        yield Run(cfg, rt, info, trainer, run_dir, state, resume_from, rank_buffers)


def fit(run, loaders):
    """Train the claimed run from its state (after the broadcast): reports and trackers opened, the config
    written, the watchdog on, engine.fit, everything closed whatever happens."""
    cfg, rt, trainer, state = run.cfg, run.rt, run.trainer, run.state
    train_loader, val_loader, sampler = loaders
    if trainer.ema is not None and not run.resumed_from:  # the average starts from the weights every rank now holds
        trainer.ema.restart(trainer.model)
    start_compression(cfg, trainer, state, len(train_loader))
    if run.rank_buffers:
        restore_rank_buffers(trainer, run.rank_buffers, state.partial)
    run.outputs = outputs = outputs_for(cfg, run.info, trainer.task, rt.is_main, state, run.run_dir)
    attach_profiler(trainer, cfg, rt, run.run_dir)  # --profile: recording starts in the directory this run owns
    outputs.reporter.track(open_trackers(cfg, rt, state))  # MLflow, W&B: on rank 0
    interrupt.describe_with(lambda: state.where(cfg.optim.epochs, run.run_dir.last_checkpoint))
    log_setup(cfg, rt, run.info, trainer, state.epoch)
    if run.resumed_from:
        log_rescale(cfg, state.resumes[-1], len(train_loader), trainer.batching)
    if state.partial:
        continue_epoch(run, train_loader)
    write_config_everywhere(run.run_dir, cfg)
    # A rank that stops making progress ends the job with its name instead of hanging it (every rank starts it).
    watchdog.start(rt, cfg.run.freeze_timeout_s, f"Checkpoints in {run.run_dir.checkpoints} are written whole or "
                   "not at all: --resume auto continues from the newest.")
    after_epoch = AfterEpoch(cfg, trainer, state, outputs)
    saves = StepSaves(cfg, after_epoch, time_limit.deadline(cfg.checkpoint.before_time_limit_s, rt.is_main))
    run.run_dir.training()  # from here on the directory is kept, whatever becomes of the run
    try:
        # While the epochs run, SIGTERM and SIGUSR1 have a checkpoint written at the next step before the run stops.
        with interrupt.save_first():
            engine.fit(trainer, train_loader, val_loader, Hooks(sampler, after_epoch, state, saves),
                       first_epoch=state.epoch + 1)
        saves.close()
        close_profiler(trainer)
        # The last checkpoint is written (a background write's failure stops every rank here, with its message).
        hvd_utils.decide_on_root(outputs.checkpointer.wait, "last_checkpoint")
    except BaseException as e:
        # The tracker's run ends too: killed (Ctrl-C, SIGTERM) or failed; --resume continues it.
        outputs.checkpointer.settle()
        outputs.reporter.end_tracking(None, [], "KILLED" if isinstance(e, interrupt.Interrupted) else "FAILED")
        raise
    finally:
        state.set_saves(saves.times.summary())
        watchdog.stop()
        outputs.reporter.close()


def start_compression(cfg, trainer, state, steps_per_epoch):
    """--powersgd-rank: the fp16 scaler handed to the compression and its start step fixed (10% of the run's steps
    unless given); one past the run's last step is refused, on every rank, before the directory is kept."""
    run_steps, start = cfg.optim.epochs * steps_per_epoch, cfg.horovod.powersgd_start_step
    if cfg.horovod.powersgd_rank and start >= run_steps:  # (on one rank too: the same command fails on more)
        raise ConfigError(f"horovod.powersgd_start_step (--powersgd-start-step)={start}: the run has only "
                          f"{run_steps} optimizer steps ({cfg.optim.epochs} epochs of {steps_per_epoch}), so PowerSGD "
                          f"would never start; give a smaller start step, or -1 for 10% of the run")
    hvd_utils.prepare_compression(trainer.optimizer, trainer.scaler, run_steps, state.step)


def continue_epoch(run, train_loader):
    """A run resumed from a checkpoint taken within an epoch: its loader reads the rest of that epoch (or, where
    it cannot, the epoch starts over), said in one line."""
    said, continues = continue_epoch_of(train_loader, run.state.partial, run.rt.rank, run.rt.size)
    log.info("resumed within epoch %d: %s", run.state.partial["epoch"], said)
    if not continues:
        run.state.restart_epoch()


def write_config_everywhere(run_dir, cfg):
    """config.json, written by rank 0; a full disk or a file that cannot be written stops every rank in one line."""
    hvd_utils.decide_on_root(lambda: write_config(run_dir.config, cfg), "config")


def close_profiler(trainer):
    if trainer.profiler is not None:
        trainer.profiler.close()


def finish(run, rt=None):
    """The ranks' weights compared, rank 0's summary.json and curves; returns the exit code (1: the ranks' weights
    differ). rt: the workers at the end (an elastic run's may differ from those it started with)."""
    return write_summary(run.cfg, rt or run.rt, run.trainer, run.state, run.outputs.reporter)
