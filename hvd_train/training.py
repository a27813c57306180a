"""A training run: assembled from its settings, opened (output directory and checkpoint), fitted and closed.

The steps, in the order train_hvd.py calls them and shared by fixed and elastic runs: data -> loaders -> model and
task -> optimizer -> Trainer -> open_run (the output directory claimed, a checkpoint read on rank 0) -> Horovod's
broadcast (train_hvd.py) -> fit -> close_run (summary). An elastic run (hvd_train/modes/elastic.py) takes the same
parts and differs only in where the claim, the broadcast and fit happen: inside Horovod's elastic loop.

Behind the steps are their builders (the data sets, the model and its task, the optimizer, the loaders' settings);
each mode calls only those it uses (evaluation builds no optimizer). The batch arithmetic and the training loop
itself are hvd_train/trainer.py's.

The checks of the settings that need more than the config alone (a model's factory, a data set's, the machine):
check_choices, before any rank starts Horovod or reads a file. Each refusal is one ConfigError naming the value,
why and what to give instead.
"""
import contextlib
import dataclasses
import inspect
import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union, cast

import torch
from torch import nn
from torch.nn.parameter import is_lazy

import hvd_utils
from hvd_train import data, models, tasks
from hvd_train.config import OPTIMIZERS, Config
from hvd_train.data import (
    DataInfo,
    LoaderSpec,
    build_datasets,
    build_loaders,
    check_world,
    dataset_factory,
    is_streamed,
)
from hvd_train.data import continue_epoch as continue_epoch_of
from hvd_train.data.augment import Augmentation, check_policy, generators_kept
from hvd_train.errors import ConfigError
from hvd_train.guards import interrupt, watchdog
from hvd_train.guards.interrupt import deadline
from hvd_train.profiling import StepProfiler
from hvd_train.provenance import is_import_path
from hvd_train.registry import call, resolve, takes
from hvd_train.run.checkpoint import (
    StepSaves,
    checkpoint_fits,
    checkpoint_to_resume,
    read_checkpoint,
    restore_rank_buffers,
)
from hvd_train.run.directory import RunDir, write_config
from hvd_train.run.reports import log_rescale, log_setup, write_summary
from hvd_train.run.state import AfterEpoch, RunState, outputs_for
from hvd_train.run.tracking import local_mlflow, open_trackers
from hvd_train.tasks import samples_in
from hvd_train.timing import OFF, StepClock
from hvd_train.trainer import (
    Feed,
    Hooks,
    LRSchedule,
    Mixing,
    StepOptions,
    Trainer,
    batching,
    fit_epochs,
    image_figures,
    weight_average,
)
from hvd_train.weights import freeze_configured, load_matching

if TYPE_CHECKING:
    from torch.utils.data import DataLoader, Dataset, Sampler

    from hvd_train.config import DataConfig, OptimConfig
    from hvd_train.data.shards import ShardLoader, ShardSet
    from hvd_train.run.state import Outputs
    from hvd_train.trainer import Batching
    from hvd_utils.powersgd import PowerSGDOptimizer
    from hvd_utils.zero import ShardedOptimizer

log = logging.getLogger("hvd_train")


@dataclass(frozen=True)
class Data:
    """The data sets of a run, their facts, and how the loaders read them (a step's samples per rank, workers)."""
    train_set: "Union[Dataset, ShardSet]"
    val_set: "Union[Dataset, ShardSet]"
    info: DataInfo
    spec: LoaderSpec

    @property
    def streamed(self) -> bool:
        return is_streamed(self.train_set)


def load_data(cfg: Config, rt: hvd_utils.Runtime) -> Data:
    """The configured data sets (downloaded once per host where asked), checked against the number of ranks: every
    rank must get at least one full batch a step."""
    train_set, val_set, info = prepare_data(cfg)
    spec = loader_spec(cfg, rt.device)
    if is_streamed(train_set):
        check_world(train_set, rt.size, spec)
    else:
        check_shards(info.num_train, rt.size, spec.batch_size)
    return Data(train_set, val_set, info, spec)


def loaders(data: Data, sampler: "Optional[Sampler[int]]", rank: int, size: int
            ) -> ("tuple[Union[DataLoader, ShardLoader], Union[DataLoader, ShardLoader], "
                  "Union[Sampler[int], ShardLoader]]"):
    """(training loader, validation loader, what set_epoch is called on) for `size` ranks: the training loader reads
    through `sampler` (tar shards: the loader deals its shards itself, and is its own sampler); validation reads
    every sample exactly once over all ranks."""
    return build_loaders(data.train_set, data.val_set, data.spec, rank, size, train_sampler=sampler)


