"""An ONNX model run in a process of its own, with a bound on the memory onnxruntime may take.

An ONNX file is data, but its graph says what to allocate: a 3 KB file whose graph makes a tensor of 1.5 billion
elements would take 6 GB before its output could be checked. Here every allocation onnxruntime makes comes from one
arena capped at a given number of bytes (an allocation past it fails the run, with the cap named), constant folding
at load time is off (it would allocate outside that arena), and the session lives in a child process that imports
numpy, onnx and onnxruntime only, so a model that crashes onnxruntime takes nothing else with it. The arena counts a
string tensor's slots, not its characters, so before the session is made the child reads the graph with onnx and
refuses one that makes string tensors anywhere (string_tensors).

The parent sends each batch (an array for each of the graph's inputs, in its order) and reads the outputs through
the child's stdin and stdout: a JSON line, then the raw bytes of each array. `python -m
hvd_train.tools.onnx_session MODEL CAP_BYTES` is the child.
"""
import json
import re
import subprocess
import sys
import weakref
from typing import IO, TYPE_CHECKING, Any, Optional, Sequence, cast

if TYPE_CHECKING:
    import numpy as np
    import onnx
    import onnxruntime as ort

DTYPES = ("float32", "float64", "float16", "int64", "int32", "int8", "uint8", "bool")  # what exports take and give


def send(stream: IO[bytes], header: dict[str, Any], arrays: Sequence["np.ndarray"] = ()) -> None:
    stream.write((json.dumps(header) + "\n").encode())
    for array in arrays:
        stream.write(array.tobytes())
    stream.flush()


def receive(stream: IO[bytes]) -> tuple[Optional[dict[str, Any]], list["np.ndarray"]]:
    """(header, [arrays]) from `stream`, or (None, []) at its end."""
    import numpy as np

    line = stream.readline()
    if not line:
        return None, []
    header = json.loads(line)
    arrays = []
    for dtype, shape in header.get("arrays", ()):
        if dtype not in DTYPES:
            raise ValueError(f"an array of type {dtype!r}, which no export takes or gives")
        count = int(np.prod(shape, dtype=np.int64))
        data = bytearray(stream.read(count * np.dtype(dtype).itemsize))  # writable, as torch wants
        arrays.append(np.frombuffer(data, dtype=dtype).reshape(shape))
    return header, arrays


def described(arrays: Sequence["np.ndarray"]) -> list[list[Any]]:
    return [[str(a.dtype), list(a.shape)] for a in arrays]


def one_line(error: BaseException) -> str:
    """onnxruntime's message, first line, without the source location it prefixes."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split("Status Message: ")[-1][:400]


STRING = 8  # onnx.TensorProto.STRING
# Operators that make string tensors (or maps keyed by strings) from others: the ONNX string operators, and
# onnxruntime's and the ai.onnx.ml domain's (all of which an image model's export lacks).
STRING_OPERATORS = {"StringNormalizer", "StringConcat", "StringSplit", "RegexFullMatch", "LabelEncoder",
                    "CategoryMapper", "DictVectorizer", "ZipMap", "Tokenizer", "StringToHashBucket",
                    "TfIdfVectorizer", "Imputer", "OneHotEncoder", "FeatureVectorizer"}
STRING_DOMAINS = ("ai.onnx.ml", "com.microsoft.extensions", "ai.onnx.contrib")
TYPE_ATTRIBUTES = ("to", "dtype", "output_dtype")  # an integer attribute naming a tensor type (Cast's `to`, ...)


def holds_string(type_proto: "onnx.TypeProto") -> bool:
    """Whether an ONNX TypeProto is, or holds, a string: a tensor, a sequence, a map (its keys too), an optional."""
    stack = [type_proto]
    while stack:
        t = stack.pop()
        kind = t.WhichOneof("value")
        if kind in ("tensor_type", "sparse_tensor_type") and getattr(t, kind).elem_type == STRING:
            return True
        if kind == "map_type" and t.map_type.key_type == STRING:
            return True
        stack += [t.map_type.value_type] if kind == "map_type" else \
            [getattr(t, kind).elem_type] if kind in ("sequence_type", "optional_type") else []
    return False


def string_tensors(path: str) -> Optional[str]:
    """Where the ONNX graph at `path` makes a string tensor (None: nowhere). onnxruntime's arena, capped, counts a
    string tensor's slots and not the bytes of its strings, so a small file tiling one long string takes gigabytes
    past the cap. Looked for in the graph and every subgraph (If, Loop, Scan bodies) and local function: string
    initializers and constants (tensor and sparse tensor attributes, Constant's value_string(s)), casts to STRING,
    the operators that make strings, and every value whose type is a string, after onnx's shape inference.
    hvd-train's exports make none."""
    import onnx
    from onnx import shape_inference

    model = onnx.load(path, load_external_data=False)  # the graph only: external data is read by onnxruntime
    try:
        model = shape_inference.infer_shapes(model)
    except Exception:  # a graph onnx cannot infer: onnxruntime will say what is wrong, and the checks below hold
        pass
    graphs = [("the graph", model.graph)]
    nodes = [(f"function {f.name}", node) for f in model.functions for node in f.node]
    while graphs or nodes:
        if graphs:
            where, graph = graphs.pop()
            for tensor in graph.initializer:
                if tensor.data_type == STRING:
                    return f"initializer {tensor.name!r} of {where} is a string tensor"
            for sparse in graph.sparse_initializer:
                if sparse.values.data_type == STRING:
                    return f"initializer {sparse.values.name!r} of {where} is a string tensor"
            for value in [*graph.input, *graph.output, *graph.value_info]:
                if holds_string(value.type):
                    return f"value {value.name!r} of {where} is a string"
            nodes += [(where, node) for node in graph.node]
            continue
        where, node = nodes.pop()
        named = f"{node.op_type} node {node.name!r} of {where}"
        if node.op_type in STRING_OPERATORS or node.domain in STRING_DOMAINS:
            return f"{named} makes strings"
        for attr in node.attribute:
            tensors = [attr.t] if attr.HasField("t") else []
            tensors += [*attr.tensors, *([attr.sparse_tensor.values] if attr.HasField("sparse_tensor") else []),
                        *(s.values for s in attr.sparse_tensors)]
            types = [*([attr.tp] if attr.HasField("tp") else []), *attr.type_protos]
            if any(t.data_type == STRING for t in tensors) or any(holds_string(t) for t in types):
                return f"{named} holds a string tensor in its attribute {attr.name!r}"
            if node.op_type == "Constant" and attr.name in ("value_string", "value_strings"):
                return f"{named} makes a string tensor ({attr.name})"
            if attr.name in TYPE_ATTRIBUTES and attr.type == onnx.AttributeProto.INT and attr.i == STRING:
                return f"{named} makes a string tensor ({attr.name}=STRING)"
            subgraphs = [*([attr.g] if attr.HasField("g") else []), *attr.graphs]
            graphs += [(f"{named} ({attr.name})", g) for g in subgraphs]
    return None


def open_session(path: str, cap: int) -> "ort.InferenceSession":
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # its errors reach the user once, as one line, not as a coloured log
    arena = ort.OrtArenaCfg({"max_mem": cap, "arena_extend_strategy": 1})  # grow by what is asked, not doubling
    ort.create_and_register_allocator(ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                                        ort.OrtMemType.DEFAULT), arena)
    options.add_session_config_entry("session.use_env_allocators", "1")
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"],
                                disabled_optimizers=["ConstantFolding"])


