"""A trained model outside the training job: found from a run directory, a checkpoint or an export, rebuilt on
the CPU in eval mode, and run on a batch (hvd-train export and hvd-train predict)."""
import json
import os
import warnings
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from hvd_train.errors import CheckpointError
from hvd_train.provenance import TRUST_FLAG, RecordError, plain
from hvd_train.run.checkpoint import find_checkpoint, load
from hvd_train.run.model_card import ModelCard, card_of_checkpoint
from hvd_train.weights import SAFETENSORS_HEADER_MAX, safetensors_problem

SIDECAR = ".json"  # model.onnx -> model.onnx.json: the card and the parity check, beside every export
SIDECAR_MAX_BYTES = 16 * 2**20  # a card with a class list of a million names fits in far less
SIDECAR_MAX_DEPTH = 64  # levels its values may nest (hvd-train writes 4: the card's preprocessing, the inputs' shapes)
# Suffix of each format's file (hvd-train export writes these; predict checks a file is what its .json says).
FORMATS = {"safetensors": ".safetensors", "torchscript": ".torchscript.pt", "onnx": ".onnx"}
# What an ONNX model may allocate by default (onnx_memory_bound): per byte of its file, per byte of the batch's
# input, and at least. ResNet-50 (100 MB) on 64 images of 224 px: about 3 GB; predict's --max-memory-mb sets it.
ONNX_BYTES_PER_FILE_BYTE = 4
ONNX_BYTES_PER_INPUT_BYTE = 64
ONNX_MEMORY_FLOOR = 256 * 2**20


def load_trained(source: str, trusted: bool = False) -> tuple[torch.nn.Module, ModelCard, dict[str, Any]]:
    """(model on the CPU in eval mode with the weights of the checkpoint `source` names (a file, or a run
    directory's best.pt), its ModelCard, the checkpoint). trusted: --trust-code, which lets the card name code."""
    path = find_checkpoint(source)
    ckpt = load(path)
    card = card_of_checkpoint(ckpt, path)
    card.check_code(f"{path} (its model card)", trusted)
    weights = chosen_weights(ckpt)
    if not isinstance(weights, dict) or not all(torch.is_tensor(v) for v in weights.values()):
        raise CheckpointError(f"{path}: holds no model weights by name; give a checkpoint hvd-train wrote")
    model = card.build({k: v.shape for k, v in weights.items()}, os.path.getsize(path), trusted)
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: its weights do not fit the model its card describes ({card.model}): "
                              f"{str(e).splitlines()[0]}") from None
    return model, card, ckpt


AVERAGE = "average.module."  # the averaged model's keys in a checkpoint's "ema" (hvd_train/trainer.py)


def chosen_weights(ckpt: dict[str, Any]) -> object:
    """The weights a checkpoint offers for use: the model's, or under --model-ema their average where that
    validated better in the checkpoint's epoch (its "weights", which its card repeats)."""
    if ckpt.get("weights") == "ema" and isinstance(ckpt.get("ema"), dict):
        return {k[len(AVERAGE):]: v for k, v in ckpt["ema"].items() if k.startswith(AVERAGE)}
    return ckpt.get("model")


def outputs(result: object) -> list[torch.Tensor]:
    """A model's result as a list of tensors (a classifier's logits, a VAE's reconstruction, mean and log-variance)."""
    if torch.is_tensor(result):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in outputs(r)]
    if isinstance(result, dict):  # in the model's own order of keys, as torch.export (and so ONNX) flattens them
        return [t for k in result for t in outputs(result[k])]
    raise TypeError(f"the model returned a {type(result).__name__}; exports need tensors, tuples or dicts of them")


def read_sidecar(path: str) -> dict[str, Any]:
    """The export's .json, read as data: a bounded size and nesting (SIDECAR_MAX_DEPTH), one JSON object."""
    where = path + SIDECAR
    if os.path.getsize(where) > SIDECAR_MAX_BYTES:
        raise CheckpointError(f"{where}: {os.path.getsize(where)} bytes, larger than any export's .json "
                              f"({SIDECAR_MAX_BYTES} at most); it is not one hvd-train export wrote")
    deep = False
    try:
        with open(where) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: not JSON ({e}); export the model again with hvd-train export") from None
    except RecursionError:  # json nests by recursion: a few kilobytes of brackets exhaust it
        deep = True
    if deep:
        raise CheckpointError(f"{where}: its values nest more than {SIDECAR_MAX_DEPTH} levels deep; an export's "
                              f".json nests a few, so it is not one hvd-train export wrote")
    try:  # the gate (hvd_train/provenance.py): bounded nesting and size, as every value read from a file
        plain(meta, where, depth=SIDECAR_MAX_DEPTH)
    except RecordError as e:
        raise CheckpointError(f"{e}; an export's .json nests a few, so it is not one hvd-train export wrote") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: not an export's .json (a {type(meta).__name__}, not an object)")
    return meta


def file_format(path: str) -> Optional[str]:
    """The export format the file at `path` holds, from its first bytes (None: none of them)."""
    with open(path, "rb") as f:
        head = f.read(16)
    if zipfile.is_zipfile(path):
        return "torchscript"
    # safetensors: the header's length, then the header, a JSON object (whether that length fits the file is the
    # reader's check, safetensors_problem, which says so)
    if len(head) >= 9 and int.from_bytes(head[:8], "little") <= SAFETENSORS_HEADER_MAX and head[8:9] == b"{":
        return "safetensors"
    if head[:1] == b"\x08":  # an ONNX ModelProto starts with its ir_version field (1, varint)
        return "onnx"
    return None


