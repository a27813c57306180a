"""The data sets --dataset names, and the loaders that deal them out among the ranks.

build_datasets() calls the factory --dataset names (one that ships, data/catalog.py, or the user's
package.module:name) with the settings it names and --data-args, holds out a validation split where the data set
has none of its own (the same cut on every rank), and describes the data for the model and the run in a DataInfo.
build_loaders() gives each rank its share: a map-style data set through a DistributedSampler, each training sample's
random transforms seeded by (seed, epoch, index) (data/augment.py), validation with no sample repeated
(data/samplers.py); tar shards through a loader of their own (data/shards.py). continue_epoch() resumes an epoch
that a checkpoint was taken within. No Horovod here: ranks are arguments.
"""
import dataclasses
import functools
import multiprocessing
import os
import sys
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, NoReturn, Optional, Sequence, Union, cast

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Subset, default_collate

from hvd_train.data import shards
from hvd_train.data.augment import SeededBatches, SeededSamples, seeded
from hvd_train.data.catalog import CHOICES, DATASETS, FROM_FILES, IMAGE_FACTS, find_dataset, native_size
from hvd_train.data.images import PhotoTransform, Preprocessing, class_names, collate_encoded, on_device
from hvd_train.data.samplers import ShardSampler, rest_of_epoch, split_indices
from hvd_train.data.shards import ShardSet, check_plan
from hvd_train.data.workers import stop_signals_from
from hvd_train.errors import BadSampleError, ConfigError, DataError
from hvd_train.registry import arguments, resolve, takes

if TYPE_CHECKING:
    from typing import TypeGuard

    from torch.utils.data import Dataset, Sampler

    from hvd_train.config import DataConfig
    from hvd_train.data.augment import Augmentation

__all__ = ["CHOICES", "DATASETS", "FROM_FILES",
           "BadSampleError", "DataError", "DataInfo", "LoaderSpec", "build_loaders",
           "check_world", "continue_epoch", "datasets_from", "find_dataset", "is_streamed", "native_size"]


@dataclass
class DataInfo:
    """What the model and the run need to know about the data. None: the data set does not say (non-image data)."""
    in_channels: Optional[int]
    num_classes: Optional[int]
    image_size: Optional[int]
    num_train: int
    num_val: int
    extra: dict = field(default_factory=dict)  # a user's data set's other facts (vocab_size, block_size, ...)
    classes: Optional[list] = None  # the classes' names in label order, where the data set knows them
    preprocessing: Optional[Preprocessing] = None  # how an image file becomes a validation sample (predict, exports)
    # (samples=1) -> the first training samples as a batch, as the loader collates them (their structure and
    # shapes): what lazy modules are materialised from and a task's figures are tried on. Not a fact: never stored.
    example: Optional[Callable] = field(default=None, repr=False, compare=False)
    # Facts a factory gets only where it names them as a parameter, never through **kwargs: those a shard index
    # (a file, and data) holds for a user's data set, so a timm model cannot be made to read a file or grow by them.
    by_name_only: tuple = ()
    # The keyword arguments the data set's factory was called with (hvd_train/registry.py; None: not built by
    # it), for the setup's log line. Not a fact: never stored.
    called_with: Optional[dict] = field(default=None, repr=False, compare=False)

    def facts(self) -> dict[str, Any]:
        """The facts a model factory may name as parameters: the known image facts and the extra ones."""
        known = {name: getattr(self, name) for name in IMAGE_FACTS if getattr(self, name) is not None}
        return {**known, **self.extra}


@dataclass
class LoaderSpec:
    batch_size: int           # samples per rank per step
    seed: int                 # the shuffle's seed, the same on every rank
    workers: int = 0          # DataLoader worker processes per rank
    pin_memory: bool = False  # page-locked batches (GPUs)
    image_size: int = 0       # tar shards: the size images are brought to (0: the index's)
    shuffle_buffer: int = 1000  # tar shards: samples held to shuffle the stream
    drop_last: bool = False   # training: drop each rank's last incomplete batch (--data.drop_last)
    decode: str = "cpu"       # photos: "cpu" in the workers, "gpu" on the device, "auto": gpu where they are photos


def _held_out(train: "Dataset", val: "Dataset", presplit: bool, dc: "DataConfig",
              where: str) -> "tuple[Dataset, Dataset]":
    """The two sets as given where the data set has its own split; else train's and val's views of the same samples
    cut by dc.val_fraction and dc.split_seed (the same cut on every rank). Both must be non-empty."""
    if not presplit:
        train_idx, val_idx = split_indices(len(train), dc.val_fraction, dc.split_seed)
        train, val = Subset(train, train_idx), Subset(val, val_idx)
    if len(train) == 0 or len(val) == 0:
        raise DataError(f"data set {dc.dataset!r}{where} has {len(train)} training and {len(val)} validation "
                        f"samples; both must be non-empty")
    return train, val


