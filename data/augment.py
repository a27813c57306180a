"""Training-time augmentation: the default for each kind of image data, timm's policies on top, and randomness that
is a function of (seed, epoch, sample) alone.

Kinds (which data set is which: data/catalog.py):
    natural   photos as arrays (CIFAR-10/100, STL-10, Fashion-MNIST): random crop of the image padded by 1/8 of its
              side, horizontal flip (the augmentation of the published ResNet CIFAR results)
    digits    handwriting (MNIST, the digits): a small random rotation, shift and scale; never a flip (a flipped 2 is
              no digit)
    photos    image folders and their tar shards: RandomResizedCrop and flip (data/images.py)
Validation never augments. On top of the default (and like timm's train.py, never instead of the crop): --aa
(timm's AutoAugment, RandAugment, AugMix and TrivialAugment specs) and --color-jitter on the uint8 images, through
timm's own transforms; random erasing (--reprob, --remode) works on normalized images, so it happens where they are
normalized, on the device (hvd_train/trainer.py), seeded by the step.

Why the seeding: a DataLoader worker draws from its own generator, so which random crop a sample gets depends on the
number of workers, which worker took the batch and, after a resume, on how far the workers' generators had got.
Here the sampler's epoch and each sample's index choose the seed of that sample's transforms (SeededBatches hands
(index, seed) to SeededSamples), so a run is reproducible from --seed with any number of workers, resumes bitwise,
and every epoch and every rank (which holds other samples) draws differently.
"""
import contextlib
import hashlib
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from hvd_train.config.schema import check_policy_figures

if TYPE_CHECKING:
    from PIL import Image
    from torch.utils.data import Sampler

    from hvd_train.config.schema import AugConfig

KINDS = ("natural", "digits", "photos")


