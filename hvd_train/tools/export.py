"""hvd-train export: a trained model as safetensors weights, TorchScript or ONNX, each checked when written.

    hvd-train export runs/cifar10 --format onnx                 # runs/cifar10/export/model.onnx (+ .json)
    hvd-train export runs/cifar10/checkpoints/epoch_0010.pt --format safetensors --out model.safetensors

Every export gets a JSON file beside it (model.onnx.json): the model card (hvd_train/run/model_card.py: what rebuilds
the model, its classes, the preprocessing it expects), what the file takes as input, and the parity check. The check
runs the exported model and the PyTorch model on a batch of the run's own validation samples (read from the data set
the checkpoint's config names; --data-dir where it moved) and compares every output within the format's tolerance.
An export that fails the check is not kept.

The formats: safetensors (the weights), TorchScript (traced) and ONNX (torch.export's graph, its inputs and free
axes named: "batch", and "sequence" for a sequence's length). A model that cannot be written is one ExportError
naming the layer or the operator.
"""
import argparse
import contextlib
import inspect
import io
import os
import re
import sys
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn, Optional, Sequence

import torch
from torch.utils.data import default_collate

from hvd_train.config import config_from_dict
from hvd_train.data import FROM_FILES, DataError
from hvd_train.data.shards import ShardSet, first_batch
from hvd_train.errors import CheckpointError, ConfigError, redact_all, say
from hvd_train.files import no_link_below, temporary_beside, with_run_mode, write_json
from hvd_train.config.loading import settings
from hvd_train.provenance import TRUST_FLAG, refuse_code_from
from hvd_train.run.checkpoint import find_checkpoint
from hvd_train.run.directory import RunDir
from hvd_train.tools.inference import FORMATS, SIDECAR, ModelInputs, export_runner, load_trained, outputs
from hvd_train.trainer import Feed, image_figures

if TYPE_CHECKING:
    from hvd_train.run.model_card import ModelCard
    from hvd_train.tasks import RunTask

# Suffix of each format's file, and its tolerance (absolute, relative): safetensors holds the weights themselves, so
# the rebuilt model must agree exactly; TorchScript runs the same kernels; onnxruntime has kernels of its own.
TOLERANCE = {"safetensors": (0.0, 0.0), "torchscript": (1e-5, 1e-5), "onnx": (1e-4, 1e-3)}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
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


def default_out(checkpoint_path: str, fmt: str) -> str:
    folder = os.path.dirname(os.path.abspath(checkpoint_path))
    run_dir = os.path.dirname(folder) if os.path.basename(folder) == RunDir.CHECKPOINTS else folder
    return RunDir(run_dir).exported(FORMATS[fmt])


@dataclass
class Batch:
    inputs: ModelInputs  # what the run's task hands the model for these samples
    described: str  # where the samples come from, for the printed check


def validation_batch(ckpt: dict[str, Any], model: torch.nn.Module, count: int, data_dir: str, where: str,
                     trusted: bool) -> Batch:
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
        from hvd_train.training import build_task, prepare_data

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


