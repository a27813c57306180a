"""Files handed over by someone else, second pass (docs/reliability.md: What is code and what is data). Each test is
an attack as it was written: a recipe or run directory whose shard location braces bring a command to the front, or
whose tracking URI would take the user's MLflow credentials; a small checkpoint, card, ONNX file or PNG that would
take gigabytes; links planted where the app writes; secrets in `--flag=value` form and in curl's command line; and
what must be refused in one line rather than a traceback. Memory is measured as the peak resident set of the real
command (and of the processes it waited for), against the same command on a benign file."""
import http.server
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import yaml

from conftest import BIN, QUIET, ROOT, TRAIN, assert_refused, job_env, launch, read_json, shard_flags

MiB = 2**20
# What an attack may add to the peak memory of the same command on a benign file of the same kind.
ALLOWANCE = 256 * MiB


@pytest.fixture(scope="module")
def trained(digits_run):
    """A real run directory: the small CNN on the digits, one epoch, one process (conftest's digits_run)."""
    return digits_run


def handed_over(trained, tmp_path, change_config=None):
    """A copy of the trained run directory, its config.json changed by change_config(dict): what a user is given."""
    run = tmp_path / "given"
    shutil.copytree(trained, run)
    if change_config:
        config = read_json(run / "config.json")
        change_config(config)
        (run / "config.json").write_text(json.dumps(config))
    return run


def an_image(path, size=8):
    from PIL import Image

    Image.fromarray(np.zeros((size, size), dtype=np.uint8)).save(path)
    return str(path)


# Runs a command and writes its peak resident set (its own, and the largest of the processes it waited for). From
# a small interpreter: a process forked from this one would count this one's resident set as its own at exec.
MEASURE = ("import os, subprocess, sys\n"
           "proc = subprocess.Popen(sys.argv[2:])\n"
           "_, status, usage = os.wait4(proc.pid, 0)\n"
           "open(sys.argv[1], 'w').write(str(usage.ru_maxrss * 1024))\n"
           "code = os.waitstatus_to_exitcode(status)\n"
           "sys.exit(code if code >= 0 else 128 - code)\n")


def peak_of_command(cmd, tmp_path, env=None):
    """(exit code, output, peak resident bytes) of `cmd` run to its end."""
    n = len(list(tmp_path.glob("command-*.log")))
    log, peak = tmp_path / f"command-{n}.log", tmp_path / f"command-{n}.peak"
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-c", MEASURE, str(peak), *map(str, cmd)], stdout=out,
                              stderr=subprocess.STDOUT, cwd=ROOT, env={**job_env(), **(env or {})}, timeout=600)
    return proc.returncode, log.read_text(), int(peak.read_text())


def predict_command(*args):
    return [BIN / "hvd-train", "predict", *args]


def predicted(tool, *args, env=None):
    """(exit code, output) of `hvd-train predict ARGS` run in this process (the tool fixture): for the tests that
    read what predict says, not the memory it took."""
    result = tool("predict", *args, env=env)
    return result.returncode, result.stdout + result.stderr


def one_error_line(output, program="hvd-train predict"):
    lines = [line for line in output.splitlines() if f"{program}: error:" in line]
    assert len(lines) == 1 and "Traceback" not in output, output[-3000:]
    return lines[0]


# --------------------------------------------------------------------------------------------------------------------
# 1. A command brought to the front by braces, in any case


BRACED = ["{pipe:touch MARKER;echo,pipe:touch MARKER;echo} t.tar", "PIPE:touch MARKER", "a.tar::{p,x}ipe:touch MARKER"]


def shard_settings(tmp_path, location):
    marker = tmp_path / "PWNED"
    location = location.replace("MARKER", str(marker))
    return marker, {"dataset": "shards", "train_shards": location, "val_shards": location,
                    "shard_index": str(tmp_path / "index.json")}