@dataclass(frozen=True)
class Augmentation:
    """The augmentation settings (config section `aug`), as data set factories receive them: a factory that names a
    parameter `augment` gets this object and may call tensor_transform()/erasing() for its training samples, or
    bring its own transforms (README: Bring your own model, data and task)."""
    enabled: bool = True
    aa: str = ""                # timm's auto-augment spec: rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, original, ...
    color_jitter: float = 0.0   # brightness/contrast/saturation strength; 0: none
    reprob: float = 0.0         # random erasing probability
    remode: str = "pixel"       # random erasing fill: const, rand or pixel (timm's modes)
    recount: int = 1            # erased boxes at most per image

    @classmethod
    def from_config(cls, aug_cfg: "AugConfig") -> "Augmentation":
        """The run's augmentation. torchvision makes the transforms; in an environment without it (an install into
        an existing torch, which may lack it: scripts/install.sh names what is missing) the samples go as they
        are, and describe() says why."""
        return cls(not aug_cfg.no_aug and torchvision_installed(), aug_cfg.aa, aug_cfg.color_jitter, aug_cfg.reprob,
                   aug_cfg.remode, aug_cfg.recount)

    @property
    def extra(self) -> bool:
        """Whether anything beyond the default crop and flip is asked for (timm's policies, jitter or erasing)."""
        return bool(self.aa or self.color_jitter or self.reprob)

    def tensor_transform(self, kind: str, size: int, mean: Sequence[float],
                         std: Sequence[float]) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """For uint8 images (C, H, W): the kind's geometric default, then timm's policies; None where augmentation
        is off. Normalization and random erasing (which works on normalized images) follow on the device
        (hvd_train/trainer.py)."""
        if not self.enabled:
            return None
        from torchvision.transforms import v2 as T

        if kind == "digits":  # handwriting: rotation, shift and scale of a few percent, never a mirror image
            steps = [T.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1))]
        elif kind == "natural":
            steps = [T.RandomCrop(size, padding=max(1, size // 8)), T.RandomHorizontalFlip()]
        else:
            raise ValueError(f"unknown kind of images {kind!r}; one of {', '.join(KINDS)}")
        policy = self.pil_policy(size, mean)
        if policy is not None:
            steps.append(ThroughPIL(policy))
        return T.Compose(steps)

    def pil_policy(self, size: int, mean: Sequence[float]) -> Optional[Callable[["Image.Image"], "Image.Image"]]:
        """timm's policy (--aa) and colour jitter on a PIL image, or None where neither is asked for."""
        from torchvision import transforms as T

        steps = []
        if self.color_jitter and not self.aa:  # as in timm: a policy replaces the jitter
            steps.append(T.ColorJitter(*(self.color_jitter,) * 3))
        if self.aa:
            steps.append(auto_augment(self.aa, size, mean))
        return T.Compose(steps) if steps else None

    def erasing(self) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """timm's RandomErasing for a normalized (C, H, W) tensor, or None."""
        if not (self.enabled and self.reprob):
            return None
        from timm.data.random_erasing import RandomErasing

        return RandomErasing(self.reprob, mode=self.remode, max_count=self.recount, device="cpu")

    def describe(self, kind: str) -> str:
        """One line for the log and the summary: what training samples go through."""
        if not self.enabled:
            return "off (--no-aug)" if torchvision_installed() else "off (torchvision is not installed: pip install " \
                "torchvision for the default augmentation)"
        base = {"natural": "random crop (padding 1/8) + flip", "digits": "random affine (10 deg, 10%)",
                "photos": "RandomResizedCrop + flip", "none": "none (random data)",
                "shards": "that of the data set the shards were written from"}.get(kind, "the data set's own")
        extras = [f"aa {self.aa}" if self.aa else "", f"color jitter {self.color_jitter:g}" if self.color_jitter
                  and not self.aa else "", f"random erasing {self.reprob:g} ({self.remode})" if self.reprob else ""]
        return ", ".join([base] + [e for e in extras if e])


def torchvision_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


def auto_augment(spec: str, size: int, mean: Sequence[float]) -> Callable[["Image.Image"], "Image.Image"]:
    """timm's policy for a spec string, chosen as timm's transforms factory chooses it."""
    from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform

    fix_posterize()
    hparams = {"translate_const": int(size * 0.45), "img_mean": tuple(min(255, round(255 * m)) for m in
                                                                      _three(mean))}
    try:
        if spec.startswith("rand"):
            return rand_augment_transform(spec, hparams)
        if spec.startswith("augmix"):
            return augment_and_mix_transform(spec, {**hparams, "translate_pct": 0.3})
        return auto_augment_transform(spec, hparams)
    except (AssertionError, KeyError, ValueError, IndexError) as e:
        raise ValueError(f"aug.aa (--aa)={spec!r}: not a policy timm knows ({type(e).__name__}: {e}); e.g. "
                         f"rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, original or v0") from None


def posterize(img: "Image.Image", bits_to_keep: int, **_: Any) -> "Image.Image":
    """timm's Posterize op as Pillow before 10 ran it: timm's ops reach 0 bits at full magnitude (RandAugment's
    "inc1" policies), which gave a black image and which Pillow 10 and later refuse with a ValueError."""
    from PIL import ImageOps

    if bits_to_keep >= 8:
        return img
    if bits_to_keep < 1:
        return img.point(lambda _: 0)
    return ImageOps.posterize(img, bits_to_keep)


def fix_posterize() -> None:
    """Give timm's policies the posterize above (before they are built: each op looks its function up then)."""
    from timm.data import auto_augment

    for name in ("Posterize", "PosterizeIncreasing", "PosterizeOriginal"):
        if name in auto_augment.NAME_TO_OP:
            auto_augment.NAME_TO_OP[name] = posterize


def check_policy(spec: str) -> None:
    """Refuse an --aa spec timm cannot build, or whose figures pass their bounds, before any rank starts."""
    if not spec:
        return
    check_policy_figures(spec)  # the config's own check (a recipe is data): again for a caller without a config
    auto_augment(spec, 32, (0.5, 0.5, 0.5))


def _three(mean: Sequence[float]) -> tuple[float, ...]:
    mean = tuple(mean)
    return mean * 3 if len(mean) == 1 else mean[:3]


class ThroughPIL:
    """A PIL transform (timm's policies) applied to a uint8 (C, H, W) image, or a float one in [0, 1]; grey images
    are given three channels for it and made grey again."""

    def __init__(self, transform: Callable[["Image.Image"], "Image.Image"]) -> None:
        self.transform = transform

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        from torchvision.transforms.functional import pil_to_tensor, to_pil_image

        grey, floats = image.shape[0] == 1, image.is_floating_point()  # floats: in [0, 1] (the digits)
        pil = to_pil_image((image.clamp(0, 1) * 255).round().to(torch.uint8) if floats else image)
        out = self.transform(pil.convert("RGB") if grey else pil)
        out = pil_to_tensor(out.convert("L") if grey else out)
        return out.float() / 255.0 if floats else out


def derived_seed(*parts: object, size: int = 8) -> int:
    """A seed made from `parts` (the run's seed, an epoch, a sample or a step, ...) by a hash, so neighbouring
    parts give unrelated streams: `size` bytes of it (4 for NumPy, whose seeds are below 2**32), below 2**63."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=size).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's transforms in one epoch."""
    return derived_seed(seed, epoch, index)


class SeededBatches:
    """The batch sampler of an augmented training set: the sampler's batches of indices as (index, seed) pairs,
    the seed from the run's seed, the sampler's current epoch and the index. Read by SeededSamples. drop_last:
    the last batch is left out when it is incomplete (the sampler gives every rank as many samples, so every rank
    still runs as many steps)."""
    rest: Optional[tuple[int, list[int]]]

    def __init__(self, sampler: "Sampler[int]", batch_size: int, seed: int, drop_last: bool = False) -> None:
        self.sampler, self.batch_size, self.seed, self.drop_last = sampler, batch_size, seed, drop_last
        self.rest = None  # (epoch, indices): what a run resumed within `epoch` reads of it (resume())

    def resume(self, epoch: int, indices: Iterable[int]) -> None:
        """Epoch `epoch` reads `indices` (this rank's rest of an epoch a run was checkpointed in) instead of the
        sampler's whole shard; later epochs read the sampler's again. The batches left out are never made, so
        their samples are neither loaded nor transformed."""
        self.rest = (epoch, list(indices))

    def _indices(self) -> tuple[int, Union["Sampler[int]", list[int]]]:
        epoch = getattr(self.sampler, "epoch", 0)  # DistributedSampler's and Horovod's ElasticSampler's
        if self.rest is not None and self.rest[0] == epoch:
            return epoch, self.rest[1]
        return epoch, self.sampler

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, indices = self._indices()
        batch = []
        for index in indices:
            batch.append((index, sample_seed(self.seed, epoch, index)))
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        count = len(self._indices()[1])
        if self.drop_last:
            return count // self.batch_size
        return -(-count // self.batch_size)


class SeededSamples(Dataset):
    """A training set whose sample `(index, seed)` is drawn with torch's, Python's and NumPy's generators seeded by
    `seed` (the transforms of torchvision and timm use all three). In the training process itself (no loader
    workers) the generators are put back afterwards, so dropout and mixup draw as they would without it."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Union[int, tuple[int, int]]) -> Any:
        if not isinstance(key, tuple):  # plain index (a peek at a sample outside the loader)
            return self.dataset[key]
        index, seed = key
        if torch.utils.data.get_worker_info() is not None:  # a loader worker: nothing else draws there
            seed_all(seed)
            return self.dataset[index]
        with seeded(seed):
            return self.dataset[index]


@contextlib.contextmanager
def generators_kept() -> Iterator[None]:
    """Python's, NumPy's and torch's CPU generators as they were before the block, whatever it draws."""
    python, numpy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """The block draws from every generator seed_all seeds, seeded with `seed`; they are put back after."""
    with generators_kept():
        seed_all(seed)
        yield


def seed_all(seed: int) -> None:
    """Seed torch's CPU generator, Python's and NumPy's (NumPy's takes 32 bits) from one seed: the generators the
    transforms draw from. Not torch.manual_seed, which also queues a seed for every GPU, with a traceback of the
    call, until CUDA starts: a millisecond a sample, most of the time of a small image's transforms."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
