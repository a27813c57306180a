"""Files handed over by someone else, third pass (docs/reliability.md: What is code and what is data): each test is
an attack as it was written, run through the real command (hvd-train predict, training on shards, --init-from), and
proves that reading the file runs none of its code and allocates within a bound, and that every refusal is one line
with exit 2, never a traceback:
- a TorchScript export is a program: predict refuses it without --trust-code (before torch.jit.load runs it), and
  with --trust-code runs it (an honest export; the attacker's file would write to the user's files);
- a tar shard's member is bounded by what its header declares (a 10 KB sparse tar, a 1 MB gzip of zeros that
  declare a gigabyte), and the inflated stream by what tarfile reads of it (a gzip'ed GNU long name of 512 MiB);
- an ONNX graph that makes string tensors (whose bytes onnxruntime's capped arena does not count) is refused before
  a session is made, in the main graph and in a subgraph;
- a safetensors file whose header runs past the file or is not JSON, an export's .json nested deep, and a shard
  sample whose class is outside the index's num_classes are each refused in one line.
Memory is measured as tests/unit/test_handed_over_files.py measures it: the peak resident set of the real command
and of the processes it waited for, against the same command on a benign file."""
import gzip
import io
import json
import os
import shutil
import struct
import sys
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import QUIET, TRAIN, AppResult, assert_refused, shard_flags
from test_handed_over_files import ALLOWANCE, MiB, an_image, one_error_line, peak_of_command, predict_command, predicted


@pytest.fixture(scope="module")
def trained(digits_run):
    """A real run directory and its three exports (conftest's digits_run)."""
    return digits_run


def export_of(trained, fmt):
    return trained / "export" / ("model.torchscript.pt" if fmt == "torchscript" else f"model.{fmt}")


def handed_over(trained, tmp_path, fmt, content=None):
    """An export file of `fmt` in a folder of its own with the honest export's .json beside it: the file itself, or
    `content` (bytes) in its place. Returns its path."""
    folder = tmp_path / "given"
    folder.mkdir(exist_ok=True)
    honest = export_of(trained, fmt)
    path = folder / honest.name
    shutil.copy(str(honest) + ".json", str(path) + ".json")
    if content is None:
        shutil.copy(honest, path)
    else:
        path.write_bytes(content)
    return path


# --------------------------------------------------------------------------------------------------------------------
# 3. A TorchScript export is code


class WritesAFile(torch.nn.Module):
    """What an attacker exports: a digits classifier whose forward maps the file at `target` writable (creating it)
    and writes into it, in TorchScript's own language (torch.from_file, shared)."""

    def __init__(self, target: str):
        super().__init__()
        self.target = target

    def forward(self, images):
        mapped = torch.from_file(self.target, shared=True, size=7, dtype=torch.uint8)
        mapped.copy_(torch.tensor([80, 87, 78, 69, 68, 33, 10], dtype=torch.uint8))  # "PWNED!\n"
        return torch.zeros(images.shape[0], 10) + mapped[0].float() * 0


def test_a_torchscript_export_runs_only_with_trust_code(tmp_path, trained, tool):
    marker = tmp_path / "PWNED"
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchScript's deprecation
        torch.jit.save(torch.jit.script(WritesAFile(str(marker))), buffer)
    evil = handed_over(trained, tmp_path, "torchscript", buffer.getvalue())
    image = an_image(tmp_path / "x.png")
    code, output = predicted(tool, evil, image)
    line = one_error_line(output)
    assert code == 2 and "TorchScript" in line and "a program" in line and "--trust-code" in line, output
    assert "onnx or safetensors" in line and not marker.exists()
    # The honest export is refused the same way, and runs with --trust-code.
    honest = export_of(trained, "torchscript")
    code, output = predicted(tool, honest, image)
    assert code == 2 and "--trust-code" in one_error_line(output), output
    code, output = predicted(tool, honest, image, "--trust-code")
    assert code == 0 and "top-1" in output and "error" not in output, output
    # What --trust-code means: the attacker's file, trusted, writes where it says.
    code, output = predicted(tool, evil, image, "--trust-code")
    assert code == 0 and marker.read_bytes() == b"PWNED!\n", output


# --------------------------------------------------------------------------------------------------------------------
# 7. Tar shard members, bounded by their headers; the inflated stream, by what is read