def datasets_from(train: "Union[Dataset, ShardSet]", val: "Union[Dataset, ShardSet, None]",
                  facts: Mapping[str, Any], dc: "DataConfig", where: str = ""
                  ) -> "tuple[Union[Dataset, ShardSet], Union[Dataset, ShardSet], DataInfo]":
    """(train, val, DataInfo) from what a data set factory returned, the ones that ship as a user's. Without a
    validation set, or with the fact held_out (val holds the training samples with evaluation transforms), the
    samples are cut by data.val_fraction and data.split_seed, the same cut on every rank."""
    facts = dict(facts)
    held_out = val is None or bool(facts.pop("held_out", False))
    train, val = _held_out(train, train if val is None else val, not held_out, dc, where)
    # Not for the model factory: what predict and the exports need to feed the model image files.
    named, recorded = class_names(dc.dataset, val, facts), facts.pop("preprocessing", None)
    facts.pop("classes", None)
    image = [facts.pop(name, None) for name in IMAGE_FACTS]
    from_file = tuple(train.facts.get("extra") or {}) if is_streamed(train) else ()
    # The ignore: mypy does not count the three image facts the list spreads into DataInfo's first fields
    return train, val, DataInfo(  # type: ignore[call-arg, misc]
        *image, len(train), len(val), extra=facts, classes=named, by_name_only=from_file,
        preprocessing=_preprocessing(recorded, image, dc), example=functools.partial(example_batch, train, val, image))


def example_batch(train: "Union[Dataset, ShardSet]", val: "Union[Dataset, ShardSet]", image: Sequence[Optional[int]],
                  samples: int = 1) -> Any:
    """The first `samples` training samples (as many as there are) collated into a batch, drawn from generators
    seeded for them and put back after, so a peek changes no later draw. A stream (tar shards) has no first sample
    to index: blank images of its size and class 0, which is what a shard's image collates to, or a user's samples
    as the first validation shard holds them."""
    if is_streamed(train):
        if train.facts.get("transform") == "samples":
            return shards.first_batch(val, None, samples)
        channels, _, size = image
        return [torch.zeros(samples, channels, size, size), torch.zeros(samples, dtype=torch.long)]
    return default_collate([SeededSamples(train)[(i, 0)] for i in range(min(samples, len(train)))])


def _preprocessing(recorded: Union[Preprocessing, Mapping[str, Any], None], image: Sequence[Optional[int]],
                   dc: "DataConfig") -> Optional[Preprocessing]:
    """A factory's preprocessing: a Preprocessing (the data sets that ship) or a dict of its fields (a user's)."""
    if recorded is None or isinstance(recorded, Preprocessing):
        return recorded
    try:
        return Preprocessing.from_dict({"channels": image[0], "image_size": image[2], **recorded})
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"--dataset={dc.dataset!r}: its facts' 'preprocessing' {recorded!r} is not usable ({e}); "
                        f"give channels, image_size, mean, std and resize (stretch or center_crop)") from None


def _worker_context(workers: int) -> Optional[str]:
    # forkserver: worker processes do not inherit the parent's threads and network state by fork, which some
    # InfiniBand and MPI stacks do not survive. Falls back to the platform default where it is missing.
    if workers == 0:
        return None
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    # The server's default preload, __main__, never takes (Python 3.11 hands it no path to import), so each worker
    # imported torch, Horovod and the app's modules itself when it ran the main script again: about 3 s of CPU a
    # worker, four workers a rank. The server imports them once instead and forks its workers with them loaded.
    # Only modules this process has imported already: each is known to import cleanly here.
    multiprocessing.set_forkserver_preload(_imported_by_main() + [m for m in WORKER_MODULES if m in sys.modules])
    return "forkserver"


# What a worker needs to unpickle the data sets and run their transforms, besides what the main script imports.
WORKER_MODULES = ("hvd_train.data", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.io",
                  "timm.data", "PIL.Image", "numpy")


def _imported_by_main() -> list[str]:
    main = sys.modules.get("__main__")
    return [v.__name__ for v in vars(main).values() if isinstance(v, types.ModuleType)] if main else []