@pytest.mark.parametrize("location", BRACED)
def test_a_recipes_shard_location_that_expands_to_a_command_runs_nothing(tmp_path, app, location):
    marker, data = shard_settings(tmp_path, location)
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(yaml.safe_dump({"data": data}))
    assert_refused(app("--config", recipe, "--output-dir", tmp_path / "out"), "data.train_shards", "pipe:",
                   "--trust-code")
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("mode", ["resume", "evaluate"])
def test_a_run_directorys_config_that_expands_to_a_command_runs_nothing(tmp_path, app, trained, mode):
    marker, data = shard_settings(tmp_path, BRACED[0])
    run = handed_over(trained, tmp_path, lambda c: c["data"].update(data))
    args = ["--output-dir", run, "--resume", "auto", "--epochs", "2"] if mode == "resume" else \
        ["--output-dir", tmp_path / "eval", "--evaluate", "--resume", run / "checkpoints" / "last.pt"]
    assert_refused(app(*args), "config.json", "data.train_shards", "a pipe: command")
    assert not marker.exists()


def test_a_pattern_that_expands_without_bound_is_refused_before_it_is_listed(tmp_path, app):
    result = app("--dataset", "shards", "--data.train_shards", "s-{0000000000..9999999999}.tar", "--data.val_shards",
                 "v.tar", "--output-dir", tmp_path / "out")
    assert_refused(result, "--data.train_shards", "more than 1,000,000 shard names")


# --------------------------------------------------------------------------------------------------------------------
# 2. A file choosing the tracking server, and so where the user's credentials go


@pytest.fixture
def listener():
    """A TCP listener on loopback that records every connection made to it; yields (URI, connections)."""
    connections = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.settimeout(0.2)
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            conn.settimeout(2)
            try:
                connections.append(conn.recv(65536))
            except OSError:
                connections.append(b"")
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", connections
    finally:
        stop.set()
        thread.join()
        sock.close()


CREDENTIALS = {"MLFLOW_TRACKING_TOKEN": "token-of-the-user-4711", "MLFLOW_TRACKING_USERNAME": "alice",
               "MLFLOW_TRACKING_PASSWORD": "password-of-the-user-4711"}


def test_a_recipe_that_names_a_tracking_server_sends_nothing_there(tmp_path, app, listener):
    uri, connections = listener
    recipe = tmp_path / "shared-recipe.yaml"
    recipe.write_text(yaml.safe_dump({"logging": {"mlflow_uri": uri}, "optim": {"epochs": 1}}))
    assert_refused(app("--config", recipe, "--output-dir", tmp_path / "out", env=CREDENTIALS), "logging.mlflow_uri",
                   "credentials", "--trust-code")
    assert connections == []


def test_a_handed_over_run_that_names_a_tracking_server_sends_nothing_there(tmp_path, app, trained, listener):
    uri, connections = listener
    run = handed_over(trained, tmp_path, lambda c: c["logging"].update(mlflow_uri=uri, mlflow=True))
    before = (run / "config.json").read_text()
    assert_refused(app("--output-dir", run, "--resume", "auto", "--epochs", "2", env=CREDENTIALS),
                   "logging.mlflow_uri", "config.json")
    assert connections == [] and (run / "config.json").read_text() == before


# --------------------------------------------------------------------------------------------------------------------
# 3. A checkpoint whose members are compressed


