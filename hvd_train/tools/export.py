"""hvd-train export: a trained model as safetensors weights, TorchScript or ONNX, each checked when written.

    hvd-train export runs/cifar10 --format onnx                 # runs/cifar10/export/model.onnx (+ .json)
    hvd-train export runs/cifar10/checkpoints/epoch_0010.pt --format safetensors --out model.safetensors

Every export gets a JSON file beside it (model.onnx.json): the model card (hvd_train/run/model_card.py: what rebuilds
the model, its classes, the preprocessing it expects) and the parity check. The check runs the exported model and the
PyTorch model on a batch of the run's own validation samples (read from the data set the checkpoint's config names;
--data-dir where it moved) and compares every output within the format's tolerance. An export that fails the check
is not kept.
"""
import argparse
import inspect
import os
import sys
from dataclasses import dataclass, replace

import torch
from torch.utils.data import default_collate

from hvd_train.data import FROM_FILES, DataError
from hvd_train.data.shard_index import ShardSet
from hvd_train.data.shards import first_batch
from hvd_train.config import config_from_dict
from hvd_train.errors import CheckpointError, ConfigError, say
from hvd_train.files import no_link_below, temporary_beside, with_run_mode, write_json
from hvd_train.gate import settings
from hvd_train.feed import Feed, image_figures
from hvd_train.tools.export_formats import (ExportError, described_inputs, write_onnx, write_safetensors,
                                            write_torchscript)
from hvd_train.tools.inference import FORMATS, SIDECAR, ModelInputs, export_runner, load_trained, outputs
from hvd_train.run.directory import RunDir
from hvd_train.run.resume import find_checkpoint
from hvd_train.trust import TRUST_FLAG, refuse_code_from
from hvd_train.uris import redact_all

# Suffix of each format's file, and its tolerance (absolute, relative): safetensors holds the weights themselves, so
# the rebuilt model must agree exactly; TorchScript runs the same kernels; onnxruntime has kernels of its own.
TOLERANCE = {"safetensors": (0.0, 0.0), "torchscript": (1e-5, 1e-5), "onnx": (1e-4, 1e-3)}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="hvd-train export", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a run's output directory (its checkpoints/best.pt, else last.pt) or a checkpoint")
    p.add_argument("--format", required=True, choices=sorted(FORMATS), help="what to write")
    p.add_argument("--out", default="", help="the file to write (default: <run dir>/export/model<suffix>)")
    p.add_argument("--data-dir", default="", help="where the validation data is, if not where the run read it")
    p.add_argument("--samples", type=int, default=16, help="validation samples the parity check runs (default 16)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export at --out")
    p.add_argument(TRUST_FLAG, action="store_true", dest="trust_code",
                   help="let the checkpoint name code: your own model, task or data set as an import path, or a "
                   "pipe: shard command (a checkpoint is data otherwise; docs/reliability.md: What is code and what "
                   "is data)")
    args = p.parse_args(argv)
    if args.samples < 2:
        p.error(f"--samples {args.samples}: the check needs at least 2 samples (the batch axis stays free)")
    return args


def default_out(checkpoint_path, fmt):
    folder = os.path.dirname(os.path.abspath(checkpoint_path))
    run_dir = os.path.dirname(folder) if os.path.basename(folder) == RunDir.CHECKPOINTS else folder
    return RunDir(run_dir).exported(FORMATS[fmt])


@dataclass
class Batch:
    inputs: ModelInputs  # what the run's task hands the model for these samples
    described: str  # where the samples come from, for the printed check


def validation_batch(ckpt, model, count, data_dir, where, trusted):
    """The model's input for the first `count` validation samples of the run's data set, as the run's validation
    fed them: the samples collated as the loader collates them (tuples, dicts, nested), then given to the run's task,
    whose call of the model is captured. The data set and task are rebuilt from the checkpoint's stored config, which
    names code only with --trust-code."""
    try:  # through the gate, as a --resume reads config.json: typed, and what would run code refused
        stored = settings(ckpt.get("config") or {}, f"{where} (its stored config)", recorded=True)
    except ConfigError as e:
        raise CheckpointError(f"{e}; it is not one hvd-train wrote") from None
    refuse_code_from(stored, f"{where} (its stored config)", trusted)
    try:
        cfg = config_from_dict(stored)
    except (TypeError, ValueError) as e:  # a field no config has, or a value of the wrong kind
        raise CheckpointError(f"{where}: its stored config is not one hvd-train wrote ({e})") from None
    data = replace(cfg.data, download=False, workers=0, data_dir=data_dir or cfg.data.data_dir)
    cfg = replace(cfg, data=data)
    try:
        from hvd_train.build import build_task, prepare_data

        _, val_set, info = prepare_data(cfg)
        task = build_task(cfg, info)
    except (DataError, ConfigError, OSError) as e:
        raise CheckpointError(f"the parity check needs the run's validation data, which cannot be read: {e} (pass "
                              f"--data-dir where the {cfg.data.dataset} data is now)") from None
    count = min(count, len(val_set))
    if count < 2:
        raise CheckpointError(f"the parity check needs 2 validation samples or more; {cfg.data.dataset} has "
                              f"{len(val_set)}")
    if isinstance(val_set, ShardSet):  # streamed: read from its first shards, as validation reads them
        batch = first_batch(val_set, cfg.data.image_size, count)
    else:
        batch = default_collate([val_set[i] for i in range(count)])
    inputs = model_input(model, task, Feed(torch.device("cpu"), *image_figures(info))(batch))
    # Where the samples were read: the shards, or the folder of a data set kept in files (a user's data set reads
    # where its own arguments say).
    where = f" ({redact_all(cfg.data.val_shards)})" if isinstance(val_set, ShardSet) else \
        f" ({cfg.data.data_dir})" if cfg.data.dataset in FROM_FILES else ""
    return Batch(inputs, f"{count} validation samples of {cfg.data.dataset}{where}")


