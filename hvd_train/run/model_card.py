"""What rebuilds a trained model and feeds it outside the app: recorded in every checkpoint (its "model_card" key)
and written beside every export as JSON.

    model, model_args   the factory (--model: a name that ships or package.module:name) and its --model-args
    facts               the data set's facts the factory was called with (in_channels, num_classes, image_size, ...)
    task                classification, vae or the user's task
    classes             the classes' names in label order (null where the data set does not know them)
    preprocessing       how an image file becomes an input (data/images.py; null for data that is not images)
    weights             which weights the file offers: "model", or "ema" (--model-ema: the average validated better)
"""
import itertools
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch
from torch.nn.parameter import is_lazy

from hvd_train import models
from hvd_train.data.catalog import IMAGE_FACTS
from hvd_train.data.images import CLASS_NAMES, Preprocessing, of_builtin
from hvd_train.errors import CheckpointError, ConfigError, redact_values
from hvd_train.provenance import RecordError, plain, refuse_code_from
from hvd_train.registry import call, resolve

if TYPE_CHECKING:
    from hvd_train.config import Config
    from hvd_train.data import DataInfo
    from hvd_train.tasks import RunTask

# A model rebuilt from a card takes at most this many bytes per byte of the file holding its weights, plus the slack:
# its parameters and persistent buffers are in the file, and what it computes besides (non-persistent buffers)
# stays small for every model that ships.
MODEL_BYTES_PER_FILE_BYTE = 2
MODEL_BYTES_SLACK = 64 * 2**20


