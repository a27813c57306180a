"""After training: hvd-train export (safetensors, TorchScript, ONNX, each checked against the PyTorch model) and
hvd-train predict (image files through the validation preprocessing), on runs of small_cnn, resnet18 and a user's
plug-in model; and the docs' lines that load a checkpoint for inference."""
import inspect
import json
import re
import subprocess
import textwrap

import onnxruntime
import pytest
import torch

from conftest import BIN, ROOT, job_env, run_app
from hvd_train.data.folders import transforms
from hvd_train.data.images import MEAN, STD
from hvd_train.trainer import Feed
from formats import write_image_folder

PLUGIN = '''
import torch
from torch import nn


class Spectrum(nn.Module):
    """Eigenvalues of a 4x4 Gram matrix of each image's features: an operator ONNX has no conversion for."""

    def forward(self, x):
        b = x.flatten(1)[:, :16].reshape(-1, 4, 4)
        return torch.linalg.eigvalsh(b @ b.transpose(1, 2))


class TinyNet(nn.Module):
    def __init__(self, in_channels, num_classes, width, spectral):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, 3, padding=1)
        self.spectrum = Spectrum() if spectral else None
        self.head = nn.Linear(4 if spectral else width, num_classes)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        return self.head(self.spectrum(x) if self.spectrum is not None else x.mean((2, 3)))


def tiny(in_channels, num_classes, width=8, spectral=False):
    return TinyNet(in_channels, num_classes, width, spectral)
'''
FORMATS = ("safetensors", "torchscript", "onnx")
# The tests read the same four trained runs (the module's fixture): on one worker they are trained once.
pytestmark = pytest.mark.xdist_group("export")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Trained runs: small_cnn on 2 ranks and resnet18 on photos in class folders, the plug-in on the digits."""
    root = tmp_path_factory.mktemp("export")
    photos = root / "photos"
    write_image_folder(photos, per_class=8, size=24)
    (root / "tinynets.py").write_text(PLUGIN)
    data = ["--dataset", "imagefolder", "--data-dir", photos, "--image-size", 16]
    run_app("horovodrun-gloo", 2, *data, "--epochs", 3, "--batch-size", 4, "--output-dir", root / "small_cnn")
    run_app("single", 1, *data, "--model", "resnet18", "--epochs", 1, "--batch-size", 8, "--image-size", 32,
            "--output-dir", root / "resnet18")
    for name, args in (("plugin", ()), ("spectral", ("--model-args", "spectral=true"))):
        run_app("single", 1, "--model", "tinynets:tiny", *args, "--epochs", 1, "--output-dir", root / name,
                cwd=root)
    return root


def checkpoint_model(run_dir):
    """The model of run_dir/checkpoints/best.pt rebuilt by the test itself: the factory of the model's name, the
    facts the checkpoint records, its weights."""
    import sys

    from hvd_train import models
    ckpt = torch.load(run_dir / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    card = ckpt["model_card"]
    if ":" in card["model"]:
        sys.path.insert(0, str(run_dir.parent))
        module, _, attr = card["model"].partition(":")
        factory = getattr(__import__(module), attr)
        named = inspect.signature(factory).parameters  # the app passes a factory the facts it names
        model = factory(**{k: v for k, v in card["facts"].items() if k in named}, **card["model_args"])
        sys.path.remove(str(run_dir.parent))
    else:
        model = models.build_model(card["model"], **card["facts"], **card["model_args"])
    model.load_state_dict(ckpt["model"])
    return model.eval(), card


def validation_images(root, run, count=8):
    """The first photos of each class through the validation transform and the feed, as the run's validation saw
    them."""
    size = checkpoint_model(root / run)[1]["facts"]["image_size"]
    paths = sorted((root / "photos").glob("*/*.png"))[:count]
    pixels = torch.stack([transforms(size, train=False)(str(p)) for p in paths])
    return paths, Feed(torch.device("cpu"), MEAN, STD)((pixels, torch.zeros(len(paths))))[0]


def exported(tool, run_dir, fmt):
    """run_dir's export in `fmt`, written now where an earlier test has not."""
    path = run_dir / "export" / f"model{'.torchscript.pt' if fmt == 'torchscript' else '.' + fmt}"
    if not path.exists():
        run_export(tool, run_dir, fmt)
    return path