def model_and_task(cfg: Config, info: DataInfo, device: torch.device) -> tuple[nn.Module, tasks.RunTask]:
    """The configured model on `device` and its task (the loss and metrics); --freeze applied. Every rank builds
    its own random weights here: Horovod's broadcast gives them rank 0's next."""
    model = build_model_for(cfg, info, device)
    task = build_task(cfg, info)
    try_a_sample(model, task, info, device, cfg)  # lazy shapes taken; a classifier's samples checked
    try_the_metrics(model, task, info, device)  # a task of one's own: its sums and figures reduce
    freeze_configured(model, cfg.model)  # before the optimizer: frozen parameters are not given to it
    return model, task


def optimizer(cfg: Config, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The configured optimizer (torch's SGD, Adam, AdamW, or any of timm's) at learning rate `lr`."""
    return build_optimizer(model, cfg.optim, lr)


def wire_options(cfg: Config) -> hvd_utils.WireOptions:
    """How Horovod's DistributedOptimizer averages the gradients: the horovod section, as hvd_utils takes it."""
    h = cfg.horovod
    low = hvd_utils.PowerSGD(rank=h.powersgd_rank,
                             start_step=None if h.powersgd_start_step < 0 else h.powersgd_start_step,
                             min_compression=h.powersgd_min_compression) if h.powersgd_rank else None
    return hvd_utils.WireOptions(batches_per_allreduce=h.batches_per_allreduce, fp16_allreduce=h.fp16_allreduce,
                                 bf16_allreduce=h.bf16_allreduce, use_adasum=h.use_adasum,
                                 gradient_predivide_factor=h.gradient_predivide_factor, elastic=h.elastic,
                                 shard=h.shard_optimizer, powersgd=low)


def trainer(cfg: Config, info: DataInfo, rt: hvd_utils.Runtime, model: nn.Module, task: tasks.RunTask,
            optimizer: "Union[torch.optim.Optimizer, ShardedOptimizer, PowerSGDOptimizer]",
            scaled: "Optional[Batching]" = None) -> Trainer:
    """What the training loop drives: the parts above, the learning-rate schedule, the fp16 scaler, the average of
    the weights (--model-ema) and mixup/CutMix, and the run's batch arithmetic on rt.size ranks (`scaled`, where
    the caller made it for the optimizer's rate), which everything after reads from the Trainer."""
    scaled = scaled or batching(cfg, rt.size)
    mixing = Mixing(cfg.aug, cast(int, info.num_classes), cfg.run.seed, rt.rank) if cfg.aug.mixing else None
    return Trainer(model=model, task=task, optimizer=optimizer,
                   schedule=LRSchedule(cfg.optim, scaled.lr_scale), device=rt.device,
                   opts=StepOptions.from_config(cfg, rt.is_main), epochs=cfg.optim.epochs,
                   scaler=torch.amp.GradScaler("cuda") if cfg.optim.amp == "fp16" else None,
                   ema=weight_average(cfg, model), mixing=mixing, feed=Feed.of_run(cfg, info, rt.device, rt.rank),
                   batching=scaled, clock=StepClock(rt.device) if cfg.logging.step_timing else OFF)


@dataclass
class Run:
    """A run that holds its output directory: what it trains, where it writes, what it has done so far."""
    cfg: Config
    rt: hvd_utils.Runtime
    info: DataInfo
    trainer: Trainer
    run_dir: RunDir
    state: RunState
    resumed_from: Optional[str] = None
    rank_buffers: dict = field(default_factory=dict)  # each rank's BatchNorm statistics, where the checkpoint has them
    outputs: "Optional[Outputs]" = None  # set by fit(): checkpointer, reporter


@contextlib.contextmanager
def open_run(cfg: Config, rt: hvd_utils.Runtime, info: DataInfo, trainer: Trainer) -> Iterator[Run]:
    """--init-from read on rank 0; rank 0 claims --output-dir (continue, replace or refuse: an earlier run is never
    clobbered) and holds its lock until the block ends; on --resume, rank 0 reads the checkpoint into its model and
    optimizer, and every rank gets the run's state. Horovod's broadcast, next, gives every rank rank 0's weights."""
    # Before the claim: a file that does not fit leaves nothing behind (a resume then replaces these weights).
    load_initial_weights(cfg, trainer.model)
    run_dir = RunDir(cfg.run.output_dir)
    resume_from = hvd_utils.decide_on_root(
        lambda: run_dir.acquire(cfg.checkpoint.resume, cfg.run.overwrite, local_mlflow(cfg),
                                find_checkpoint=checkpoint_to_resume), "output_dir")
    # Held until the block ends; stopped before training starts (a refusal of the checkpoint, say), the run leaves
    # no directory it made (RunDir.lock_held).
    with run_dir.lock_held():
        state, rank_buffers = RunState(), {}
        if resume_from:  # refused on every rank before anything is written
            rank_buffers = read_checkpoint(resume_from, trainer, state, checkpoint_fits(cfg, info, trainer.task))
        elif cfg.checkpoint.resume:
            log.info("--resume auto: no checkpoint in %s yet, starting afresh", run_dir.checkpoints)
        yield Run(cfg, rt, info, trainer, run_dir, state, resume_from, rank_buffers)


def fit(run: Run, loaders: ("tuple[Union[DataLoader, ShardLoader], Union[DataLoader, ShardLoader], "
                            "Union[Sampler[int], ShardLoader]]")) -> None:
    """Train the claimed run from its state (after the broadcast): reports and trackers opened, the config
    written, the watchdog on, fit, everything closed whatever happens."""
    cfg, rt, trainer, state = run.cfg, run.rt, run.trainer, run.state
    train_loader, val_loader, sampler = loaders
    if trainer.ema is not None and not run.resumed_from:  # the average starts from the weights every rank now holds
        trainer.ema.restart(trainer.model)
    start_compression(cfg, trainer, state, len(train_loader))
    if run.rank_buffers:
        restore_rank_buffers(trainer, run.rank_buffers, cast("dict[str, Any]", state.partial))
    run.outputs = outputs = outputs_for(cfg, run.info, trainer.task, rt.is_main, state, run.run_dir)
    attach_profiler(trainer, cfg, rt, run.run_dir)  # --profile: recording starts in the directory this run owns
    outputs.reporter.track(open_trackers(cfg, rt, state))  # MLflow, W&B: on rank 0
    interrupt.describe_with(lambda: state.where(cfg.optim.epochs, run.run_dir.last_checkpoint))
    log_setup(cfg, rt, run.info, trainer, state.epoch)
    if run.resumed_from:
        ranks_before = state.resumes[-1].get("previous_world_size")  # the run that wrote the checkpoint
        log_rescale(cfg, state.resumes[-1], len(train_loader), cast("Batching", trainer.batching),
                    batching(cfg, ranks_before) if ranks_before else None)
    if state.partial:
        continue_epoch(run, train_loader)
    write_config_everywhere(run.run_dir, cfg)
    # A rank that stops making progress ends the job with its name instead of hanging it (every rank starts it).
    watchdog.start(rt, cfg.run.freeze_timeout_s, f"Checkpoints in {run.run_dir.checkpoints} are written whole or "
                   "not at all: --resume auto continues from the newest.")
    after_epoch = AfterEpoch(cfg, trainer, state, outputs)
    saves = StepSaves(cfg, after_epoch, deadline(cfg.checkpoint.before_time_limit_s, rt.is_main))
    run.run_dir.keep_from_now()  # from here on the directory is kept, whatever becomes of the run
    try:
        # While the epochs run, SIGTERM and SIGUSR1 have a checkpoint written at the next step before the run stops.
        with interrupt.save_first():
            fit_epochs(trainer, train_loader, val_loader, Hooks(sampler, after_epoch, state, saves),
                       first_epoch=state.epoch + 1)
        saves.close()
        close_profiler(trainer)
        # The last checkpoint is written (a background write's failure stops every rank here, with its message).
        hvd_utils.decide_on_root(outputs.checkpointer.wait, "last_checkpoint")
    except BaseException as e:
        # The tracker's run ends too: killed (Ctrl-C, SIGTERM) or failed; --resume continues it.
        outputs.checkpointer.wait_ignoring_errors()
        outputs.reporter.end_tracking(None, [], "KILLED" if isinstance(e, interrupt.Interrupted) else "FAILED")
        raise
    finally:
        state.set_saves(saves.times.summary())
        watchdog.stop()
        outputs.reporter.close()


def start_compression(cfg: Config, trainer: Trainer, state: RunState, steps_per_epoch: int) -> None:
    """--powersgd-rank: the fp16 scaler handed to the compression and its start step fixed (10% of the run's steps
    unless given); one past the run's last step is refused, on every rank, before the directory is kept."""
    run_steps, start = cfg.optim.epochs * steps_per_epoch, cfg.horovod.powersgd_start_step
    if cfg.horovod.powersgd_rank and start >= run_steps:  # (on one rank too: the same command fails on more)
        raise ConfigError(f"horovod.powersgd_start_step (--powersgd-start-step)={start}: the run has only "
                          f"{run_steps} optimizer steps ({cfg.optim.epochs} epochs of {steps_per_epoch}), so PowerSGD "
                          f"would never start; give a smaller start step, or -1 for 10% of the run")
    hvd_utils.prepare_compression(trainer.optimizer, trainer.scaler, run_steps, state.step)


def continue_epoch(run: Run, train_loader: "Union[DataLoader, ShardLoader]") -> None:
    """A run resumed from a checkpoint taken within an epoch: its loader reads the rest of that epoch (or, where
    it cannot, the epoch starts over), said in one line."""
    said, continues = continue_epoch_of(train_loader, cast("dict[str, Any]", run.state.partial), run.rt.rank,
                                        run.rt.size)
    log.info("resumed within epoch %d: %s", cast("dict[str, Any]", run.state.partial)["epoch"], said)
    if not continues:
        run.state.restart_epoch()


def write_config_everywhere(run_dir: RunDir, cfg: Config) -> None:
    """config.json, written by rank 0; a full disk or a file that cannot be written stops every rank in one line."""
    hvd_utils.decide_on_root(lambda: write_config(run_dir.config, cfg), "config")


def close_profiler(trainer: Trainer) -> None:
    if trainer.profiler is not None:
        trainer.profiler.close()


def close_run(run: Run, rt: Optional[hvd_utils.Runtime] = None) -> int:
    """The ranks' weights compared, rank 0's summary.json and curves; returns the exit code (1: the ranks' weights
    differ). rt: the workers at the end (an elastic run's may differ from those it started with)."""
    return write_summary(run.cfg, rt or run.rt, run.trainer, run.state, cast("Outputs", run.outputs).reporter)


def model_factory(cfg: Config) -> Callable[..., Any]:
    """The factory --model names: one that ships, timm/NAME, or the user's package.module:name."""
    return resolve(cfg.model.name, models.find_model, "--model", models.CHOICES)


def build_task(cfg: Config, info: Optional[DataInfo] = None) -> tasks.RunTask:
    """The task --task names (or the model's own), ready for the training loop; it gets the data's facts it names
    (info: the DataInfo, where the data is known)."""
    name = cfg.model.task or models.model_task(cfg.model.name)
    targets = {k: v for k, v in (("smoothing", cfg.aug.smoothing), ("bce_loss", cfg.aug.bce_loss)) if v}
    return tasks.build_task(resolve(name, tasks.find_task, "--task", tasks.CHOICES), name, cfg.model.task_args,
                            {**(facts_for(info, name) if info else {}), **targets}, info.by_name_only if info else ())


def facts_for(info: DataInfo, name: str) -> dict[str, Any]:
    """The data's facts the factory `name` gets. A shard index's own facts (a file's, info.by_name_only) reach only
    a user's own factory (an import path), and it only by the names of its parameters: a factory that ships would
    take them as its width or hidden size."""
    facts = info.facts()
    return facts if is_import_path(name) else {k: v for k, v in facts.items() if k not in info.by_name_only}


def build_model_for(cfg: Config, info: DataInfo, device: torch.device) -> nn.Module:
    """The configured model for info's data, on `device` (with hvd.SyncBatchNorm layers under --sync-bn, laid
    out channels-last under --channels-last). Its factory gets the data's facts it names and --model-args."""
    name = cfg.model.name
    depth = drop_path_args(cfg)
    try:
        model = call(model_factory(cfg), facts_for(info, name), {**depth, **cfg.model.args}, "--model-args", name,
                     info.by_name_only)
    except TypeError as e:  # torchvision's or timm's constructor refusing an argument it does not know
        if depth and any(k in str(e) for k in depth):
            raise ConfigError(f"model.drop_path (--drop-path): {name} has no stochastic depth to set; leave "
                              f"--drop-path out for this model") from None
        if is_import_path(name) or not cfg.model.args:
            raise
        raise ConfigError(f"--model-args {cfg.model.args}: {name} does not take them ({e})") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model={name!r}: the factory returned a {type(model).__name__}, not a torch.nn.Module")
    if not is_import_path(name) and info.in_channels and info.image_size:
        try:  # e.g. an image size the model cannot take: a setting to change, not a crash
            model = models.checked(name, model, info.in_channels, info.image_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.model.grad_checkpointing:
        set_grad_checkpointing(model, name)
    if cfg.horovod.sync_bn:
        model = hvd_utils.sync_batch_norm(model)
    if cfg.model.channels_last:
        try:
            model = models.to_channels_last(model)
        except ValueError as e:
            raise ConfigError(f"model.channels_last (--channels-last): {cfg.model.name}: {e}; leave it off") from None
    model = model.to(device)  # keeps the weights' layout
    if cfg.model.compile:
        # Compiled in place (nn.Module.compile): the module, its parameters and its state_dict keep their plain
        # names, so checkpoints move between compiled and eager runs, and Horovod's DistributedOptimizer hooks the
        # same parameter tensors. Compilation happens at the first step (and again for evaluation's eval mode).
        model.compile(mode=cfg.model.compile_mode)
    return model


def drop_path_args(cfg: Config) -> dict[str, float]:
    """--drop-path as the argument the model's factory names: timm's drop_path_rate, torchvision's
    stochastic_depth_prob; {} when off. A model that takes neither is refused in one line."""
    rate, name = cfg.model.drop_path, cfg.model.name
    if not rate:
        return {}
    if name.startswith(models.TIMM_PREFIX):
        return {"drop_path_rate": rate}
    factory = model_factory(cfg)
    if is_import_path(name) and takes(factory, "drop_path_rate"):
        return {"drop_path_rate": rate}
    if name in models.torchvision_names():
        return {"stochastic_depth_prob": rate}  # refused when building where the model has none
    raise ConfigError(f"model.drop_path (--drop-path): {name} has no stochastic depth to set (it has no "
                      f"drop_path_rate parameter); leave --drop-path out for this model")


def set_grad_checkpointing(model: nn.Module, name: str) -> None:
    """--grad-checkpointing through the model's own switch (timm's set_grad_checkpointing); refused for a model
    without one."""
    switch = getattr(model, "set_grad_checkpointing", None)
    try:
        if not callable(switch):
            raise NotImplementedError
        switch(True)
    except (NotImplementedError, AssertionError):
        raise ConfigError(f"model.grad_checkpointing (--grad-checkpointing): {name} cannot recompute its "
                          f"activations (it has no working set_grad_checkpointing, as timm's models do); leave "
                          f"--grad-checkpointing out for this model") from None


def param_groups(model: nn.Module, weight_decay: float, decay_norm_and_bias: bool = False
                 ) -> list[dict[str, Any]]:
    """Two groups: weights with weight decay; biases and normalization parameters (all 1-d tensors) without,
    since shrinking them toward zero only hurts (the usual practice since Goyal et al. 2017)."""
    if decay_norm_and_bias or weight_decay == 0:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    decay: list[torch.Tensor]
    no_decay: list[torch.Tensor]
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, optim_cfg: "OptimConfig", lr: float) -> torch.optim.Optimizer:
    """SGD (momentum, optionally Nesterov), Adam or AdamW at learning rate `lr` (already scaled); any other name,
    and any optimizer with layer-wise decay, from timm's create_optimizer_v2."""
    if optim_cfg.optimizer not in OPTIMIZERS or optim_cfg.layer_decay:
        return timm_optimizer(model, optim_cfg, lr)
    groups = param_groups(model, optim_cfg.weight_decay, optim_cfg.decay_norm_and_bias)
    if optim_cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=optim_cfg.momentum, nesterov=optim_cfg.nesterov)
    if optim_cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if optim_cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    raise ValueError(f"unknown optimizer {optim_cfg.optimizer!r}")


