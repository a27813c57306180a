"""The checks of the settings that need more than the config alone (a model's factory, a data set's, the machine):
each refusal is one ConfigError naming the value, why and what to give instead, raised before any rank starts
Horovod or reads a file."""
import dataclasses
import inspect
import os
import shutil

import torch

from hvd_train import data
from hvd_train.build import build_task, model_factory
from hvd_train.config import OPTIMIZERS
from hvd_train.data.augment import check_policy
from hvd_train.datasets import dataset_factory
from hvd_train.errors import ConfigError
from hvd_train.plugins import is_import_path


def check_choices(cfg):
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


def check_regularisation(cfg, task):
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


def check_data_settings_apply(dc, benchmark=False):
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


def accepts(factory, name):
    """Whether a data set factory is given the setting `name`: it names it, or takes any keyword argument."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def cpp_compiler():
    """The C++ compiler TorchInductor calls for CPU code (CXX, else g++), if it is on PATH."""
    return shutil.which(os.environ.get("CXX") or "g++")


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