def run_export(tool, model_dir, fmt):
    # A user's own model (the plug-in runs) is named by an import path in the checkpoint: the user trusts it, and
    # exports from the folder that holds it.
    trust = ("--trust-code",) if model_dir.name in ("plugin", "spectral") else ()
    proc = tool("export", model_dir, "--format", fmt, *trust, cwd=model_dir.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check = re.search(rf"parity on (\d+) validation samples .*: max \|{fmt} - pytorch\| = (\S+), tolerance",
                      proc.stdout)
    assert check, proc.stdout
    return proc.stdout


@pytest.mark.parametrize("run", ["small_cnn", pytest.param("resnet18", marks=pytest.mark.extended),
                                 pytest.param("plugin", marks=pytest.mark.extended)])
def test_every_format_matches_the_pytorch_model(tool, runs, run):
    """Each export is written with its card and its parity check, and, loaded here with the format's own runtime
    (safetensors into the model rebuilt from the card, torch.jit.load, onnxruntime), gives the checkpoint's outputs."""
    model, card = checkpoint_model(runs / run)
    channels, size = card["facts"]["in_channels"], card["facts"]["image_size"]
    images = torch.randn(5, channels, size, size)  # another batch size than the check's: the batch axis is free
    with torch.no_grad():
        expected = model(images)
    for fmt in FORMATS:
        out = exported(tool, runs / run, fmt)
        meta = json.loads(out.with_name(out.name + ".json").read_text())
        assert meta["format"] == fmt and meta["model"] == card["model"] and meta["facts"] == card["facts"]
        assert meta["parity"]["samples"] >= 2 and meta["parity"]["max_abs_diff"] < 1e-2
        if fmt == "safetensors":
            from safetensors.torch import load_file

            rebuilt, _ = checkpoint_model(runs / run)
            rebuilt.load_state_dict(load_file(out))
            got = rebuilt(images)
            assert torch.equal(got, expected)
        elif fmt == "torchscript":
            got = torch.jit.load(str(out))(images)
            assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
        else:
            session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
            assert session.get_inputs()[0].shape == ["batch", channels, size, size]
            got = torch.from_numpy(session.run(None, {"images": images.numpy()})[0])
            assert torch.allclose(got, expected, atol=1e-4, rtol=1e-3)


def test_the_export_s_files_have_the_mode_of_the_run_s_other_files(tool, runs):
    # The run's files are 0640 (keep_private); safetensors wrote its own file 0600.
    mode = (runs / "small_cnn" / "config.json").stat().st_mode & 0o777
    assert mode == 0o640 and (runs / "small_cnn" / "checkpoints" / "last.pt").stat().st_mode & 0o777 == mode
    for fmt in FORMATS:
        out = exported(tool, runs / "small_cnn", fmt)
        assert {fmt: [oct(p.stat().st_mode & 0o777) for p in (out, out.with_name(out.name + ".json"))]} == \
            {fmt: [oct(mode)] * 2}


def test_an_operator_onnx_lacks_is_named_with_its_layer(tool, runs):
    proc = tool("export", runs / "spectral", "--format", "onnx", "--trust-code", cwd=runs)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "layer 'spectrum' (Spectrum)" in lines[0] and "aten._linalg_eigh" in lines[0], \
        proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (runs / "spectral" / "export").exists() or not any((runs / "spectral" / "export").iterdir())
    # The same model exports to the formats that can hold it.
    run_export(tool, runs / "spectral", "torchscript")


def test_export_refuses_to_overwrite_and_names_a_missing_run(tool, runs, tmp_path):
    before = exported(tool, runs / "small_cnn", "safetensors").read_bytes()
    proc = tool("export", runs / "small_cnn", "--format", "safetensors")
    assert proc.returncode == 2 and "exists; pass --overwrite" in proc.stderr, proc.stderr
    assert (runs / "small_cnn" / "export" / "model.safetensors").read_bytes() == before
    proc = tool("export", tmp_path / "nothing", "--format", "onnx")
    assert proc.returncode == 2 and "no such file or directory" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("source", ["checkpoint", "onnx", "torchscript"])
def test_predict_gives_what_validation_gives(tool, runs, source):
    """predict on image files equals the checkpoint's model on the same photos through the validation transform,
    with the class names of the folders."""
    target = runs / "small_cnn" if source == "checkpoint" else exported(tool, runs / "small_cnn", source)
    paths, images = validation_images(runs, "small_cnn")
    model, _ = checkpoint_model(runs / "small_cnn")
    with torch.no_grad():
        probs = torch.softmax(model(images), dim=1)
    trust = ["--trust-code"] if source == "torchscript" else []  # a TorchScript export is a program
    proc = tool("predict", target, *paths, "--json", "--top-k", "2", *trust)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert [r["image"] for r in results] == [str(p) for p in paths]
    for r, p in zip(results, probs):
        assert len(r["top"]) == 2 and r["top"][0]["index"] == int(p.argmax())
        assert r["top"][0]["class"] == ("cat", "dog", "owl")[r["top"][0]["index"]]
        assert abs(r["top"][0]["probability"] - float(p.max())) < 1e-4


def test_predict_reads_folders_and_prints_a_table(tool, runs):
    proc = tool("predict", runs / "resnet18", runs / "photos" / "owl", "--top-k", "3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split() == ["image", "top-1", "top-2", "top-3"]
    assert len(lines) == 1 + 8 and all(re.search(r"owl/\d\.png( +\w+ \d+\.\d%){3}$", line) for line in lines[1:])


def test_predict_refuses_what_is_not_an_image(tool, runs, tmp_path):
    (tmp_path / "notes.txt").write_text("not a picture")
    for arg, needle in ((tmp_path / "notes.txt", "notes.txt: cannot read this image"),
                        (tmp_path / "missing.png", "missing.png: no such file or folder"),
                        (tmp_path, "a folder with no image files")):
        proc = tool("predict", runs / "small_cnn", arg)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_the_docs_load_a_checkpoint_for_inference(runs):
    """The lines under "Using the trained model" (docs/after-training.md) run as they are, on a run's checkpoint."""
    readme = (ROOT / "docs" / "after-training.md").read_text()
    section = readme.split("## Using the trained model", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    script = code.replace("runs/cifar10", str(runs / "small_cnn"))
    script = script.replace("photo.jpg", str(runs / "photos" / "dog" / "0.png"))
    proc = subprocess.run([str(BIN / "python"), "-c", textwrap.dedent(script) + "\nprint('CLASS', name)"],
                          cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^CLASS (cat|dog|owl)$", proc.stdout, re.MULTILINE), proc.stdout


def test_a_checkpoint_from_before_model_cards_is_still_understood(tool, runs, tmp_path):
    """A checkpoint written before checkpoints carried their model card: the model and its preprocessing follow from
    its config (the data set that ships), so predict gives the same probabilities (classes shown as numbers)."""
    ckpt = torch.load(runs / "small_cnn" / "checkpoints" / "best.pt", weights_only=True)
    del ckpt["model_card"]
    (tmp_path / "checkpoints").mkdir()
    torch.save(ckpt, tmp_path / "checkpoints" / "best.pt")
    image = runs / "photos" / "owl" / "1.png"
    new, old = (json.loads(tool("predict", where, image, "--json").stdout)[0]["top"]
                for where in (runs / "small_cnn", tmp_path))
    assert [t["index"] for t in new] == [t["index"] for t in old]
    assert [t["probability"] for t in new] == pytest.approx([t["probability"] for t in old])
    assert [t["class"] for t in old] == [str(t["index"]) for t in old]


class KeywordModel(torch.nn.Module):
    """forward(ids, mask=None, types=None), called with ids and types: the inputs go by name, a sequence's length
    free."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2)

    def forward(self, ids, mask=None, types=None):
        return self.head((self.embed(ids) + self.embed(types)).mean(1))


class CallsByKeyword:
    class task:
        @staticmethod
        def loss(model, batch):
            return model(batch["ids"], types=batch["types"])


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_inputs_given_by_keyword_past_one_left_out_export_by_name_with_the_sequence_free(tmp_path, fmt):
    from hvd_train.tools.export import model_input
    from hvd_train.tools.export import described_inputs, write_onnx, write_torchscript
    from hvd_train.tools.inference import _eager

    torch.manual_seed(0)
    model = KeywordModel().eval()
    batch = {"ids": torch.randint(0, 10, (3, 5)), "types": torch.randint(0, 10, (3, 5))}
    inputs = model_input(model, CallsByKeyword, batch)
    assert inputs.keywords and list(inputs.tensors) == ["ids", "types"]
    path = tmp_path / f"model.{fmt}"
    (write_onnx if fmt == "onnx" else write_torchscript)(model, inputs, str(path))
    other = {"ids": torch.randint(0, 10, (4, 7)), "types": torch.randint(0, 10, (4, 7))}
    with torch.no_grad():
        expected = model(other["ids"], types=other["types"])
    if fmt == "onnx":
        assert [i["shape"] for i in described_inputs(fmt, str(path), inputs)] == [["batch", "sequence"]] * 2
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = torch.from_numpy(session.run(None, {k: v.numpy() for k, v in other.items()})[0])
    else:
        from hvd_train.tools.inference import ModelInputs

        got = _eager(torch.jit.load(str(path)))(ModelInputs(other, keywords=True))[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_an_argument_that_is_not_a_tensor_is_refused_by_name():
    from hvd_train.tools.export import ExportError, model_input

    class Flagged:
        class task:
            @staticmethod
            def loss(model, batch):
                return model(batch, mask="all")

    with pytest.raises(ExportError, match="mask='all', which is not a tensor"):
        model_input(KeywordModel(), Flagged, torch.zeros(2, 3, dtype=torch.long))