def timm_optimizer(model: nn.Module, optim_cfg: "OptimConfig", lr: float) -> torch.optim.Optimizer:
    """timm's optimizer factory: its name (sgd there means Nesterov momentum: --nesterov decides here), weight decay
    off for biases and norms unless decay_norm_and_bias, and layer-wise rate scales ("lr_scale" per group, which
    the schedule applies)."""
    from timm.optim import create_optimizer_v2

    name = {"sgd": "sgd" if optim_cfg.nesterov else "momentum"}.get(optim_cfg.optimizer, optim_cfg.optimizer)
    extra = {"momentum": optim_cfg.momentum} if name in ("sgd", "momentum", "lars", "larc") else {}
    return create_optimizer_v2(model, opt=name, lr=lr, weight_decay=optim_cfg.weight_decay,
                               filter_bias_and_bn=not optim_cfg.decay_norm_and_bias,
                               layer_decay=optim_cfg.layer_decay or None, **extra)


def try_a_sample(model: nn.Module, task: tasks.RunTask, info: DataInfo, device: torch.device, cfg: Config
                 ) -> None:
    """One training sample through the task and the model, on every rank, before anything is written, where the run
    needs it: lazy modules (nn.LazyLinear, ...) take their shapes from it, before the optimizer takes the parameters
    and Horovod broadcasts them (an uninitialized parameter has no storage to average or send); and the built-in
    classification task meets the samples and the model's output it will train on, so a sample without a class or
    an output without logits is one refusal, not a failed first step. The forward runs in eval mode without
    gradients, so no BatchNorm statistic moves; the values each rank draws are replaced by rank 0's in the broadcast
    that follows."""
    lazy = any(is_lazy(p) for p in model.parameters())
    if not (lazy or task.name == "classification") or info.example is None:
        return
    batch = Feed(device, *image_figures(info))(info.example())
    if task.name == "classification" and isinstance(batch, dict) and (cfg.aug.mixup or cfg.aug.cutmix):
        raise ConfigError(f"--{'mixup' if cfg.aug.mixup else 'cutmix'} mixes images, and the samples of "
                          f"{cfg.data.dataset} are dicts ({', '.join(sorted(batch))}); leave it out")
    was_training = model.training
    model.eval()
    try:
        # Eager even under --compile: compiling for this one sample would cost a compilation of its own.
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            _, logits = task.task.loss(model, batch)
    except ConfigError as e:  # the task's own refusal of these samples or outputs
        raise ConfigError(f"--dataset {cfg.data.dataset}, --model {cfg.model.name}: {e}") from None
    except Exception as e:
        if not lazy:
            raise
        raise ConfigError(f"--model={cfg.model.name}: its lazy modules could not take their shapes from a "
                          f"training sample ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") \
            from None
    finally:
        model.train(was_training)
    samples = samples_in(batch)
    if task.name == "classification" and (logits.dim() != 2 or logits.shape[0] != samples):
        raise ConfigError(f"--model {cfg.model.name}: the classification task takes logits of shape (batch, "
                          f"classes), and the model returned {list(logits.shape)} for a batch of {samples}; return "
                          f"one row of class scores per sample, or give your own --task")
    left = [n for n, p in model.named_parameters() if is_lazy(p)]
    if left:
        raise ConfigError(f"--model={cfg.model.name}: lazy parameter(s) {', '.join(left[:3])} were not used by "
                          f"a forward pass of a training sample, so they have no shape; use them in forward(), or "
                          f"give their sizes")