def load_runner(path: str, trusted: bool = False, max_memory: Optional[int] = None
                ) -> tuple[Callable[[Union[torch.Tensor, "ModelInputs"]], list[torch.Tensor]], ModelCard]:
    """(a function batch -> list of output tensors, the ModelCard; the batch: images, or ModelInputs) for a
    checkpoint, a run directory or an export
    (model.safetensors, model.torchscript.pt, model.onnx, each with its .json beside it). trusted: --trust-code;
    max_memory: the bytes an ONNX model may take (default: onnx_memory_bound)."""
    if os.path.isfile(path) and os.path.isfile(path + SIDECAR):
        meta = read_sidecar(path)
        card = ModelCard.from_dict(meta, path + SIDECAR)
        card.check_code(f"{path + SIDECAR} (the export's model card)", trusted)
        fmt, held = meta.get("format"), file_format(path)
        if fmt not in FORMATS or held != fmt or not path.endswith(FORMATS[fmt]):
            raise CheckpointError(f"{path + SIDECAR} says format {fmt!r}, but {path} holds "
                                  f"{held or 'none of safetensors, torchscript, onnx'} and is named for "
                                  f"{next((f for f, x in FORMATS.items() if path.endswith(x)), 'none of them')}; "
                                  f"the .json does not belong to this file: export the model again")
        return export_runner(path, fmt, card, trusted, max_memory), card
    model, card, _ = load_trained(path, trusted)
    return _eager(model), card


def export_runner(path: str, fmt: str, card: ModelCard, trusted: bool = False, max_memory: Optional[int] = None
                  ) -> Callable[[Union[torch.Tensor, "ModelInputs"]], list[torch.Tensor]]:
    """A function batch -> list of output tensors for the export at `path` in format `fmt` of the model `card`
    describes. trusted: --trust-code, which a TorchScript file needs (it is a program); max_memory: as
    load_runner's."""
    if fmt == "safetensors":
        from safetensors.torch import load_file

        problem = safetensors_problem(path)
        if problem:
            raise CheckpointError(f"{path}: not a whole safetensors file: {problem}; export the model again with "
                                  f"hvd-train export")
        try:
            weights = load_file(path)
        except Exception as e:  # SafetensorError: a header that does not parse, tensors past the end of the file
            detail = str(e).splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{path}: cannot be read as safetensors ({detail}); export the model again with "
                                  f"hvd-train export") from None
        model = card.build({k: v.shape for k, v in weights.items()}, os.path.getsize(path), trusted)
        try:
            model.load_state_dict(weights)
        except RuntimeError as e:
            raise CheckpointError(f"{path}: its weights do not fit the model its .json describes ({card.model}): "
                                  f"{str(e).splitlines()[0]}") from None
        return _eager(model)
    if fmt == "torchscript":
        if not trusted:  # torch.jit.load runs the file's code, which may do what Python's torch may (open files)
            raise CheckpointError(f"{path}: a TorchScript export is a program in TorchScript's language, which "
                                  f"torch.jit.load runs (it can read and write your files), so it is not loaded "
                                  f"without {TRUST_FLAG}: pass {TRUST_FLAG} if you trust where it came from, or "
                                  f"export the model as onnx or safetensors, which are data")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # TorchScript's deprecation, not the user's concern
            model = torch.jit.load(path, map_location="cpu").eval()
        return _eager(model)
    if fmt == "onnx":
        return onnx_runner(path, max_memory)
    raise CheckpointError(f"{path + SIDECAR}: unknown export format {fmt!r}")


@dataclass
class ModelInputs:
    """What a model is called with: its tensors by name, in the order of its forward's parameters, passed by
    keyword (a HuggingFace model's input_ids, attention_mask) or, where keywords is False, in that order."""
    tensors: dict
    keywords: bool = False

    def call(self, model: torch.nn.Module) -> Any:
        return model(**self.tensors) if self.keywords else model(*self.tensors.values())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def count(self) -> int:
        return next(iter(self.tensors.values())).shape[0]


def as_inputs(batch: Union[torch.Tensor, ModelInputs]) -> ModelInputs:
    """ModelInputs of a batch of images (predict's), or the inputs themselves."""
    return batch if isinstance(batch, ModelInputs) else ModelInputs({"images": batch})


def _eager(model: torch.nn.Module) -> Callable[[Union[torch.Tensor, "ModelInputs"]], list[torch.Tensor]]:
    def run(batch: Union[torch.Tensor, ModelInputs]) -> list[torch.Tensor]:
        with torch.no_grad():
            return outputs(as_inputs(batch).call(model))
    return run


def onnx_memory_bound(file_bytes: int, batch_bytes: int) -> int:
    """What an ONNX model may take by default: its weights (in the file) several times over, room for the
    activations of the batch it is given, and a floor for onnxruntime's own buffers."""
    return ONNX_BYTES_PER_FILE_BYTE * file_bytes + ONNX_BYTES_PER_INPUT_BYTE * batch_bytes + ONNX_MEMORY_FLOOR


def onnx_runner(path: str, max_memory: Optional[int] = None
                ) -> Callable[[Union[torch.Tensor, "ModelInputs"]], list[torch.Tensor]]:
    """batch -> list of output tensors, from onnxruntime in a process of its own whose allocations are capped
    (tools/onnx_session.py) at max_memory bytes, or by default at onnx_memory_bound of the first batch."""
    from hvd_train.tools.onnx_session import Session

    session: Optional["Session"] = None

    def run(batch: Union[torch.Tensor, ModelInputs]) -> list[torch.Tensor]:
        nonlocal session
        inputs = as_inputs(batch)
        try:
            if session is None:
                session = Session(path, max_memory or onnx_memory_bound(os.path.getsize(path), inputs.nbytes))
            return [torch.from_numpy(y) for y in session.run([t.numpy() for t in inputs.tensors.values()])]
        except RuntimeError as e:
            raise CheckpointError(f"{path}: {e}") from None
    return run