class Zeros:
    """A file of `size` zero bytes, read as tarfile reads a member's content."""

    def __init__(self, size, byte=b"\0"):
        self.left, self.byte = size, byte

    def read(self, size=-1):
        size = min(self.left, 2**20 if size is None or size < 0 else size)
        self.left -= size
        return self.byte * size


def add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def sparse_bomb(path, declared):
    """A tar of one sample whose image declares `declared` bytes and holds 512: a GNU sparse file (pax, 0.1), whose
    holes tarfile fills with zeros. 10 KB."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        add(tar, "000000000.cls", b"3")
        info = tarfile.TarInfo("000000000.png")
        info.size = 512
        info.pax_headers = {"GNU.sparse.map": "0,512", "GNU.sparse.size": str(declared)}
        tar.addfile(info, io.BytesIO(b"\x89PNG" + bytes(508)))


def gzip_bomb(path, size):
    """A gzip'ed tar of one sample whose image is `size` zero bytes: about 1 MB for each GB."""
    with tarfile.open(path, "w:gz", compresslevel=6) as tar:
        add(tar, "000000000.cls", b"3")
        info = tarfile.TarInfo("000000000.png")
        info.size = size
        tar.addfile(info, Zeros(size))


def long_name_bomb(path, size):
    """A gzip'ed tar whose first header is a GNU long name of `size` bytes, which tarfile reads whole before it
    yields any member (no header of a member it yields declares it)."""
    with gzip.open(path, "wb", compresslevel=6) as out:
        info = tarfile.TarInfo("././@LongLink")
        info.type, info.size = tarfile.GNUTYPE_LONGNAME, size
        out.write(info.tobuf(tarfile.GNU_FORMAT))
        shutil.copyfileobj(Zeros(size, b"a"), out, 2**20)
        out.write(bytes(-size % tarfile.BLOCKSIZE))
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.GNU_FORMAT) as tar:
            add(tar, "000000000.cls", b"3")


def shard_copy(digits_shards, tmp_path):
    """A copy of the digits' shards and index, for a test to change one shard of."""
    out = tmp_path / "shards"
    shutil.copytree(digits_shards, out)
    return out


def train_command(shards, tmp_path, name):
    return [sys.executable, TRAIN, *QUIET, "--output-dir", tmp_path / name, "--epochs", "1", *shard_flags(shards)]


BOMBS = {"sparse": lambda path: sparse_bomb(path, 2**30), "gzip of zeros": lambda path: gzip_bomb(path, 512 * MiB),
         "gzip'ed long name": lambda path: long_name_bomb(path, 512 * MiB)}


def test_tar_shard_members_are_bounded_before_they_are_read(tmp_path, digits_shards):
    code, output, benign = peak_of_command(train_command(digits_shards, tmp_path, "benign"), tmp_path)
    assert code == 0, output[-3000:]
    for n, (kind, write) in enumerate(BOMBS.items()):
        shards = shard_copy(digits_shards, tmp_path / f"bomb-{n}")
        write(shards / "train-000002.tar")
        assert os.path.getsize(shards / "train-000002.tar") < 2 * MiB
        code, output, peak = peak_of_command(train_command(shards, tmp_path, f"run-{n}"), tmp_path)
        assert peak < benign + ALLOWANCE, (kind, peak, benign, output[-2000:])  # refused or not, within the bound
        line = assert_refused(AppResult(code, output, ""), f"shard {shards}/train-000002.tar:", code=5)
        if kind == "gzip'ed long name":
            assert "headers (pax records, long names) take more than 1,048,576 bytes" in line, line
        else:
            assert "'000000000.png' declares 1,073,741,824 bytes" in line or \
                "'000000000.png' declares 536,870,912 bytes" in line, line
            assert "more than the 268,435,456" in line and "HVD_MAX_SHARD_MEMBER_BYTES" in line, line