@dataclass
class ModelCard:
    model: str
    model_args: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)
    task: str = "classification"
    classes: Optional[list] = None
    preprocessing: Optional[dict] = None
    weights: str = "model"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> "ModelCard":
        try:  # the gate (hvd_train/provenance.py): a card is plain data of bounded size, read from a file
            plain(d, where, depth=16)
        except RecordError as e:
            raise CheckpointError(f"{e}; it is not a model card hvd-train wrote") from None
        try:
            card = cls(**{k: d[k] for k in ("model", "model_args", "facts", "task", "classes", "preprocessing")},
                       weights=d.get("weights", "model"))
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{where}: not a model card hvd-train wrote (missing {e}); export the checkpoint "
                                  f"again with hvd-train export") from None
        kinds: dict[str, Union[type, tuple[type, ...]]] = {
            "model": str, "model_args": dict, "facts": dict, "task": str, "classes": (list, type(None)),
            "preprocessing": (dict, type(None))}
        wrong = [k for k, kind in kinds.items() if not isinstance(getattr(card, k), kind)]
        wrong += ["weights"] if card.weights not in ("model", "ema") else []
        if wrong:
            raise CheckpointError(f"{where}: not a model card hvd-train wrote ({wrong[0]} is a "
                                  f"{type(getattr(card, wrong[0])).__name__})")
        return card

    def check_code(self, where: str, trusted: bool) -> None:
        """Refuse a card that names code (an import path for the model or task, file-reading model arguments or
        facts) unless the user passed --trust-code: a card is read from a file that may come from anyone."""
        refuse_code_from({"model": {"name": self.model, "task": self.task, "args": self.model_args,
                                    "facts": self.facts}}, where, trusted)

    def build(self, shapes: dict[str, Sequence[int]], file_bytes: int,
              trusted: bool = False) -> torch.nn.Module:
        """The model, freshly initialised on the CPU in eval mode (load its weights next). `shapes`: {name: shape}
        of the weights the file of `file_bytes` bytes holds. The model is built on PyTorch's meta device first: it
        must have exactly those weights, and its parameters and buffers (persistent or not: a buffer the model
        computes, such as an attention window's index, is in no file) must fit in MODEL_BYTES_PER_FILE_BYTE times
        the file plus MODEL_BYTES_SLACK, so a card cannot make it allocate more than its file holds. trusted
        (--trust-code) lifts the size bound and lets a factory that cannot build on the meta device build."""
        factory = resolve(self.model, models.find_model, "the model", models.CHOICES)
        # A card is a file: its facts beyond the image's reach a factory only where it names them (never its
        # **kwargs), unless the user trusts the file.
        named_only = () if trusted else tuple(k for k in self.facts if k not in IMAGE_FACTS)
        try:
            with torch.device("meta"):
                planned = call(factory, self.facts, self.model_args, "the model's arguments", self.model, named_only)
        except ConfigError:
            raise
        except Exception as e:
            if not trusted:
                raise CheckpointError(f"the model its card describes ({self.model}) cannot be built on PyTorch's "
                                      f"meta device ({type(e).__name__}), so its size cannot be checked against its "
                                      f"file's before it allocates; if you trust this file, pass --trust-code") \
                    from None
            planned = None
        if planned is not None:
            self._check_planned(planned, shapes, file_bytes, trusted)
        model = call(factory, self.facts, self.model_args, "the model's arguments", self.model, named_only)
        return model.eval()

    def _check_planned(self, planned: torch.nn.Module, shapes: dict[str, Sequence[int]], file_bytes: int,
                       trusted: bool) -> None:
        # A lazy module's parameters have no shape until they are loaded: they take the file's.
        wanted = {k: tuple(shapes.get(k, ())) if is_lazy(v) else tuple(v.shape)
                  for k, v in planned.state_dict().items()}
        arguments = self.model_args or "no arguments"
        if wanted != {k: tuple(v) for k, v in shapes.items()}:
            extra = sorted(set(wanted) ^ set(shapes)) or [k for k in wanted if wanted[k] != tuple(shapes[k])]
            raise CheckpointError(f"the model its card describes ({self.model} with {arguments}) does not have "
                                  f"the weights the file holds (first difference: {extra[0]}); the card does not "
                                  f"belong to these weights")
        tensors = itertools.chain(planned.parameters(), planned.buffers())
        size = sum(t.numel() * t.element_size() for t in tensors if not is_lazy(t))
        bound = MODEL_BYTES_PER_FILE_BYTE * file_bytes + MODEL_BYTES_SLACK
        if size > bound and not trusted:
            raise CheckpointError(f"the model its card describes ({self.model} with {arguments}) would take "
                                  f"{size / 2**20:,.0f} MiB in parameters and buffers, more than "
                                  f"{MODEL_BYTES_PER_FILE_BYTE} times its {file_bytes / 2**20:,.1f} MiB file plus "
                                  f"{MODEL_BYTES_SLACK // 2**20} MiB: the card does not belong to these weights (if "
                                  f"you trust this file, pass --trust-code)")

    def prepare(self) -> Preprocessing:
        """The Preprocessing of image files for this model; refused where the data was not images."""
        if not self.preprocessing:
            raise CheckpointError(f"the model {self.model} was trained on data that records no image preprocessing "
                                  f"(synthetic data, or your own data set without a 'preprocessing' fact), so image "
                                  f"files cannot be fed to it; docs/after-training.md")
        try:
            return Preprocessing.from_dict(self.preprocessing)
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"the model card's preprocessing cannot be used: {e}") from None

    def class_name(self, index: int) -> str:
        return self.classes[index] if self.classes and index < len(self.classes) else str(index)


def card_for(cfg: "Config", info: "DataInfo", task: "RunTask") -> ModelCard:
    """The card of a model trained with `cfg` on data `info` for `task`."""
    # Stored in every checkpoint and export: through the one redactor, as config.json is.
    return ModelCard(cfg.model.name, redact_values(dict(cfg.model.args)), redact_values(info.facts()), task.name,
                     info.classes, info.preprocessing.to_dict() if info.preprocessing else None)


def card_of_checkpoint(ckpt: dict[str, Any], where: str) -> ModelCard:
    """The card a checkpoint records; for a checkpoint written before cards existed, the one its config and fields
    imply (the preprocessing of the data sets that ship follows from the data set's name)."""
    if isinstance(ckpt.get("model_card"), dict):
        return ModelCard.from_dict(ckpt["model_card"], where)
    config = ckpt.get("config") or {}
    facts = {k: ckpt[k] for k in ("in_channels", "num_classes", "image_size") if ckpt.get(k) is not None}
    dataset = config.get("data", {}).get("dataset", "")
    preprocessing = of_builtin(dataset, facts.get("image_size", 0)) if facts.get("image_size") else None
    return ModelCard(ckpt.get("model_name") or config.get("model", {}).get("name", "?"),
                     config.get("model", {}).get("args", {}), facts, ckpt.get("task", "classification"),
                     list(CLASS_NAMES[dataset]) if dataset in CLASS_NAMES else None,
                     preprocessing.to_dict() if preprocessing else None)