def try_the_metrics(model: nn.Module, task: tasks.RunTask, info: DataInfo, device: torch.device) -> None:
    """A task of one's own, tried on a batch of one training sample and on one of two before anything is written,
    on every rank: metric sums that cannot be added over batches and ranks (a shape that changes with the batch,
    a value that is no tensor), a best_metric that is no number or a derived figure that is not finite are
    refused in one line, not after an epoch. The shapes the sums take are kept (a rank without validation samples
    sends zeros of them). The model runs in eval mode without gradients, and the CPU's generators are put back
    (a resume restores every generator's state after it anyway)."""
    if task.name in tasks.TASKS or not (task.metrics or task.derived) or info.example is None:
        return
    feed = Feed(device, *image_figures(info))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"), generators_kept():
            sums = [task.step(model, feed(info.example(samples)))[1] for samples in (1, 2)]
    finally:
        model.train(was_training)
    task.check_sums(hvd_utils.summed(sums[-1]))  # two samples' figures: a spread is undefined on one


def attach_profiler(trainer: Trainer, cfg: Config, rt: hvd_utils.Runtime, run_dir: RunDir) -> None:
    """--profile: record the trainer's steps into run_dir/profile. Called once the run has claimed run_dir (a claim
    with --overwrite clears what an earlier run wrote there)."""
    if cfg.profile.enabled and trainer.profiler is None:
        trainer.profiler = StepProfiler(cfg, rt, run_dir.profile)


