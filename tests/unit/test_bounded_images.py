"""Image files handed over by someone else are read within bounds (docs/reliability.md: What is code and what is
data). Each test is an attack as it was written: a model card whose image_size makes predict's batch take
gigabytes; a 20000 x 1 PNG of a hundred bytes, inside the pixel bound, that the resize for validation or predict
would make 5,120,000 x 256; a link to /dev/zero, a FIFO and a sparse 20 GB ".png" among image files, for predict,
for training on an image folder (with and without --data.skip_bad_files) and for hvd-train shard. Each must end in
one line that names the file or the setting and the way past the bound (never a traceback, a MemoryError or a
hang), and its peak memory must stay within ALLOWANCE of the same command on a benign file. Commands run with a
timeout and in a session of their own, so a broken fix fails the test instead of hanging it."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import BIN, QUIET, ROOT, TRAIN, job_env
from formats import write_image_folder
from test_handed_over_files import ALLOWANCE, MEASURE, MiB, an_image, exported, one_error_line, trained  # noqa: F401

from hvd_train.data.images import UnsupportedImage
from hvd_train.data.images import Preprocessing

TIMEOUT = 120  # seconds: a command that reads a FIFO without the fix would wait for a writer for ever
SPARSE = 20 * 2**30
THIN = (20000, 1)  # inside the pixel bound (8192 x 8192); resized by its shorter side to 256: 5,120,000 x 256


def measured(cmd, tmp_path, env=None, timeout=TIMEOUT):
    """(exit code, output, peak resident bytes) of `cmd` (as test_handed_over_files' peak_of_command), in a session
    of its own that is killed whole, and the test failed, where it runs past `timeout` seconds."""
    n = len(list(tmp_path.glob("command-*.log")))
    log, peak = tmp_path / f"command-{n}.log", tmp_path / f"command-{n}.peak"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", MEASURE, str(peak), *map(str, cmd)], stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT, env={**job_env(), **(env or {})},
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"{' '.join(map(str, cmd))} hung: still running after {timeout} s\n{log.read_text()[-3000:]}")
    return code, log.read_text(), int(peak.read_text())


def predict(*args):
    return [BIN / "hvd-train", "predict", *args]


def train_on(folder, out, *args):
    return [sys.executable, TRAIN, *QUIET, "--dataset", "imagefolder", "--data-dir", folder, "--image-size", "224",
            "--batch-size", "4", "--epochs", "1", "--output-dir", out, *args]


def training_refusal(output, *needles):
    """The one `train_hvd.py: [rank N: ]error:` line of a training run's output, holding every needle."""
    lines = [line for line in output.splitlines() if re.search(r"train_hvd\.py: (rank \d+: )?error:", line)]
    assert len(lines) == 1 and "Traceback" not in output and "MemoryError" not in output, output[-3000:]
    assert all(n in lines[0] for n in needles), output[-3000:]
    return lines[0]


def thin_png(path):
    from PIL import Image

    Image.new("L", THIN).save(path)
    assert os.path.getsize(path) < 200
    return str(path)


def zero_link(path):
    os.symlink("/dev/zero", path)
    return str(path)


def fifo(path):
    os.mkfifo(path)
    return str(path)


def sparse_png(path, size=SPARSE):
    """A PNG's first 8 x 8 pixels' worth of file, then zeros to `size` bytes: holes, costing no disk."""
    from PIL import Image

    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(path)
    with open(path, "r+b") as f:
        f.truncate(size)
    return str(path)


NOT_FILES = {"zero": (zero_link, "a character device"), "fifo": (fifo, "a FIFO"),
             "sparse": (sparse_png, "HVD_MAX_IMAGE_BYTES")}


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """(an image folder with train/ and val/, a run trained on it (photos: validation's centre crop, RGB), the
    peak memory of that training): the benign side of the image-folder attacks."""
    root = tmp_path_factory.mktemp("photos")
    write_image_folder(root / "data" / "train", per_class=4, size=20)
    write_image_folder(root / "data" / "val", per_class=2, size=20, seed=1)
    code, output, peak = measured(train_on(root / "data", root / "run"), root, timeout=600)
    assert code == 0, output[-3000:]
    return root / "data", root / "run", peak


@pytest.fixture(scope="module")
def benign_predict(photos, tmp_path_factory):
    """The peak memory of predict on the photos' run with one small image: the benign side of predict's attacks."""
    root = tmp_path_factory.mktemp("benign-predict")
    code, output, peak = measured(predict(photos[1], an_image(root / "x.png", size=20)), root)
    assert code == 0, output
    return peak


def attacked_folder(photos, tmp_path, split, make, name):
    folder = tmp_path / "data"
    shutil.copytree(photos[0], folder)
    return make(folder / split / "dog" / name)


# --------------------------------------------------------------------------------------------------------------------
# 9. A model card whose image_size sizes predict's batch


def crafted_card(run, tmp_path, kind, image_size):
    """The trained digits model, as a checkpoint or an ONNX export, whose card's preprocessing says image_size."""
    if kind == "checkpoint":
        ckpt = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
        ckpt["model_card"]["preprocessing"]["image_size"] = image_size
        torch.save(ckpt, tmp_path / "card.pt")
        return tmp_path / "card.pt"
    source = run / "export" / "model.onnx"  # the exported fixture's
    shutil.copy(source, tmp_path / "model.onnx")
    meta = json.loads(Path(str(source) + ".json").read_text())
    meta["preprocessing"]["image_size"] = image_size
    (tmp_path / "model.onnx.json").write_text(json.dumps(meta))
    return tmp_path / "model.onnx"


@pytest.mark.parametrize("kind", ["checkpoint", "onnx"])
def test_a_card_whose_image_size_would_take_gigabytes_is_refused_before_a_batch_is_made(
        tmp_path, trained, exported, kind):  # noqa: F811
    image = an_image(tmp_path / "x.png")
    code, output, benign = measured(predict(trained if kind == "checkpoint" else exported, image), tmp_path)
    assert code == 0, output
    evil = crafted_card(trained, tmp_path, kind, 3000)  # 1 x 3000 x 3000 floats: the small CNN took 5.5 GB on it
    code, output, peak = measured(predict(evil, image), tmp_path)
    line = one_error_line(output)
    assert code == 2 and "preprocessing.image_size 3000" in line and "--max-memory-mb" in line, output
    assert peak < benign + ALLOWANCE, (peak, benign)


def test_predict_runs_a_large_card_in_smaller_batches_within_max_memory_mb(tmp_path, trained, tool):  # noqa: F811
    from hvd_train.tools.predict import BATCH, InputError, batch_size

    def card(size, channels=1):
        return Preprocessing(channels, size, (0.0,) * channels, (1.0,) * channels)

    assert batch_size(card(8)) == BATCH  # the digits: 64 images of 256 bytes
    assert batch_size(card(224, 3)) == 1024 * MiB // (3 * 224 * 224 * 4 * 64)  # ImageNet's size: 27 at a time
    assert batch_size(card(512)) == 16 and batch_size(card(512), 100 * MiB) == 1  # 1 MiB each, 64 MiB to run
    with pytest.raises(InputError, match=r"image_size 512 .* pass --max-memory-mb 64 "):
        batch_size(card(512), 50 * MiB)
    with pytest.raises(InputError, match="image_size 8192"):
        batch_size(card(8192, 3))
    # The real command: a card of 512 (within what the flag allows) runs; below it, the one line names the flag.
    evil = crafted_card(trained, tmp_path, "checkpoint", 512)
    images = [an_image(tmp_path / f"{i}.png") for i in range(3)]
    result = tool("predict", evil, *images, "--max-memory-mb", "100", "--json")
    assert result.returncode == 0 and len(json.loads(result.stdout)) == 3, result.stdout + result.stderr
    result = tool("predict", evil, *images, "--max-memory-mb", "50")
    assert result.returncode == 2 and "--max-memory-mb 64" in one_error_line(result.stderr), result.stderr


# --------------------------------------------------------------------------------------------------------------------
# 10. A very thin image, inside the pixel bound, resized by its shorter side


def test_a_thin_image_is_refused_from_its_header_by_predict(tmp_path, photos, benign_predict):
    _, run, _ = photos
    code, output, peak = measured(predict(run, thin_png(tmp_path / "thin.png")), tmp_path)
    line = one_error_line(output)
    assert code == 2 and "thin.png" in line and "20000 x 1 pixels" in line and "HVD_MAX_IMAGE_PIXELS" in line, output
    assert peak < benign_predict + ALLOWANCE, (peak, benign_predict)


def test_a_thin_image_in_an_image_folders_validation_ends_training_in_one_line(tmp_path, photos):
    folder = attacked_folder(photos, tmp_path, "val", thin_png, "thin.png")
    code, output, peak = measured(train_on(os.path.dirname(os.path.dirname(os.path.dirname(folder))),
                                           tmp_path / "out"), tmp_path, timeout=600)
    assert code == 5, output[-3000:]
    training_refusal(output, "thin.png", "20000 x 1 pixels", "HVD_MAX_IMAGE_PIXELS")
    assert peak < photos[2] + ALLOWANCE, (peak, photos[2])


def test_every_resize_path_is_bounded_from_the_header(tmp_path, monkeypatch):
    from hvd_train.data.images import PhotoTransform

    thin = thin_png(tmp_path / "thin.png")
    data = Path(thin).read_bytes()
    said = "20000 x 1 pixels, which the resize for the model makes 5,120,000 x 256, more than the 67,108,864"
    for channels in (1, 3):  # predict's centre crop: of a grey image (torchvision's Resize), of a photo (images.py)
        with pytest.raises(UnsupportedImage, match=re.escape(said)):
            Preprocessing(channels, 224, (0.0,) * channels, (1.0,) * channels, "center_crop").load(thin)
    for encoded in (False, True):  # validation's crop, decoded by the loader worker or on the device
        with pytest.raises(UnsupportedImage, match=re.escape(said)):
            PhotoTransform(224, train=False, encoded=encoded).from_bytes(data)
    # Training's crop and the stretch resize it to size x size, within the bound: they go on.
    assert PhotoTransform(224, train=True).from_bytes(data).shape == (3, 224, 224)
    assert Preprocessing(1, 224, (0.0,), (1.0,), "stretch").load(thin).shape == (1, 224, 224)
    # Where the output itself is what passes the bound (training's crop, the stretch), the same check says so.
    monkeypatch.setenv("HVD_MAX_IMAGE_PIXELS", "1000")
    small = an_image(tmp_path / "small.png", size=20)
    with pytest.raises(UnsupportedImage, match="which the resize for the model makes 64 x 64"):
        PhotoTransform(64, train=True).from_bytes(Path(small).read_bytes())
    with pytest.raises(UnsupportedImage, match="which the resize for the model makes 64 x 64"):
        Preprocessing(1, 64, (0.0,), (1.0,), "stretch").load(small)
    monkeypatch.delenv("HVD_MAX_IMAGE_PIXELS")
    assert PhotoTransform(64, train=True).from_bytes(Path(small).read_bytes()).shape == (3, 64, 64)
    assert Preprocessing(1, 64, (0.0,), (1.0,), "stretch").load(small).shape == (1, 64, 64)


# --------------------------------------------------------------------------------------------------------------------
# 11. What is not an image file: a link to a device, a FIFO, a sparse file of 20 GB


def test_the_bounded_reader_reads_regular_files_only_and_at_most_its_bound(tmp_path, monkeypatch):
    from hvd_train.data.images import read_image_file

    image = an_image(tmp_path / "x.png")
    assert read_image_file(image) == Path(image).read_bytes()
    os.symlink(image, tmp_path / "link.png")  # a link to a file is read: the file is checked, not the link
    assert read_image_file(str(tmp_path / "link.png")) == Path(image).read_bytes()
    for path, said in [(zero_link(tmp_path / "zero.png"), "a character device, not a regular file"),
                       (fifo(tmp_path / "pipe.png"), "a FIFO (named pipe), not a regular file"),
                       (str(tmp_path), "a folder, not a regular file"),
                       (sparse_png(tmp_path / "sparse.png"), "21,474,836,480 bytes, more than the 268,435,456")]:
        with pytest.raises(UnsupportedImage, match=re.escape(said)):
            read_image_file(path)
    small = sparse_png(tmp_path / "small.png", 4096)
    monkeypatch.setenv("HVD_MAX_IMAGE_BYTES", "4095")
    with pytest.raises(UnsupportedImage, match="4,096 bytes, more than the 4,095 .* set HVD_MAX_IMAGE_BYTES"):
        read_image_file(small)
    monkeypatch.setenv("HVD_MAX_IMAGE_BYTES", "4096")
    assert len(read_image_file(small)) == 4096


@pytest.mark.parametrize("where", ["given", "in a folder"])
@pytest.mark.parametrize("kind", sorted(NOT_FILES))
def test_predict_refuses_what_is_not_an_image_file_in_one_line(tmp_path, photos, benign_predict, kind, where):
    _, run, _ = photos
    make, said = NOT_FILES[kind]
    (tmp_path / "folder").mkdir()
    an_image(tmp_path / "folder" / "a.png", size=20)
    bad = make(tmp_path / "folder" / "b.png")
    code, output, peak = measured(predict(run, bad if where == "given" else tmp_path / "folder"), tmp_path)
    line = one_error_line(output)
    assert code == 2 and "b.png" in line and said in line and "MemoryError" not in output, output
    assert peak < benign_predict + ALLOWANCE, (peak, benign_predict)


@pytest.mark.parametrize("kind", sorted(NOT_FILES))
def test_training_on_an_image_folder_holding_what_is_not_an_image_file_ends_in_one_line(tmp_path, photos, kind):
    make, said = NOT_FILES[kind]
    attacked_folder(photos, tmp_path, "train", make, "b.png")
    code, output, peak = measured(train_on(tmp_path / "data", tmp_path / "out"), tmp_path, timeout=600)
    assert code == 5, output[-3000:]
    training_refusal(output, "b.png", said, "--data.skip_bad_files")
    assert peak < photos[2] + ALLOWANCE, (peak, photos[2])


def test_skip_bad_files_leaves_out_what_is_not_an_image_file_without_reading_it(tmp_path, photos):
    # The check --data.skip_bad_files makes of every file, in a process of its own: a FIFO must not hang it.
    folder = tmp_path / "data"
    shutil.copytree(photos[0], folder)
    bad = [make(folder / "train" / "dog" / f"{kind}.png") for kind, (make, _) in sorted(NOT_FILES.items())]
    bad.append(thin_png(folder / "val" / "dog" / "thin.png"))
    check = ("import sys\nfrom hvd_train.data.folders import decodes\n"
             "print([decodes(p, 224) for p in sys.argv[1:]])\n")
    good = str(folder / "train" / "dog" / "0.png")
    proc = subprocess.run([sys.executable, "-c", check, good, *bad], capture_output=True, text=True, cwd=ROOT,
                          env=job_env(), timeout=TIMEOUT)
    assert proc.returncode == 0 and proc.stdout.strip() == str([True] + [False] * len(bad)), proc.stderr[-3000:]


def test_hvd_train_shard_refuses_what_is_not_an_image_file_in_an_image_folder(tmp_path, photos):
    def shard(folder, out):
        return [BIN / "hvd-train", "shard", "--from", "imagefolder", "--data-dir", folder, "--out", out]

    code, output, benign = measured(shard(photos[0], tmp_path / "shards"), tmp_path)
    assert code == 0, output
    for kind, (make, said) in sorted(NOT_FILES.items()):
        folder = tmp_path / kind
        shutil.copytree(photos[0], folder)
        make(folder / "train" / "dog" / "b.png")
        code, output, peak = measured(shard(folder, tmp_path / f"shards-{kind}"), tmp_path)
        line = one_error_line(output, "hvd-train shard")
        assert code == 2 and "b.png" in line and said in line, output
        assert peak < benign + ALLOWANCE, (peak, benign)