def child(path: str, cap: int) -> int:
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    try:
        strings = string_tensors(path)
    except Exception as e:  # not a protobuf onnx reads (onnxruntime reads the same format)
        send(out, {"error": f"cannot be read as an ONNX model ({one_line(e)})"})
        return 0
    if strings:
        send(out, {"error": f"its graph makes string tensors ({strings}), whose bytes the memory cap on an ONNX "
                            f"model does not bound (onnxruntime counts a string's slot, not its characters); "
                            f"hvd-train's exports make none, so it is refused: export the model again with "
                            f"hvd-train export"})
        return 0
    try:
        session = open_session(path, cap)
    except Exception as e:  # a graph onnxruntime refuses: external data outside the folder, an unknown operator
        send(out, {"error": f"onnxruntime cannot load it: {one_line(e)}"})
        return 0
    names = [i.name for i in session.get_inputs()]
    send(out, {"ready": names})
    while True:
        header, batch = receive(inp)
        if header is None:
            return 0
        try:
            if len(batch) != len(names):
                raise ValueError(f"the model takes {len(names)} input(s) ({', '.join(names)}), and {len(batch)} "
                                 f"were given")
            results = session.run(None, dict(zip(names, batch)))
        except Exception as e:
            asked = re.search(r"Available memory of \d+ is smaller than requested bytes of (\d+)", str(e))
            text = (f"its graph asks for {int(asked.group(1)) / 2**20:,.0f} MiB at once, past the bound of "
                    f"{cap / 2**20:,.0f} MiB an ONNX model may take here; if you trust this file, raise the bound "
                    f"with --max-memory-mb") if asked else f"onnxruntime failed: {one_line(e)}"
            send(out, {"error": text})
            continue
        send(out, {"arrays": described(results)}, results)


class Session:
    """run(batch) -> list of output arrays, in a child process whose onnxruntime takes at most `cap` bytes."""

    def __init__(self, path: str, cap: int) -> None:
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, path, str(cap)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        weakref.finalize(self, Session._end, self.proc)
        self.input_names = self._answer()["ready"]

    def _answer(self) -> dict[str, Any]:
        header, arrays = receive(cast(IO[bytes], self.proc.stdout))
        if header is None:
            code = self.proc.wait()
            raise RuntimeError(f"onnxruntime ended without an answer (exit status {code})")
        if "error" in header:
            raise RuntimeError(header["error"])
        return dict(header, arrays=arrays)

    def run(self, inputs: Sequence["np.ndarray"]) -> list["np.ndarray"]:
        """The outputs for `inputs`: one array for each of the model's inputs, in the graph's order."""
        send(cast(IO[bytes], self.proc.stdin), {"arrays": described(inputs)}, inputs)
        return self._answer()["arrays"]

    @staticmethod
    def _end(proc: "subprocess.Popen[bytes]") -> None:
        if proc.poll() is None:
            cast(IO[bytes], proc.stdin).close()  # the child ends at the end of its input
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    sys.exit(child(sys.argv[1], int(sys.argv[2])))