def load_initial_weights(cfg: Config, model: nn.Module) -> None:
    """--init-from: rank 0 reads the file into its model and says what matched; an error stops every rank. The
    caller then broadcasts rank 0's weights (Horovod), so the file is read once, wherever it is."""
    if not cfg.model.init_from:
        return
    report = hvd_utils.decide_on_root(lambda: load_matching(model, cfg.model.init_from, cfg.model.init_partial),
                                      "init_from")
    for line in report.lines(cfg.model.init_from):
        log.info(line)


def loader_spec(cfg: Config, device: torch.device) -> LoaderSpec:
    """The loaders' settings: a step's samples per rank (batch x batches per allreduce), seed, workers."""
    return LoaderSpec(batching(cfg, 1).per_rank, cfg.run.seed, cfg.data.workers,
                      pin_memory=device.type == "cuda", image_size=cfg.data.image_size,
                      shuffle_buffer=cfg.data.shuffle_buffer, drop_last=cfg.data.drop_last,
                      decode=decode_place(cfg, device))


# auto decodes on the GPU below this many loader workers a rank. Measured on an H200 with 16 cores (docs/data.md):
# one worker makes about 300 photos/s, and ResNet-50 trained at about 1,400 img/s decoding on the GPU against 3,600
# with 14 workers decoding: the workers win from about 4 of them. The GPU's figure predates the batches' JPEG bytes
# travelling as one tensor (one worker reading bytes: 1,550 -> 4,300 photos/s on the 2-core VM); to be measured again.
GPU_DECODE_BELOW_WORKERS = 4


