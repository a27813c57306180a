"""What rebuilds a trained model and feeds it outside the app: recorded in every checkpoint (its "model_card" key)
and written beside every export as JSON.

    model, model_args   the factory (--model: a name that ships or package.module:name) and its --model-args
    facts               the data set's facts the factory was called with (in_channels, num_classes, image_size, ...)
    task                classification, vae or the user's task
    classes             the classes' names in label order (null where the data set does not know them)
    preprocessing       how an image file becomes an input (data/preprocessing.py; null for data that is not images)
    weights             which weights the file offers: "model", or "ema" (--model-ema: the average validated better)
"""
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from torch.nn.parameter import is_lazy

from hvd_train import models
from hvd_train.data.preprocessing import CLASS_NAMES, Preprocessing, of_builtin
from hvd_train.errors import CheckpointError, ConfigError
from hvd_train.plugins import call, resolve
from hvd_train.trust import refuse_code_from


@dataclass
class ModelCard:
    model: str
    model_args: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)
    task: str = "classification"
    classes: Optional[list] = None
    preprocessing: Optional[dict] = None
    weights: str = "model"

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d, where):
        try:
            card = cls(**{k: d[k] for k in ("model", "model_args", "facts", "task", "classes", "preprocessing")},
                       weights=d.get("weights", "model"))
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{where}: not a model card hvd-train wrote (missing {e}); export the checkpoint "
                                  f"again with hvd-train export") from None
        kinds = {"model": str, "model_args": dict, "facts": dict, "task": str, "classes": (list, type(None)),
                 "preprocessing": (dict, type(None))}
        wrong = [k for k, kind in kinds.items() if not isinstance(getattr(card, k), kind)]
        wrong += ["weights"] if card.weights not in ("model", "ema") else []
        if wrong:
            raise CheckpointError(f"{where}: not a model card hvd-train wrote ({wrong[0]} is a "
                                  f"{type(getattr(card, wrong[0])).__name__})")
        return card

    def check_code(self, where, trusted):
        """Refuse a card that names code (an import path for the model or task, file-reading model arguments)
        unless the user passed --trust-code: a card is read from a file that may come from anyone."""
        refuse_code_from({"model": {"name": self.model, "task": self.task, "args": self.model_args}}, where,
                         trusted)

    def build(self, shapes):
        """The model, freshly initialised on the CPU in eval mode (load its weights next). `shapes`: {name: shape}
        of the weights the file holds; the model is built on the meta device first and must have exactly those, so
        a card cannot make it allocate more than its file holds."""
        factory = resolve(self.model, models.find_model, "the model", models.CHOICES)
        try:
            with torch.device("meta"):
                planned = call(factory, self.facts, self.model_args, "the model's arguments", self.model)
        except ConfigError:
            raise
        except Exception:  # a factory that cannot build without real tensors: its weights are checked on loading
            planned = None
        if planned is not None:
            # A lazy module's parameters have no shape until they are loaded: they take the file's.
            wanted = {k: tuple(shapes.get(k, ())) if is_lazy(v) else tuple(v.shape)
                      for k, v in planned.state_dict().items()}
            if wanted != {k: tuple(v) for k, v in shapes.items()}:
                extra = sorted(set(wanted) ^ set(shapes)) or [k for k in wanted if wanted[k] != tuple(shapes[k])]
                arguments = self.model_args or "no arguments"
                raise CheckpointError(f"the model its card describes ({self.model} with {arguments}) does not have "
                                      f"the weights the file holds (first difference: {extra[0]}); the card does not "
                                      f"belong to these weights")
        model = call(factory, self.facts, self.model_args, "the model's arguments", self.model)
        return model.eval()

    def prepare(self):
        """The Preprocessing of image files for this model; refused where the data was not images."""
        if not self.preprocessing:
            raise CheckpointError(f"the model {self.model} was trained on data that records no image preprocessing "
                                  f"(synthetic data, or your own data set without a 'preprocessing' fact), so image "
                                  f"files cannot be fed to it; docs/after-training.md")
        try:
            return Preprocessing.from_dict(self.preprocessing)
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"the model card's preprocessing cannot be used: {e}") from None

    def class_name(self, index):
        return self.classes[index] if self.classes and index < len(self.classes) else str(index)


def card_for(cfg, info, task):
    """The card of a model trained with `cfg` on data `info` for `task`."""
    return ModelCard(cfg.model.name, dict(cfg.model.args), info.facts(), task.name, info.classes,
                     info.preprocessing.to_dict() if info.preprocessing else None)


def card_of_checkpoint(ckpt, where):
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