def build_loaders(train_set: "Union[Dataset, ShardSet]", val_set: "Union[Dataset, ShardSet]", spec: LoaderSpec,
                  rank: int, world_size: int, train_sampler: "Optional[Sampler[int]]" = None
                  ) -> ("tuple[Union[DataLoader, shards.ShardLoader], Union[DataLoader, shards.ShardLoader], "
                        "Union[Sampler[int], shards.ShardLoader]]"):
    """Training shards reshuffled each epoch (call train_sampler.set_epoch), validation shards with no repeats.

    train_sampler replaces the DistributedSampler (elastic runs pass Horovod's ElasticSampler). For tar shards
    the training loader is its own sampler: it plans each epoch when told which it is.
    """
    if is_streamed(train_set):
        return shard_loaders(train_set, val_set, spec, rank, world_size)
    # Horovod: each rank reads its own 1/world_size of the training set; the shared seed makes the shuffles agree.
    if train_sampler is None:
        train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                           seed=spec.seed)
    val_sampler = ShardSampler(len(val_set), rank, world_size)
    # Each loader draws its workers' base seed from a generator of its own: from torch's global one it would move
    # the training process's stream (dropout) by a draw whenever persistent workers start, which a resumed run does
    # at another epoch than the run it continues. Seeded by seed + rank, so each rank's workers draw their own
    # streams (torch seeds worker w's torch, random and NumPy from that base + w); the shuffle's seed stays shared.
    common = dict(num_workers=spec.workers, pin_memory=spec.pin_memory, persistent_workers=spec.workers > 0,
                  multiprocessing_context=_worker_context(spec.workers), worker_init_fn=stop_signals_from(os.getpid()),
                  generator=torch.Generator().manual_seed(spec.seed + rank))
    # Each training sample's random transforms are seeded from (seed, epoch, index): the same with any number of
    # workers and after a resume (data/augment.py).
    train_set, val_set, collate = decoded_where(train_set, val_set, spec)
    train_loader = DataLoader(SeededSamples(train_set),
                              batch_sampler=SeededBatches(train_sampler, spec.batch_size, spec.seed, spec.drop_last),
                              collate_fn=collate, **common)
    val_loader = DataLoader(val_set, sampler=val_sampler, batch_size=spec.batch_size, collate_fn=collate, **common)
    return train_loader, val_loader, train_sampler


def decoded_where(train_set: "Dataset", val_set: "Dataset", spec: LoaderSpec
                  ) -> "tuple[Dataset, Dataset, Optional[Callable[..., Any]]]":
    """(train, val, collate): the sets as they are, or with their photos left for the device to decode where
    spec.decode says so (data/images.py); data that are not photos are refused for "gpu"."""
    if spec.decode == "cpu":
        return train_set, val_set, None
    views = on_device(train_set), on_device(val_set)
    if None in views:
        if spec.decode == "gpu":
            refuse_gpu_decode("this data set's samples")
        return train_set, val_set, None
    return views[0], views[1], collate_encoded


def refuse_gpu_decode(samples: str) -> NoReturn:
    raise DataError(f"data.decode (--data.decode)=gpu decodes photos (image folders and their tar shards); {samples} "
                    f"are not photos: pass --data.decode cpu or auto")


def shard_loaders(train_set: ShardSet, val_set: ShardSet, spec: LoaderSpec, rank: int,
                  world_size: int) -> "tuple[shards.ShardLoader, shards.ShardLoader, shards.ShardLoader]":
    size = spec.image_size or train_set.facts.get("image_size")
    place = shards.Place(spec.seed, rank, world_size, spec.workers, spec.batch_size)
    # The casts: a size that is None (the index states none) only for a user's samples, which take no transform; both
    # splits' transforms are of one kind, from one index.
    transforms = [shards.transform_for(split.facts, cast(int, size), split.train, split.augment) for split in (
        train_set, val_set)]
    if spec.decode != "cpu":
        if isinstance(transforms[0], PhotoTransform):
            transforms = [cast(PhotoTransform, transform).on_device() for transform in transforms]
        elif spec.decode == "gpu":
            refuse_gpu_decode(f"these shards of {train_set.facts.get('source', 'other samples')}")
    loaders = [shards.ShardLoader(split, spec, place, transform, _worker_context(spec.workers))
               for split, transform in zip((train_set, val_set), transforms)]
    return loaders[0], loaders[1], loaders[0]


def is_streamed(train_set: object) -> "TypeGuard[ShardSet]":
    return isinstance(train_set, ShardSet)


def check_world(train_set: ShardSet, world_size: int, spec: LoaderSpec) -> None:
    """Tar shards: every rank needs whole shards of its own and a full batch from them (data/shards.py)."""
    check_plan(train_set, world_size, spec.batch_size, spec.workers, seed=spec.seed)