def deflated(source, dest):
    """`source`, a torch.save archive, rewritten with every member DEFLATE-compressed."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as out:
        for member in src.infolist():
            with src.open(member) as data, out.open(member.filename, "w", force_zip64=True) as copy:
                shutil.copyfileobj(data, copy, 2**22)
    return dest


@pytest.fixture(scope="module")
def inflating(trained, tmp_path_factory):
    """The trained checkpoint with 512 MiB of zeros added to its weights, every member compressed: a 1 MB file."""
    folder = tmp_path_factory.mktemp("inflating")
    ckpt = torch.load(trained / "checkpoints" / "last.pt", weights_only=True)
    ckpt["model"]["padding"] = torch.zeros(128 * MiB)
    torch.save(ckpt, folder / "stored.pt")
    del ckpt
    evil = deflated(folder / "stored.pt", folder / "evil.pt")
    os.remove(folder / "stored.pt")
    assert os.path.getsize(evil) < 4 * MiB
    return evil


def test_a_compressed_checkpoint_is_refused_unread_by_predict_resume_and_init_from(tmp_path, trained, inflating):
    image = an_image(tmp_path / "x.png")
    _, _, benign = peak_of_command(predict_command(trained, image), tmp_path)
    code, output, peak = peak_of_command(predict_command(inflating, image), tmp_path)
    assert code == 2 and "is compressed" in one_error_line(output) and "refused unread" in output, output
    assert peak < benign + ALLOWANCE, (peak, benign)
    code, output, peak = peak_of_command([sys.executable, TRAIN, *QUIET, "--output-dir", tmp_path / "init",
                                          "--epochs", "1", "--init-from", inflating], tmp_path)
    assert code == 2 and "is compressed" in one_error_line(output, "train_hvd.py"), output
    assert peak < benign + ALLOWANCE, (peak, benign)
    run = handed_over(trained, tmp_path)
    shutil.copy(inflating, run / "checkpoints" / "last.pt")
    code, output, _ = peak_of_command([sys.executable, TRAIN, *QUIET, "--output-dir", run, "--resume", "auto",
                                       "--epochs", "2"], tmp_path)
    assert code == 2 and "is compressed" in one_error_line(output, "train_hvd.py"), output


def test_init_from_refuses_pickled_code_without_repeating_torchs_advice(tmp_path, app):
    import argparse

    torch.save({"w": torch.zeros(2), "what": argparse.Namespace(a=1)}, tmp_path / "pickled.pt")  # a class: code
    line = assert_refused(app("--output-dir", tmp_path / "out", "--init-from", tmp_path / "pickled.pt"),
                          "--init-from", "could run code")
    assert "weights_only" not in line


# --------------------------------------------------------------------------------------------------------------------
# 4. A card that makes a small file's model take gigabytes (a non-persistent buffer)


SWIN = "timm/swin_tiny_patch4_window7_224"
SWIN_ARGS = {"window_size": 128, "depths": [1], "num_heads": [1], "embed_dim": 4, "img_size": 512}


def test_a_card_whose_model_computes_huge_buffers_is_refused_before_it_is_built(tmp_path, trained):
    from hvd_train import models
    from hvd_train.registry import call

    ckpt = torch.load(trained / "checkpoints" / "last.pt", weights_only=True)
    ckpt["model_card"].update(model=SWIN, model_args=SWIN_ARGS)
    with torch.device("meta"):
        planned = call(models.find_model(SWIN), ckpt["model_card"]["facts"], SWIN_ARGS, "", SWIN)
    ckpt["model"] = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in planned.state_dict().items()}
    torch.save(ckpt, tmp_path / "swin.pt")
    assert os.path.getsize(tmp_path / "swin.pt") < MiB
    image = an_image(tmp_path / "x.png")
    _, _, benign = peak_of_command(predict_command(trained, image), tmp_path)
    code, output, peak = peak_of_command(predict_command(tmp_path / "swin.pt", image), tmp_path)
    assert code == 2 and "in parameters and buffers" in one_error_line(output), output
    assert peak < benign + ALLOWANCE, (peak, benign)


def test_a_card_whose_model_cannot_be_sized_on_the_meta_device_is_refused_unless_trusted(
        tmp_path, trained, capsys, monkeypatch):
    # A model that ships and cannot be built on the meta device (none of today's: this one is added to the
    # registry for the test) would be built unchecked; it is refused, and --trust-code builds it.
    from hvd_train import models
    from hvd_train.tools import predict

    def unsized(in_channels, num_classes, image_size, width=32):
        if torch.empty(0).is_meta:
            raise RuntimeError("needs real tensors")
        return models.MODELS["small_cnn"](in_channels, num_classes, image_size, width)

    monkeypatch.setitem(models.MODELS, "unsized", unsized)
    ckpt = torch.load(trained / "checkpoints" / "last.pt", weights_only=True)
    ckpt["model_card"]["model"] = "unsized"
    torch.save(ckpt, tmp_path / "unsized.pt")
    image = an_image(tmp_path / "x.png")
    assert predict.main([str(tmp_path / "unsized.pt"), image]) == 2
    err = capsys.readouterr().err
    assert "cannot be built on PyTorch's meta device" in err and "--trust-code" in err and "Traceback" not in err
    assert predict.main([str(tmp_path / "unsized.pt"), image, "--trust-code"]) == 0


# --------------------------------------------------------------------------------------------------------------------
# 5. An ONNX file whose graph allocates gigabytes


def evil_onnx(path, elements=1_500_000_000):
    """An ONNX classifier of 8 x 8 grey images (the digits) whose logits add the sum of `elements` ones."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inputs = [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 1, 8, 8])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])]
    weights = [numpy_helper.from_array(np.ones((64, 10), np.float32), "W"),
               numpy_helper.from_array(np.array([elements], np.int64), "shape"),
               numpy_helper.from_array(np.array([-1, 64], np.int64), "flat")]
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    nodes = [helper.make_node("Reshape", ["images", "flat"], ["f"]), helper.make_node("MatMul", ["f", "W"], ["mm"]),
             helper.make_node("ConstantOfShape", ["shape"], ["big"], value=one),
             helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
             helper.make_node("Add", ["mm", "s"], ["logits"])]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, weights),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def exported(trained):
    """The trained run's ONNX export (its model.onnx.json is the sidecar an attacker copies)."""
    return trained / "export" / "model.onnx"