def decode_place(cfg: Config, device: torch.device) -> str:
    """Where photos are decoded (--data.decode): "gpu", "cpu", or "auto" (the GPU where the data are photos). auto
    takes the GPU only where there are too few loader workers to keep up; timm's policies and colour jitter work on
    PIL images, which only the CPU path makes."""
    policy = "--aa" if cfg.aug.aa else "--color-jitter" if cfg.aug.color_jitter else ""
    policy = "" if cfg.aug.no_aug else policy
    if cfg.data.decode == "gpu":
        if device.type != "cuda":
            raise ConfigError(f"data.decode (--data.decode)=gpu: this run trains on {device.type}; nvjpeg needs a "
                              f"GPU: leave it at auto or pass cpu")
        if policy:
            raise ConfigError(f"data.decode (--data.decode)=gpu: {policy} is a policy on PIL images, which only the "
                              f"loader workers make: pass --data.decode cpu (or auto), or leave out {policy}")
        return "gpu"
    if cfg.data.decode == "auto" and device.type == "cuda" and cfg.data.workers < GPU_DECODE_BELOW_WORKERS:
        if policy:
            log.info("photos are decoded in the loader workers (--data.decode auto): %s needs PIL images", policy)
            return "cpu"
        return "auto"
    return "cpu"