def continue_epoch(train_loader: "Union[DataLoader, shards.ShardLoader]", position: Mapping[str, Any], rank: int,
                   world_size: int) -> tuple[str, bool]:
    """Make the training loader read the rest of an epoch that a checkpoint was taken within. position: the
    checkpoint's (hvd_train/run/checkpoint.py): epoch, steps done, world_size, samples_per_rank, workers. Returns a
    sentence for the log, and whether the epoch continues (False: it starts over, for tar shards whose plan was
    made for another number of ranks, workers or batch size)."""
    epoch, steps = position["epoch"], position["steps"]
    if isinstance(train_loader, shards.ShardLoader):
        if train_loader.continue_epoch(epoch, steps, position):
            return f"epoch {epoch} continues after its step {steps}, as the shards' plan was", True
        return (f"epoch {epoch} starts over: its shards were planned for {position['world_size']} rank(s) with "
                f"{position['workers']} loader worker(s) and batch {position['samples_per_rank'] // max(1, steps)}, "
                f"this run differs (the {steps} step(s) of it done stay in the weights)"), False
    batches = train_loader.batch_sampler
    sampler = batches.sampler
    rest = rest_of_epoch(sampler.dataset, sampler.seed, epoch, position["world_size"], position["samples_per_rank"],
                         rank, world_size)
    batches.resume(epoch, rest)
    if position["world_size"] == world_size:
        return f"epoch {epoch} continues after its step {steps}, each rank where it was", True
    return (f"epoch {epoch} continues after its step {steps}: the samples it had not trained, dealt out anew "
            f"among {world_size} rank(s) (none read twice)"), True


def dataset_factory(name: str) -> Callable[..., Any]:
    """The factory --dataset names: one that ships (data/catalog.py) or the user's package.module:name."""
    return resolve(name, find_dataset, "--dataset", CHOICES)


def dataset_settings(dc: "DataConfig", seed: int, augment: "Optional[Augmentation]" = None) -> dict[str, Any]:
    """What a data set factory may name as parameters: the data.* settings (image_size only where it is set, so that
    the factory's default, the data set's own size, applies otherwise), the run's seed and, for training, the
    augmentation (a data.augment.Augmentation; without one the factory's default, none, applies)."""
    settings = {f.name: getattr(dc, f.name) for f in dataclasses.fields(dc) if f.name not in ("dataset", "args")}
    if not dc.image_size:
        del settings["image_size"]
    if augment is not None:
        settings["augment"] = augment
    return {**settings, "seed": seed}


def build_datasets(dc: "DataConfig", seed: int = 0, augment: "Optional[Augmentation]" = None
                   ) -> "tuple[Union[Dataset, ShardSet], Union[Dataset, ShardSet], DataInfo]":
    """The factory --dataset names, called with the settings it names and --data-args; it returns (train, val) or
    (train, val, facts), val None for the app's split. augment: the training run's Augmentation (tools that read a
    data set, such as hvd-train shard, pass none and get the samples as they are)."""
    name, factory = dc.dataset, dataset_factory(dc.dataset)
    kwargs = arguments(factory, dataset_settings(dc, seed, augment), dc.args, "--data-args", name)
    # Every rank makes the same data: a factory that draws from Python's, NumPy's or torch's global generator
    # draws from them seeded with the shared seed, not each rank's own (seed + rank), which continues after it.
    with seeded(seed):
        made = factory(**kwargs)
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 3) or \
            (len(made) == 3 and not isinstance(made[2], dict)):
        raise ConfigError(f"--dataset={name!r}: the factory must return (train, val) or (train, val, facts) with "
                          f"facts a dict such as {{'num_classes': 10}}; it returned {_describe(made)}")
    for split, dataset in zip(("training", "validation"), made[:2]):
        if (split == "validation" and dataset is None) or is_streamed(dataset):
            continue  # the app splits the training set; tar shards are planned by data/shards.py
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") or \
                not hasattr(dataset, "__getitem__"):
            raise ConfigError(f"--dataset={name!r}: the {split} set ({type(dataset).__name__}) has no __len__ and "
                              f"__getitem__: hvd-train shards a data set by index (DistributedSampler), so it must "
                              f"be map-style; wrap a stream in a map-style Dataset, or shard its files yourself")
    where = f" in {dc.data_dir}" if takes(factory, "data_dir") else ""
    train, val, info = datasets_from(made[0], made[1], made[2] if len(made) == 3 else {}, dc, where)
    info.called_with = kwargs  # what the setup's data line shows (hvd_train/run/reports.py)
    return train, val, info


def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"