def model_input(model, task, batch):
    """The ModelInputs the task hands the model for `batch` (captured in a forward pre-hook, the task run without
    gradients): every tensor by the name of the forward's parameter it fills. A single batch of images is called
    "images", as exports have always named it; anything but tensors is refused by name."""
    seen = []

    def capture(module, args, kwargs):
        seen.append((args, kwargs))
        raise _Captured()

    handle = model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            task.task.loss(model, batch)
    except _Captured:
        pass
    finally:
        handle.remove()
    if not seen:
        raise ExportError(f"the task ({type(task).__name__}) did not call the model on a validation batch, so its "
                          f"input is unknown")
    args, kwargs = seen[0]
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise ExportError(f"the task's call of the model does not fit its forward() ({e})") from None
    named = dict(bound.arguments)
    params = signature.parameters
    spread = [n for n in named if params[n].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if spread:
        raise ExportError(f"the model's forward() takes its inputs through *{spread[0]}; an export names each input: "
                          f"give forward() a parameter for each, or export the weights with --format safetensors")
    other = next((n for n, v in named.items() if not torch.is_tensor(v)), None)
    if other is not None:
        raise ExportError(f"the task passes the model {other}={named[other]!r}, which is not a tensor; an export "
                          f"takes tensors only: let forward() default it, or export the weights with --format "
                          f"safetensors")
    keywords = bool(bound.kwargs)  # an input given by name after one left out: all go by name
    if len(named) == 1 and not keywords and images_like(next(iter(named.values()))):
        named = {"images": next(iter(named.values()))}
    return ModelInputs(named, keywords)


def images_like(tensor):
    """A batch of images: floating point, (N, C, H, W)."""
    return tensor.is_floating_point() and tensor.dim() == 4


class _Captured(Exception):
    """Stops the task once the model's input is known: the forward itself is not needed."""


def parity(fmt, path, card, model, batch):
    """(max |exported - pytorch| over every output, whether within tolerance, top-1 agreement or None)."""
    run = export_runner(path, fmt, card, trusted=True)  # the file just written, of a model already checked
    with torch.no_grad():
        expected = outputs(batch.inputs.call(model))
    got = run(batch.inputs)
    if len(got) != len(expected) or any(g.shape != x.shape for g, x in zip(got, expected)):
        return float("inf"), False, None
    atol, rtol = TOLERANCE[fmt]
    worst = max(float((g - x).abs().max()) for g, x in zip(got, expected))
    ok = all(bool(((g - x).abs() <= atol + rtol * x.abs()).all()) for g, x in zip(got, expected))
    agree = None
    if card.task == "classification":
        agree = int((got[0].argmax(1) == expected[0].argmax(1)).sum())
    return worst, ok, agree


def export(args):
    path = find_checkpoint(args.source)
    model, card, ckpt = load_trained(path, args.trust_code)
    out = args.out or default_out(path, args.format)
    if os.path.exists(out) and not args.overwrite:
        raise CheckpointError(f"--out {out}: exists; pass --overwrite to replace it, or another --out")
    batch = validation_batch(ckpt, model, args.samples, args.data_dir, path, args.trust_code)
    if not args.out:  # <run dir>/export/: the run directory's own folder, never a link planted there (--out: yours)
        no_link_below(os.path.dirname(os.path.dirname(out)), os.path.dirname(out))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fd, tmp = temporary_beside(out)
    os.close(fd)  # the writers below take a path
    try:
        if args.format == "safetensors":
            write_safetensors(model, tmp)
        elif args.format == "torchscript":
            write_torchscript(model, batch.inputs, tmp)
        else:
            write_onnx(model, batch.inputs, tmp)
        worst, ok, agree = parity(args.format, tmp, card, model, batch)
        atol, rtol = TOLERANCE[args.format]
        agreement = f"; top-1 agrees on {agree}/{batch.inputs.count}" if agree is not None else ""
        check = (f"parity on {batch.described}: max |{args.format} - pytorch| = {worst:.3g}, tolerance "
                 f"{atol:g} + {rtol:g} x |pytorch|{agreement}")
        if not ok:
            raise ExportError(f"the {args.format} export does not match the PyTorch model ({check}); nothing written")
        inputs = described_inputs(args.format, tmp, batch.inputs)
        meta = {"format": args.format, "file": os.path.basename(out), "checkpoint": os.path.abspath(path),
                "epoch": ckpt.get("epoch"), **card.to_dict(), "inputs": inputs,
                **({"input": inputs[0]} if len(inputs) == 1 else {}),  # what one-input exports have always had
                "inputs_by": "name" if batch.inputs.keywords else "position",
                "parity": {"samples": batch.inputs.count, "max_abs_diff": worst, "atol": atol, "rtol": rtol,
                           "top1_agree": agree, "on": batch.described}}
        with_run_mode(tmp)  # the writers above chose their own (safetensors: 0600): the run's files' mode instead
        os.replace(tmp, out)
        write_json(out + SIDECAR, meta)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {out} ({args.format}) from {path} (epoch {ckpt.get('epoch')}) and {out + SIDECAR}")
    print(check)
    return 0


def main(argv):
    args = parse_args(argv)
    try:
        return export(args)
    except (CheckpointError, ConfigError, ExportError) as e:
        say(f"hvd-train export: error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