def test_the_member_bound_is_the_environments_and_the_refusal_redacts_the_url(tmp_path, digits_shards, app):
    result = app("--output-dir", tmp_path / "out", "--epochs", "1", *shard_flags(digits_shards),
                 env={"HVD_MAX_SHARD_MEMBER_BYTES": "16"})
    line = assert_refused(result, "more than the 16 one file of a shard may take", "HVD_MAX_SHARD_MEMBER_BYTES",
                          code=5)
    assert f"shard {digits_shards}/train-" in line, line
    from hvd_train.errors import BadSampleError
    from hvd_train.data.shards import tar_files

    sparse_bomb(tmp_path / "s.tar", 2**30)
    with pytest.raises(BadSampleError, match=r"shard file://\S+s\.tar\?token=REDACTED: member '000000000.png' "
                                             r"declares 1,073,741,824 bytes"):
        list(tar_files(f"file://{tmp_path}/s.tar?token=secret-of-the-user", 256 * MiB))
    with pytest.raises(BadSampleError, match=r"member '000000000.png' is a sparse file"):  # below the bound
        list(tar_files(str(tmp_path / "s.tar"), 2**31))


# --------------------------------------------------------------------------------------------------------------------
# 8. ONNX string tensors, which onnxruntime's arena cap does not count


