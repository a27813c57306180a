"""A run directory written by an earlier version of the app still resumes bit for bit and still exports.

tests/fixtures/run_before_floor_plan/ is what the app of commit 76e8be2 (before the package was regrouped into one
room per concept) wrote for `python train_hvd.py --output-dir run --epochs 1` (the small CNN on the digits, one
process): its config.json, metrics and summary, and checkpoints/last.pt. resumed_to_epoch_2.pt is the model that
same app had after `--resume auto --epochs 2` on a copy of it. Renaming or moving a module must not change what a
checkpoint holds or how it is read back: the resume below continues where that app did, to the last bit.
"""
import shutil

import torch

from conftest import ROOT

BEFORE = ROOT / "tests" / "fixtures" / "run_before_floor_plan"


def earlier_run(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(BEFORE, run, ignore=shutil.ignore_patterns("resumed_to_epoch_2.pt"))
    return run


def test_a_checkpoint_written_before_the_regrouping_resumes_bit_for_bit(tmp_path, app):
    run = earlier_run(tmp_path)
    result = app("--output-dir", run, "--resume", "auto", "--epochs", 2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    resumed = torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert resumed["epoch"] == 2
    expected = torch.load(BEFORE / "resumed_to_epoch_2.pt", map_location="cpu", weights_only=True)
    assert list(resumed["model"]) == list(expected)
    unequal = [name for name, tensor in expected.items() if not torch.equal(resumed["model"][name], tensor)]
    assert not unequal, f"these weights differ from the earlier app's resume: {unequal}"


def test_a_run_directory_written_before_the_regrouping_exports(tmp_path, tool):
    run = earlier_run(tmp_path)
    result = tool("export", run, "--format", "safetensors")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    exported = list((run / "export").glob("model*.safetensors"))
    assert len(exported) == 1 and exported[0].stat().st_size > 0