def model_input(model: torch.nn.Module, task: "RunTask", batch: Any) -> ModelInputs:
    """The ModelInputs the task hands the model for `batch` (captured in a forward pre-hook, the task run without
    gradients): every tensor by the name of the forward's parameter it fills. A single batch of images is called
    "images", as exports have always named it; anything but tensors is refused by name."""
    seen = []

    def capture(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> NoReturn:
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


def images_like(tensor: torch.Tensor) -> bool:
    """A batch of images: floating point, (N, C, H, W)."""
    return tensor.is_floating_point() and tensor.dim() == 4


class _Captured(Exception):
    """Stops the task once the model's input is known: the forward itself is not needed."""


def parity(fmt: str, path: str, card: "ModelCard", model: torch.nn.Module,
           batch: Batch) -> tuple[float, bool, Optional[int]]:
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


def export(args: argparse.Namespace) -> int:
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


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    try:
        return export(args)
    except (CheckpointError, ConfigError, ExportError) as e:
        say(f"hvd-train export: error: {e}")
        return 2


class ExportError(Exception):
    """This model cannot be written in the format asked: the message names the layer or operator."""


@contextlib.contextmanager
def layer_on_error(model: torch.nn.Module) -> Iterator[dict[str, Optional[str]]]:
    """On an exception inside the model's forward, add the innermost layer that was running to it (.layer)."""
    seen: dict[str, Optional[str]]
    stack, seen = [], {}

    def enter(name: str) -> Callable[[torch.nn.Module, tuple[Any, ...]], None]:
        return lambda module, args: stack.append(name)

    def leave(module: torch.nn.Module, args: tuple[Any, ...], result: Any) -> None:
        if stack:
            stack.pop()

    handles = []
    for name, module in model.named_modules():
        handles += [module.register_forward_pre_hook(enter(name or "(the model)")), module.register_forward_hook(leave)]
    try:
        yield seen
    except Exception as e:
        seen["layer"] = stack[-1] if stack else None
        raise e
    finally:
        for h in handles:
            h.remove()


def _layer_of(model: torch.nn.Module, name: Optional[str]) -> str:
    if name in (None, "(the model)", ""):
        return f"the model ({type(model).__name__})"
    try:
        return f"layer '{name}' ({type(model.get_submodule(name)).__name__})"
    except AttributeError:
        return f"layer '{name}'"


def _failure(fmt: str, what: str, e: BaseException) -> ExportError:
    first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return ExportError(f"cannot export to {fmt}: {what}: {type(e).__name__}: {first[:300]}; choose another "
                       f"--format (safetensors always works), or change that part of the model")


def write_torchscript(model: torch.nn.Module, inputs: ModelInputs, path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation and tracer notes
        try:
            with layer_on_error(model) as seen:
                # strict=False: a model may return a dict or an output object (HuggingFace's), traced as a dict.
                if inputs.keywords:
                    traced = torch.jit.trace(model, example_kwarg_inputs=inputs.tensors, check_trace=False,
                                             strict=False)
                else:
                    traced = torch.jit.trace(model, tuple(inputs.tensors.values()), check_trace=False,
                                             strict=False)
        except Exception as e:
            raise _failure("torchscript", f"{_layer_of(model, seen.get('layer'))} could not be traced", e) from None
        torch.jit.save(traced, path)


def write_onnx(model: torch.nn.Module, inputs: ModelInputs, path: str) -> None:
    """torch.export's graph of the model (the batch axis free, and a sequence's length where the model allows it),
    converted to ONNX with each input named. A failure names the layer (from the graph node's module stack) and the
    operator ONNX lacks."""
    dims = free_dims(inputs)
    args, kwargs = ((), inputs.tensors) if inputs.keywords else (tuple(inputs.tensors.values()), {})
    shapes = dims if inputs.keywords else tuple(dims.values())
    try:
        with layer_on_error(model) as seen:
            program = torch.export.export(model, args, kwargs, dynamic_shapes=shapes)
    except Exception as e:
        raise _failure("onnx", f"{_layer_of(model, seen.get('layer'))} could not be captured by torch.export",
                       e) from None
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(program, args, path, kwargs=kwargs, dynamo=True, input_names=list(inputs.tensors),
                              external_data=False)
    except Exception as e:
        raise _onnx_failure(model, program, e) from None
    name_free_axes(path)


def free_dims(inputs: ModelInputs) -> dict[str, dict[int, Any]]:
    """{input: {axis: Dim}}: the batch axis of every input is one free dimension; the second axis of a 2-d input (a
    sequence of token ids, its mask) is left to torch.export (Dim.AUTO), free unless the model fixes its length."""
    batch = torch.export.Dim("batch")
    return {name: {0: batch, **({1: torch.export.Dim.AUTO} if t.dim() == 2 else {})}
            for name, t in inputs.tensors.items()}


# What the free axes are called in the ONNX graph, by the axis they were found on (torch.export names them s77, s12).
AXIS_NAMES = ("batch", "sequence")


def name_free_axes(path: str) -> None:
    """torch.export names each free axis with a symbol; tools show names, so the batch axis is called "batch" and a
    sequence's "sequence" (where inputs differ in length, sequence_2, ...)."""
    import onnx

    graph = onnx.load(path)
    names: dict[str, str] = {}
    for value in graph.graph.input:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.dim_param and dim.dim_param not in names:
                base = AXIS_NAMES[min(axis, 1)]
                taken = sum(n.startswith(base) for n in names.values())
                names[dim.dim_param] = base if not taken else f"{base}_{taken + 1}"
    if not names:
        return
    for value in [*graph.graph.input, *graph.graph.output, *graph.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]
    onnx.save(graph, path)


def described_inputs(fmt: str, path: str, inputs: ModelInputs) -> list[dict[str, Any]]:
    """The sidecar's record of each input: name, shape (a free axis by its name) and dtype. ONNX's come from the
    graph written; the other formats take the inputs as the model does, with the batch axis free."""
    if fmt == "onnx":
        import onnx
        from onnx.helper import tensor_dtype_to_np_dtype

        graph = onnx.load(path, load_external_data=False).graph
        return [{"name": v.name, "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim],
                 "dtype": str(tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type))} for v in graph.input]
    return [{"name": name, "shape": ["batch", *t.shape[1:]], "dtype": str(t.dtype).removeprefix("torch.")}
            for name, t in inputs.tensors.items()]


def _onnx_failure(model: torch.nn.Module, program: "torch.export.ExportedProgram",
                  e: BaseException) -> ExportError:
    text = str(e)
    op = re.search(r"aten[.:]{1,2}([A-Za-z0-9_]+)", text)
    if not op:
        return _failure("onnx", "the conversion failed", e)
    layer = None
    try:  # the exporter's own decompositions name the operator; the same decompositions find its node
        graph = program.run_decompositions().graph
    except Exception:
        graph = program.graph
    for node in graph.nodes:
        if f".{op.group(1)}." in f".{node.target}" and node.meta.get("nn_module_stack"):
            layer = list(node.meta["nn_module_stack"].values())[-1][0]
            break
    where = _layer_of(model, layer)
    return ExportError(f"cannot export to onnx: {where} uses the operator aten.{op.group(1)}, which has no ONNX "
                       f"conversion; choose another --format (safetensors always works), or replace that operation")


def write_safetensors(model: torch.nn.Module, path: str) -> None:
    from safetensors.torch import save_file

    # safetensors refuses tensors that share memory: each is written as its own contiguous copy.
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
