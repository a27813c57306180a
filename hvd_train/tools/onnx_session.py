"""An ONNX model run in a process of its own, with a bound on the memory onnxruntime may take.

An ONNX file is data, but its graph says what to allocate: a 3 KB file whose graph makes a tensor of 1.5 billion
elements would take 6 GB before its output could be checked. Here every allocation onnxruntime makes comes from one
arena capped at a given number of bytes (an allocation past it fails the run, with the cap named), constant folding
at load time is off (it would allocate outside that arena), and the session lives in a child process that imports
numpy and onnxruntime only, so a model that crashes onnxruntime takes nothing else with it.

The parent sends each batch (an array for each of the graph's inputs, in its order) and reads the outputs through
the child's stdin and stdout: a JSON line, then the raw bytes of each array. `python -m
hvd_train.tools.onnx_session MODEL CAP_BYTES` is the child.
"""
import json
import re
import subprocess
import sys
import weakref

DTYPES = ("float32", "float64", "float16", "int64", "int32", "int8", "uint8", "bool")  # what exports take and give


def send(stream, header, arrays=()):
    stream.write((json.dumps(header) + "\n").encode())
    for array in arrays:
        stream.write(array.tobytes())
    stream.flush()


def receive(stream):
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


def described(arrays):
    return [[str(a.dtype), list(a.shape)] for a in arrays]


def one_line(error):
    """onnxruntime's message, first line, without the source location it prefixes."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split("Status Message: ")[-1][:400]


def open_session(path, cap):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # its errors reach the user once, as one line, not as a coloured log
    arena = ort.OrtArenaCfg({"max_mem": cap, "arena_extend_strategy": 1})  # grow by what is asked, not doubling
    ort.create_and_register_allocator(ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                                        ort.OrtMemType.DEFAULT), arena)
    options.add_session_config_entry("session.use_env_allocators", "1")
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"],
                                disabled_optimizers=["ConstantFolding"])


def child(path, cap):
    out, inp = sys.stdout.buffer, sys.stdin.buffer
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

    def __init__(self, path, cap):
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, path, str(cap)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        weakref.finalize(self, Session._end, self.proc)
        self.input_names = self._answer()["ready"]

    def _answer(self):
        header, arrays = receive(self.proc.stdout)
        if header is None:
            code = self.proc.wait()
            raise RuntimeError(f"onnxruntime ended without an answer (exit status {code})")
        if "error" in header:
            raise RuntimeError(header["error"])
        return dict(header, arrays=arrays)

    def run(self, inputs):
        """The outputs for `inputs`: one array for each of the model's inputs, in the graph's order."""
        send(self.proc.stdin, {"arrays": described(inputs)}, inputs)
        return self._answer()["arrays"]

    @staticmethod
    def _end(proc):
        if proc.poll() is None:
            proc.stdin.close()  # the child ends at the end of its input
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    sys.exit(child(sys.argv[1], int(sys.argv[2])))