def digits_onnx(path, extra_nodes, extra=None, initializers=()):
    """An ONNX classifier of 8 x 8 grey images (the digits) whose logits add the scalar `extra`, which
    `extra_nodes` compute."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inputs = [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 1, 8, 8])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])]
    weights = [numpy_helper.from_array(np.ones((64, 10), np.float32), "W"),
               numpy_helper.from_array(np.array([-1, 64], np.int64), "flat"), *initializers]
    nodes = [helper.make_node("Reshape", ["images", "flat"], ["f"]), helper.make_node("MatMul", ["f", "W"], ["mm"]),
             *extra_nodes, helper.make_node("Add", ["mm", extra], ["logits"])]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, weights),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def tiled_string(copies=10_000, length=100_000):
    """Nodes that tile one string of `length` characters ("1.000...") `copies` times, cast to float and sum: a
    100 KB file that makes 1 GB of strings."""
    from onnx import TensorProto, helper, numpy_helper

    text = helper.make_tensor("text", TensorProto.STRING, [1], [b"1." + b"0" * (length - 2)])
    repeats = numpy_helper.from_array(np.array([copies], np.int64), "repeats")
    nodes = [helper.make_node("Constant", [], ["s"], value=text), helper.make_node("Tile", ["s", "repeats"], ["t"]),
             helper.make_node("Cast", ["t"], ["n"], to=TensorProto.FLOAT),
             helper.make_node("ReduceSum", ["n"], ["sum"], keepdims=0)]
    return nodes, "sum", [repeats]


def cast_in_a_branch():
    """An If whose branches cast a constant of ones to STRING and back: the strings in a subgraph."""
    from onnx import TensorProto, helper, numpy_helper

    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    branch = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["count"], ["ones"], value=one),
         helper.make_node("Cast", ["ones"], ["texts"], to=TensorProto.STRING),
         helper.make_node("Cast", ["texts"], ["back"], to=TensorProto.FLOAT),
         helper.make_node("ReduceSum", ["back"], ["o"], keepdims=0)],
        "branch", [], [helper.make_tensor_value_info("o", TensorProto.FLOAT, [])])
    yes = helper.make_tensor("yes", TensorProto.BOOL, [], [True])
    nodes = [helper.make_node("Constant", [], ["cond"], value=yes),
             helper.make_node("If", ["cond"], ["r"], then_branch=branch, else_branch=branch)]
    return nodes, "r", [numpy_helper.from_array(np.array([1000], np.int64), "count")]


@pytest.mark.parametrize("graph", ["tiled string", "cast in a branch"])
def test_an_onnx_graph_that_makes_strings_is_refused_before_a_session(tmp_path, trained, graph):
    nodes, extra, initializers = tiled_string() if graph == "tiled string" else cast_in_a_branch()
    evil = handed_over(trained, tmp_path, "onnx", b"")
    digits_onnx(evil, nodes, extra, initializers)
    assert os.path.getsize(evil) < 200_000
    image = an_image(tmp_path / "x.png")
    code, output, benign = peak_of_command(predict_command(export_of(trained, "onnx"), image), tmp_path)
    assert code == 0, output
    code, output, peak = peak_of_command(predict_command(evil, image), tmp_path)
    line = one_error_line(output)
    assert code == 2 and f"{evil}: its graph makes string tensors" in line, output
    assert "not bound" in line and ("branch" in line) == (graph == "cast in a branch"), line
    assert peak < benign + ALLOWANCE, (peak, benign)


def test_an_onnx_export_still_runs_under_the_string_check(tmp_path, trained, tool):
    # The digits' graph with no strings, written as the attacker's is: refused only for what it makes.
    from onnx import helper, numpy_helper

    honest = handed_over(trained, tmp_path, "onnx", b"")
    zero = numpy_helper.from_array(np.zeros(1, np.float32), "zero")
    digits_onnx(honest, [helper.make_node("Identity", ["zero"], ["z"])], "z", [zero])
    result = tool("predict", honest, an_image(tmp_path / "x.png"), "--json")
    assert result.returncode == 0 and json.loads(result.stdout)[0]["top"], result.stdout + result.stderr


# --------------------------------------------------------------------------------------------------------------------
# 16. One line, not a traceback: safetensors headers, a deep .json, a class outside num_classes


def forged_safetensors(honest, how):
    data = honest.read_bytes()
    length = int.from_bytes(data[:8], "little")
    if how == "header past the file":  # shorter than the file, longer than what follows its first 8 bytes
        return struct.pack("<Q", len(data) - 4) + data[8:]
    if how == "header far past the file":
        return struct.pack("<Q", 50 * len(data)) + data[8:]
    return data[:8] + b"{" + b"\xff" * (length - 1) + data[8 + length:]  # "header not JSON"


SAFETENSORS_CASES = ["header past the file", "header far past the file", "header not JSON"]


@pytest.mark.parametrize("how", SAFETENSORS_CASES)
def test_a_forged_safetensors_export_is_one_line_in_predict(tmp_path, trained, tool, how):
    evil = handed_over(trained, tmp_path, "safetensors", forged_safetensors(export_of(trained, "safetensors"), how))
    code, output = predicted(tool, evil, an_image(tmp_path / "x.png"))
    line = one_error_line(output)
    assert code == 2 and (f"{evil}: not a whole safetensors file: " in line or
                          f"{evil}: cannot be read as safetensors" in line), output


@pytest.mark.parametrize("how", SAFETENSORS_CASES)
def test_a_forged_safetensors_file_is_one_line_in_init_from(tmp_path, trained, app, how):
    evil = tmp_path / "weights.safetensors"
    evil.write_bytes(forged_safetensors(export_of(trained, "safetensors"), how))
    assert_refused(app("--output-dir", tmp_path / "out", "--epochs", "1", "--init-from", evil),
                   f"--init-from {evil}", "safetensors")
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.parametrize("depth", [100, 100_000])
def test_an_exports_json_nested_deep_is_one_line(tmp_path, trained, tool, depth):
    evil = handed_over(trained, tmp_path, "safetensors")
    sidecar = Path(str(evil) + ".json")
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "notes": "@"}).replace(
        '"@"', "[" * depth + "]" * depth))
    code, output = predicted(tool, evil, an_image(tmp_path / "x.png"))
    line = one_error_line(output)
    assert code == 2 and f"{evil}.json: its values nest more than 64 levels deep" in line, output


def relabelled(source, dest, label):
    """Shard `source` written again at `dest` with every sample's class replaced by `label` (bytes)."""
    with tarfile.open(source) as src, tarfile.open(dest, "w") as out:
        for member in src.getmembers():
            data = src.extractfile(member).read()
            if member.name.endswith(".cls"):
                data, member.size = label, len(label)
            out.addfile(member, io.BytesIO(data))


@pytest.mark.parametrize("label, needles", [(b"12", ("has class 12, outside 0 to 9", "num_classes 10")),
                                            (b"-1", ("has class -1, outside 0 to 9", "num_classes 10")),
                                            (b"cat", ("holds b'cat', not a class number",))])
def test_a_shard_sample_whose_class_is_out_of_range_is_one_line(tmp_path, digits_shards, app, label, needles):
    shards = shard_copy(digits_shards, tmp_path)
    relabelled(digits_shards / "train-000001.tar", shards / "train-000001.tar", label)
    result = app("--output-dir", tmp_path / "out", "--epochs", "1", *shard_flags(shards))
    assert_refused(result, f"shard {shards}/train-000001.tar: sample ", *needles, code=5)
