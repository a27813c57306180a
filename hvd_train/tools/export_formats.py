"""Writing a model in each of hvd-train export's formats: safetensors (the weights), TorchScript (traced) and ONNX
(torch.export's graph, its free axes named), and what each file takes as input; a model that cannot be written is
one ExportError naming the layer or the operator. The command around them, its parity check and the .json beside
every export are hvd_train/tools/export.py's.
"""
import contextlib
import io
import re
import warnings

import torch


class ExportError(Exception):
    """This model cannot be written in the format asked: the message names the layer or operator."""


@contextlib.contextmanager
def layer_on_error(model):
    """On an exception inside the model's forward, add the innermost layer that was running to it (.layer)."""
    stack, seen = [], {}

    def enter(name):
        return lambda module, args: stack.append(name)

    def leave(module, args, result):
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


def _layer_of(model, name):
    if name in (None, "(the model)", ""):
        return f"the model ({type(model).__name__})"
    try:
        return f"layer '{name}' ({type(model.get_submodule(name)).__name__})"
    except AttributeError:
        return f"layer '{name}'"


def _failure(fmt, what, e):
    first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return ExportError(f"cannot export to {fmt}: {what}: {type(e).__name__}: {first[:300]}; choose another "
                       f"--format (safetensors always works), or change that part of the model")


def write_torchscript(model, inputs, path):
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


def write_onnx(model, inputs, path):
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


def free_dims(inputs):
    """{input: {axis: Dim}}: the batch axis of every input is one free dimension; the second axis of a 2-d input (a
    sequence of token ids, its mask) is left to torch.export (Dim.AUTO), free unless the model fixes its length."""
    batch = torch.export.Dim("batch")
    return {name: {0: batch, **({1: torch.export.Dim.AUTO} if t.dim() == 2 else {})}
            for name, t in inputs.tensors.items()}


# What the free axes are called in the ONNX graph, by the axis they were found on (torch.export names them s77, s12).
AXIS_NAMES = ("batch", "sequence")


def name_free_axes(path):
    """torch.export names each free axis with a symbol; tools show names, so the batch axis is called "batch" and a
    sequence's "sequence" (where inputs differ in length, sequence_2, ...)."""
    import onnx

    graph = onnx.load(path)
    names = {}
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


def described_inputs(fmt, path, inputs):
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


def _onnx_failure(model, program, e):
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


def write_safetensors(model, path):
    from safetensors.torch import save_file

    # safetensors refuses tensors that share memory: each is written as its own contiguous copy.
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, path)
