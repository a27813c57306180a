"""The builders behind the steps of a run (hvd_train/training.py composes them): the data sets, the model and its task,
the optimizer, the batch arithmetic (the settings' checks are in hvd_train/checks.py). Each mode calls only those it
uses (evaluation builds no optimizer)."""
import logging

import torch
from torch import nn
from torch.nn.parameter import is_lazy

import hvd_utils
from hvd_train.data import LoaderSpec
from hvd_train import tasks
from hvd_train.datasets import build_datasets, dataset_factory
from hvd_train.feed import Feed, image_figures
from hvd_train.config import OPTIMIZERS
from hvd_train.errors import ConfigError
from hvd_train.plugins import call, is_import_path, resolve, takes
from hvd_train.profiling import StepProfiler
from hvd_train.run_task import samples_in
from hvd_train.data.augment import Augmentation, generators_kept
from hvd_train.schedule import batching
from hvd_train.weights import load_matching
from hvd_train import models

log = logging.getLogger("hvd_train")


def model_factory(cfg):
    """The factory --model names: one that ships, timm/NAME, or the user's package.module:name."""
    return resolve(cfg.model.name, models.find_model, "--model", models.CHOICES)


def build_task(cfg, info=None):
    """The task --task names (or the model's own), ready for the training loop; it gets the data's facts it names
    (info: the DataInfo, where the data is known)."""
    name = cfg.model.task or models.model_task(cfg.model.name)
    targets = {k: v for k, v in (("smoothing", cfg.aug.smoothing), ("bce_loss", cfg.aug.bce_loss)) if v}
    return tasks.build_task(resolve(name, tasks.find_task, "--task", tasks.CHOICES), name, cfg.model.task_args,
                            {**(facts_for(info, name) if info else {}), **targets}, info.by_name_only if info else ())


def facts_for(info, name):
    """The data's facts the factory `name` gets. A shard index's own facts (a file's, info.by_name_only) reach only
    a user's own factory (an import path), and it only by the names of its parameters: a factory that ships would
    take them as its width or hidden size."""
    facts = info.facts()
    return facts if is_import_path(name) else {k: v for k, v in facts.items() if k not in info.by_name_only}


def build_model_for(cfg, info, device):
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


def drop_path_args(cfg):
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


def set_grad_checkpointing(model, name):
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


def param_groups(model, weight_decay, decay_norm_and_bias=False):
    """Two groups: weights with weight decay; biases and normalization parameters (all 1-d tensors) without,
    since shrinking them toward zero only hurts (the usual practice since Goyal et al. 2017)."""
    if decay_norm_and_bias or weight_decay == 0:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model, optim_cfg, lr):
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


def timm_optimizer(model, optim_cfg, lr):
    """timm's optimizer factory: its name (sgd there means Nesterov momentum: --nesterov decides here), weight decay
    off for biases and norms unless decay_norm_and_bias, and layer-wise rate scales ("lr_scale" per group, which
    the schedule applies)."""
    from timm.optim import create_optimizer_v2

    name = {"sgd": "sgd" if optim_cfg.nesterov else "momentum"}.get(optim_cfg.optimizer, optim_cfg.optimizer)
    extra = {"momentum": optim_cfg.momentum} if name in ("sgd", "momentum", "lars", "larc") else {}
    return create_optimizer_v2(model, opt=name, lr=lr, weight_decay=optim_cfg.weight_decay,
                               filter_bias_and_bn=not optim_cfg.decay_norm_and_bias,
                               layer_decay=optim_cfg.layer_decay or None, **extra)


def try_a_sample(model, task, info, device, cfg):
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


def try_the_metrics(model, task, info, device):
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


def attach_profiler(trainer, cfg, rt, run_dir):
    """--profile: record the trainer's steps into run_dir/profile. Called once the run has claimed run_dir (a claim
    with --overwrite clears what an earlier run wrote there)."""
    if cfg.profile.enabled and trainer.profiler is None:
        trainer.profiler = StepProfiler(cfg, rt, run_dir.profile)


def load_initial_weights(cfg, model):
    """--init-from: rank 0 reads the file into its model and says what matched; an error stops every rank. The
    caller then broadcasts rank 0's weights (Horovod), so the file is read once, wherever it is."""
    if not cfg.model.init_from:
        return
    report = hvd_utils.decide_on_root(lambda: load_matching(model, cfg.model.init_from, cfg.model.init_partial),
                                      "init_from")
    for line in report.lines(cfg.model.init_from):
        log.info(line)


def loader_spec(cfg, device):
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


def decode_place(cfg, device):
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


def prepare_data(cfg):
    """(train set, val set, DataInfo); a missing data set is fetched first where --download says so."""
    fetch = getattr(dataset_factory(cfg.data.dataset), "download", None)
    if cfg.data.download and fetch is not None:
        # Horovod: one download per host, into the shared --data-dir; the other ranks on the host wait for it.
        hvd_utils.run_on_local_root(lambda: fetch(cfg.data.data_dir), f"downloading {cfg.data.dataset}")
    return build_datasets(cfg.data, cfg.run.seed, Augmentation.from_config(cfg.aug))