def prepare_data(cfg: Config) -> "tuple[Union[Dataset, ShardSet], Union[Dataset, ShardSet], DataInfo]":
    """(train set, val set, DataInfo); a missing data set is fetched first where --download says so."""
    fetch = getattr(dataset_factory(cfg.data.dataset), "download", None)
    if cfg.data.download and fetch is not None:
        # Horovod: one download per host, into the shared --data-dir; the other ranks on the host wait for it.
        hvd_utils.run_on_local_root(lambda: fetch(cfg.data.data_dir), f"downloading {cfg.data.dataset}")
    return build_datasets(cfg.data, cfg.run.seed, Augmentation.from_config(cfg.aug))


def check_choices(cfg: Config) -> None:
    """Unknown names, plug-ins that do not import and impossible combinations fail here, before any rank starts
    Horovod."""
    model_factory(cfg)
    task = build_task(cfg)
    percent = getattr(task.task, "percent", ())
    if cfg.run.stop_at > 100 and task.best_mode == "max" and task.best_metric.split("_", 1)[1] in percent:
        raise ConfigError(f"run.stop_at (--stop-at)={cfg.run.stop_at:g}: {task.best_metric} is a percentage, so it "
                          f"can never reach {cfg.run.stop_at:g}; give a target of 100 or less (98: stop at 98%)")
    check_regularisation(cfg, task)
    dataset_factory(cfg.data.dataset)
    if not is_import_path(cfg.data.dataset) and cfg.data.args:
        raise ConfigError(f"data.args (--data-args) is for your own data set factory (--dataset "
                          f"package.module:name); {cfg.data.dataset} takes its settings from the data.* fields")
    check_data_settings_apply(cfg.data, cfg.benchmark.enabled)
    # Data sets that live in files need --data-dir to be a directory (or absent, to be downloaded into).
    if cfg.data.dataset in data.FROM_FILES and \
            os.path.exists(cfg.data.data_dir) and not os.path.isdir(cfg.data.data_dir):
        later = " (or will, with --download)" if cfg.data.download else ""
        raise ConfigError(f"--data-dir {cfg.data.data_dir}: is a file, not a directory; give the directory that "
                          f"holds the {cfg.data.dataset} data set{later}")
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no GPU is visible to this process (torch.cuda.is_available() is False); "
                          "check CUDA_VISIBLE_DEVICES and the driver, or use --device cpu")
    if cfg.optim.amp == "fp16" and not torch.cuda.is_available():
        raise ConfigError("--amp fp16 needs a GPU (no CUDA device is visible); use --amp bf16 on the CPU")
    if cfg.model.compile and (cfg.run.device == "cpu" or not torch.cuda.is_available()) and not cpp_compiler():
        raise ConfigError(f"--compile on the CPU needs a C++ compiler (torch.compile turns the model into C++ and "
                          f"builds it), and {os.environ.get('CXX') or 'g++'} is not on PATH; install g++ "
                          f"(apt-get install g++) or point CXX at one, or leave out --compile")
    tracked = [flag for flag, on in (("--mlflow", cfg.logging.mlflow or cfg.logging.mlflow_uri),
                                     ("--wandb", cfg.logging.wandb)) if on]
    if cfg.horovod.elastic and tracked:
        raise ConfigError(f"{tracked[0]} with --elastic: not supported yet (the rank that logs can change at each "
                          f"reset); track the run's metrics.jsonl, or train on a fixed set of ranks")
    if cfg.horovod.sync_bn and not torch.cuda.is_available():
        raise ConfigError("--sync-bn needs GPUs: Horovod's SyncBatchNorm works on CUDA tensors only (no CUDA "
                          "device is visible). On the CPU, leave it off: BatchNorm statistics are averaged over "
                          "the ranks after every epoch anyway")