def test_an_onnx_graph_that_allocates_gigabytes_is_stopped_at_its_memory_bound(tmp_path, exported):
    evil = evil_onnx(tmp_path / "model.onnx")
    shutil.copy(str(exported) + ".json", str(evil) + ".json")
    assert os.path.getsize(evil) < 4096
    image = an_image(tmp_path / "x.png")
    code, output, benign = peak_of_command(predict_command(exported, image), tmp_path)
    assert code == 0, output
    code, output, peak = peak_of_command(predict_command(evil, image), tmp_path)
    line = one_error_line(output)
    assert code == 2 and "past the bound of 256 MiB" in line and "--max-memory-mb" in line, output
    assert peak < benign + ALLOWANCE, (peak, benign)


def test_an_onnx_file_with_external_data_outside_its_folder_is_refused_in_one_line(tmp_path, exported, capsys):
    import onnx
    from onnx import TensorProto

    from hvd_train.tools import predict

    model = onnx.load(str(exported))
    weight = next(w for w in model.graph.initializer if len(w.dims) > 1)
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    entry = weight.external_data.add()
    entry.key, entry.value = "location", "../../etc/hostname"
    (tmp_path / "m").mkdir()
    onnx.save(model, str(tmp_path / "m" / "model.onnx"))
    shutil.copy(str(exported) + ".json", tmp_path / "m" / "model.onnx.json")
    assert predict.main([str(tmp_path / "m" / "model.onnx"), an_image(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "onnxruntime cannot load it" in err and "Traceback" not in err, err


# --------------------------------------------------------------------------------------------------------------------
# 6. Links planted where the app writes


def test_a_resumed_run_replaces_a_planted_curves_link_and_never_writes_through_it(tmp_path, app, trained):
    run = handed_over(trained, tmp_path)
    victim = tmp_path / "bashrc"
    victim.write_text("precious\n")
    os.remove(run / "curves.png") if (run / "curves.png").exists() else None
    os.symlink(victim, run / "curves.png")
    result = app("--output-dir", run, "--resume", "auto", "--epochs", "2", "--logging.plot=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert victim.read_text() == "precious\n"
    assert not (run / "curves.png").is_symlink() and (run / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_overwrite_removes_a_planted_folder_link_not_what_it_points_to(tmp_path, app, trained):
    run = handed_over(trained, tmp_path)
    kept = tmp_path / "someone-elses"
    kept.mkdir()
    (kept / "data.txt").write_text("kept")
    shutil.rmtree(run / "tensorboard", ignore_errors=True)
    os.symlink(kept, run / "tensorboard")
    assert app("--output-dir", run, "--overwrite", "--epochs", "1").returncode == 0
    assert (kept / "data.txt").read_text() == "kept" and not (run / "tensorboard").is_symlink()


def test_the_output_directory_probe_never_opens_a_planted_link(tmp_path):
    from hvd_train.run.directory import check_writable

    victim = tmp_path / "victim"
    victim.write_text("precious")
    root = tmp_path / "out"
    root.mkdir()
    os.symlink(victim, root / f".write-test.{os.getpid()}")  # the name the probe used to take
    check_writable(str(root))
    assert victim.read_text() == "precious"


def test_the_shard_writer_never_writes_through_planted_temporary_names(tmp_path):
    out = tmp_path / "shards"
    out.mkdir()
    victims = []
    for name in ("train-000000.tar.tmp", "index.json.tmp", "val-000000.tar.tmp"):
        victims.append(tmp_path / f"victim-{name}")
        victims[-1].write_text("precious")
        os.symlink(victims[-1], out / name)
    launch("single", 1, BIN / "hvd-train", "shard", "--from", "digits", "--out", out, "--shard-size", "1000")
    assert all(v.read_text() == "precious" for v in victims)
    assert read_json(out / "index.json")["shards"]["train-000000.tar"] == 1000


# --------------------------------------------------------------------------------------------------------------------
# 7. Secrets in the --flag=value form, and in curl's command line


def test_a_credential_in_the_equals_form_of_the_mlflow_uri_reaches_no_file(tmp_path, app, server):
    uri, _, _ = server
    secret = "s3cr3t-pw-0815"
    run = tmp_path / "run"
    with_credentials = uri.replace("http://", f"http://bob:{secret}@")
    result = app("--output-dir", run, "--epochs", "1", f"--mlflow-uri={with_credentials}",
                 "--wandb")
    assert result.returncode == 0, result.stderr[-3000:]
    assert secret not in result.stdout + result.stderr
    held = [str(p) for p in run.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert held == [] and any(run.glob("wandb/offline-run-*"))


class Recording(http.server.SimpleHTTPRequestHandler):
    """Serves files; before answering, records the command lines of every curl process on the machine."""
    seen = []

    def do_GET(self):
        for proc in psutil.process_iter(["name", "cmdline"]):
            if proc.info["name"] == "curl":
                self.seen.append(" ".join(proc.info["cmdline"] or []))
        super().do_GET()

    def log_message(self, *args):
        pass


def test_a_shard_urls_token_is_never_on_curls_command_line(tmp_path):
    from hvd_train.data.shards import open_location

    (tmp_path / "index.json").write_text('{"x": 1}')
    handler = lambda *a, **kw: Recording(*a, directory=str(tmp_path), **kw)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/index.json?token=tok-of-the-user-99"
        with open_location(url) as f:
            assert f.read() == b'{"x": 1}'
    finally:
        httpd.shutdown()
        thread.join()
    assert Recording.seen and not any("tok-of-the-user-99" in line for line in Recording.seen), Recording.seen


# --------------------------------------------------------------------------------------------------------------------
# 8. Card facts that would reach a factory's **kwargs


def test_a_cards_facts_cannot_make_timm_read_a_file(tmp_path, trained, capsys):
    from hvd_train.tools import predict

    ckpt = torch.load(trained / "checkpoints" / "last.pt", weights_only=True)
    ckpt["model_card"]["facts"]["checkpoint_path"] = "/etc/hostname"
    torch.save(ckpt, tmp_path / "facts.pt")
    assert predict.main([str(tmp_path / "facts.pt"), an_image(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "model.facts.checkpoint_path" in err and "--trust-code" in err and "Traceback" not in err, err


# --------------------------------------------------------------------------------------------------------------------
# 9. Amplification, and one line instead of a traceback


def png_header(path, width, height, bit_depth=16):
    """A grey PNG that declares width x height pixels of `bit_depth` bits and holds none of them."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, bit_depth, 0, 0,
                                                                       0, 0)) + chunk(b"IEND", b""))
    return str(path)


def test_an_image_past_the_pixel_bound_is_refused_from_its_header_and_the_bound_can_be_raised(
        tmp_path, trained, tool):
    big = png_header(tmp_path / "big.png", 13370, 13370)
    code, output = predicted(tool, trained, big)
    line = one_error_line(output)
    assert code == 2 and "13370 x 13370 pixels" in line and "HVD_MAX_IMAGE_PIXELS" in line, output
    small = an_image(tmp_path / "small.png", size=64)
    code, output = predicted(tool, trained, small, env={"HVD_MAX_IMAGE_PIXELS": "1000"})
    assert code == 2 and "64 x 64 pixels, more than the 1,000" in one_error_line(output), output


def test_a_16_bit_image_is_scaled_without_a_wide_copy_of_it(tmp_path):
    from PIL import Image

    from hvd_train.data.images import as_mode

    values = (np.arange(4000 * 4000, dtype=np.uint32) * 7 % 65536).astype(np.uint16).reshape(4000, 4000)
    Image.fromarray(values).save(tmp_path / "deep.png")
    with Image.open(tmp_path / "deep.png") as image:
        assert image.mode == "I;16"
        tracemalloc.start()
        try:
            grey = np.asarray(as_mode(image, "L"))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert np.array_equal(grey[::97, ::89], ((values[::97, ::89].astype(np.int64) * 255 + 32767) // 65535))
    assert peak < 128 * MiB, peak  # the image as int64 alone is 128 MB (the old conversion peaked at 259)


@pytest.mark.parametrize("text", ["a: " + "[" * 20000 + "]" * 20000 + "\n",
                                  "optim:\n  epochs: " + "9" * 5000 + "\n"], ids=["nested", "digits"])
def test_a_recipe_nested_deep_or_with_a_huge_integer_is_one_line(tmp_path, app, text):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    assert_refused(app("--config", recipe, "--output-dir", tmp_path / "out"), f"--config {recipe}")


def test_a_run_directorys_config_nested_deep_is_one_line(tmp_path, app, trained):
    run = handed_over(trained, tmp_path)
    (run / "config.json").write_text('{"a": ' + "[" * 20000 + "]" * 20000 + "}")
    assert_refused(app("--output-dir", run, "--resume", "auto", "--epochs", "2"), "config.json", "nest")


def test_a_shard_index_nested_deep_is_one_line(tmp_path, app):
    (tmp_path / "index.json").write_text("[" * 100000 + "]" * 100000)
    (tmp_path / "t.tar").write_bytes(b"")
    result = app("--dataset", "shards", "--data.train_shards", tmp_path / "t.tar", "--data.val_shards",
                 tmp_path / "t.tar", "--output-dir", tmp_path / "out")
    assert_refused(result, "shard index", "nest")


def test_export_works_for_a_run_trained_on_shards(tmp_path, app, tool, digits_shards):
    result = app(*shard_flags(digits_shards), "--output-dir", tmp_path / "run", "--epochs", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    result = tool("export", tmp_path / "run", "--format", "onnx")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "parity on 16 validation samples of shards" in result.stdout and "top-1 agrees" in result.stdout, \
        result.stdout
    assert Path(tmp_path / "run" / "export" / "model.onnx").is_file()


def test_shard_names_are_counted_exactly_as_braceexpand_makes_them():
    import random

    import braceexpand

    from hvd_train.provenance import names_in

    def made(pattern):
        try:
            return len(list(braceexpand.braceexpand(pattern)))
        except ValueError:  # unbalanced braces
            return None

    def counted(pattern):
        try:
            return names_in(pattern)
        except ValueError:
            return None

    rng = random.Random(0)
    patterns = ["python{2.{5..7},3.{2,3}}", "{a..Z}", "{Z..a..3}", "{5..5..0}", "{1\\{2,3}", "}{a,b}{", "{,a}"]
    patterns += ["".join(rng.choice("{},.-09aZz\\") for _ in range(rng.randint(0, 12))) for _ in range(5000)]
    assert [counted(p) for p in patterns] == [made(p) for p in patterns]
