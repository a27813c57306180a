"""A trained model outside the training job: found from a run directory, a checkpoint or an export, rebuilt on
the CPU in eval mode, and run on a batch (hvd-train export and hvd-train predict)."""
import json
import os
import warnings

import torch

from hvd_train import checkpoint
from hvd_train.errors import CheckpointError
from hvd_train.model_card import ModelCard, card_of_checkpoint

SIDECAR = ".json"  # model.onnx -> model.onnx.json: the card and the parity check, beside every export


def find_checkpoint(source):
    """The checkpoint `source` names: the file itself, or a run directory's best.pt (last.pt without one)."""
    if os.path.isdir(source):
        for name in ("best.pt", "last.pt"):
            for folder in (os.path.join(source, "checkpoints"), source):
                if os.path.isfile(os.path.join(folder, name)):
                    return os.path.join(folder, name)
        raise CheckpointError(f"{source}: no checkpoints/best.pt or checkpoints/last.pt in this directory; give a "
                              f"run's output directory (--output-dir) or a checkpoint file")
    if not os.path.isfile(source):
        raise CheckpointError(f"{source}: no such file or directory; give a run's output directory or a checkpoint")
    return source


def load_trained(source):
    """(model on the CPU in eval mode with the weights of the checkpoint `source` names (a file, or a run
    directory's best.pt), its ModelCard, the checkpoint)."""
    path = find_checkpoint(source)
    ckpt = checkpoint.load(path)
    card = card_of_checkpoint(ckpt, path)
    model = card.build()
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: its weights do not fit the model its card describes ({card.model}): "
                              f"{str(e).splitlines()[0]}") from None
    return model, card, ckpt


def outputs(result):
    """A model's result as a list of tensors (a classifier's logits, a VAE's reconstruction, mean and log-variance)."""
    if torch.is_tensor(result):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in outputs(r)]
    if isinstance(result, dict):
        return [t for k in sorted(result) for t in outputs(result[k])]
    raise TypeError(f"the model returned a {type(result).__name__}; exports need tensors, tuples or dicts of them")


def read_sidecar(path):
    with open(path + SIDECAR) as f:
        return json.load(f)


def load_runner(path):
    """(a function batch -> list of output tensors, the ModelCard) for a checkpoint, a run directory or an export
    (model.safetensors, model.torchscript.pt, model.onnx, each with its .json beside it)."""
    if os.path.isfile(path) and os.path.isfile(path + SIDECAR):
        meta = read_sidecar(path)
        card = ModelCard.from_dict(meta, path + SIDECAR)
        return export_runner(path, meta.get("format"), card), card
    model, card, _ = load_trained(path)
    return _eager(model), card


def export_runner(path, fmt, card):
    """A function batch -> list of output tensors for the export at `path` in format `fmt` of the model `card`
    describes."""
    if fmt == "safetensors":
        from safetensors.torch import load_file

        model = card.build()
        model.load_state_dict(load_file(path))
        return _eager(model)
    if fmt == "torchscript":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # TorchScript's deprecation, not the user's concern
            model = torch.jit.load(path, map_location="cpu").eval()
        return _eager(model)
    if fmt == "onnx":
        return onnx_runner(path)
    raise CheckpointError(f"{path + SIDECAR}: unknown export format {fmt!r}")


def _eager(model):
    def run(batch):
        with torch.no_grad():
            return outputs(model(batch))
    return run


def onnx_runner(path):
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def run(batch):
        return [torch.from_numpy(y) for y in session.run(None, {name: batch.numpy()})]
    return run