def check_regularisation(cfg: Config, task: tasks.RunTask) -> None:
    """The optimizer and augmentation names are ones timm knows; mixup, CutMix, label smoothing and --bce-loss
    change a classifier's targets, so they need the classification task."""
    try:
        check_policy(cfg.aug.aa)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.optim.optimizer not in OPTIMIZERS:
        from timm.optim import list_optimizers

        if cfg.optim.optimizer not in list_optimizers():
            raise ConfigError(f"optim.optimizer (--opt)={cfg.optim.optimizer!r}: neither torch's "
                              f"({', '.join(OPTIMIZERS)}) nor one of timm's; timm has: {', '.join(list_optimizers())}")
    targets = [flag for flag, on in (("--mixup", cfg.aug.mixup), ("--cutmix", cfg.aug.cutmix),
                                     ("--smoothing", cfg.aug.smoothing), ("--bce-loss", cfg.aug.bce_loss)) if on]
    if targets and task.name != "classification":
        raise ConfigError(f"{targets[0]} changes a classifier's targets, and the task is {task.name}; use it with "
                          f"--task classification, or leave it out")


# data.* settings that one data set reads and the others ignore; the loader reads shuffle_buffer for tar shards.
DATA_SET_SETTINGS = ("train_shards", "val_shards", "shard_index", "skip_bad_files", "synthetic_samples",
                     "synthetic_channels", "synthetic_classes")
READ_BY_SHARDS = ("shuffle_buffer",)


def check_data_settings_apply(dc: "DataConfig", benchmark: bool = False) -> None:
    """A data.* setting given for a data set that does not read it is refused: the run would silently train on
    something else (tar shards named, the digits trained). The rule: a setting a data set's factory does not name is
    refused when it differs from its default; settings every data set shares (data_dir, workers, ...) are not."""
    factory = dataset_factory(dc.dataset)
    defaults = {f.name: f.default for f in dataclasses.fields(dc)}
    for name in DATA_SET_SETTINGS + READ_BY_SHARDS:
        if benchmark and name.startswith("synthetic_"):  # --benchmark's random batch is made from them
            continue
        value = getattr(dc, name)
        reader = "train_shards" if name in READ_BY_SHARDS else name
        if value == defaults[name] or accepts(factory, reader):
            continue
        readers = [n for n, f in data.DATASETS.items() if accepts(f, reader)]
        raise ConfigError(f"--data.{name}={value!r} does not apply to --dataset {dc.dataset}, which does not read "
                          f"it (it is read by --dataset {' or '.join(readers)}); leave it out, or choose that data "
                          f"set")


def accepts(factory: Callable[..., Any], name: str) -> bool:
    """Whether a data set factory is given the setting `name`: it names it, or takes any keyword argument."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def cpp_compiler() -> Optional[str]:
    """The C++ compiler TorchInductor calls for CPU code (CXX, else g++), if it is on PATH."""
    return shutil.which(os.environ.get("CXX") or "g++")


def check_shards(num_train: int, world_size: int, batch_per_step: int) -> None:
    """Every rank needs samples of its own, and at least one full batch of them."""
    if num_train < world_size:
        raise ConfigError(f"{num_train} training sample(s) cannot be shared by {world_size} ranks: use fewer ranks "
                          f"or more data")
    shard = -(-num_train // world_size)  # DistributedSampler's shard size, padding included
    if batch_per_step > shard:
        raise ConfigError(f"a step takes {batch_per_step} samples per rank (--batch-size x --batches-per-allreduce) "
                          f"but each of the {world_size} ranks holds only {shard} of the {num_train} training "
                          f"samples; lower --batch-size or use fewer ranks")
