"""Fine-tuning from weights the user has: --init-from (state dicts, safetensors, hvd-train checkpoints) and --freeze."""
import pytest
import torch
from safetensors.torch import save_file

from conftest import assert_refused, last_checkpoint, read_json, run_app
from hvd_train.models import build_model

DIGITS_CNN = ["--model", "small_cnn", "--batch-size", "16"]


@pytest.mark.distributed
def test_a_torchvision_model_is_fine_tuned_on_two_ranks_with_a_new_head_and_a_frozen_stem(tmp_path):
    """An earlier run's ResNet-18 (10 classes) starts a 4-class run: the head is re-initialised, the stem stays as
    it was loaded, the rest trains, and both ranks end identical (rank 0 read the file, the other received it)."""
    data = ["--model", "resnet18", "--dataset", "synthetic", "--image-size", "32", "--data.synthetic_samples", "64",
            "--batch-size", "8", "--epochs", "1"]
    run_app("single", 1, "--output-dir", tmp_path / "first", *data)
    first = last_checkpoint(tmp_path / "first")["model"]
    proc = run_app("horovodrun-gloo", 2, "--output-dir", tmp_path / "tuned", *data, "--data.synthetic_classes", "4",
                   "--init-from", tmp_path / "first" / "checkpoints" / "last.pt", "--freeze", "conv1.*,bn1.*")
    assert "re-initialised" in proc.stdout and "fc.weight [10, 512] -> [4, 512]" in proc.stdout, proc.stdout
    assert "--freeze conv1.*,bn1.*: 3 tensor(s)" in proc.stdout, proc.stdout
    tuned = last_checkpoint(tmp_path / "tuned")["model"]
    assert tuned["fc.weight"].shape == (4, 512)
    for stem in ("conv1.weight", "bn1.weight", "bn1.bias"):
        assert torch.equal(tuned[stem], first[stem]), f"{stem} moved while frozen"
    assert not torch.equal(tuned["layer1.0.conv1.weight"], first["layer1.0.conv1.weight"])  # loaded, then trained
    summary = read_json(tmp_path / "tuned" / "summary.json")
    assert summary["world_size"] == 2 and summary["params_in_sync"]


def test_safetensors_and_plain_state_dicts_load_with_a_report(tmp_path, app):
    torch.manual_seed(3)
    source = build_model("small_cnn", 1, 10, 8).state_dict()
    save_file({k: v.contiguous() for k, v in source.items()}, str(tmp_path / "w.safetensors"))
    torch.save({f"module.{k}": v for k, v in source.items()}, tmp_path / "w.pth")  # as DDP saves it
    for name in ("w.safetensors", "w.pth"):
        out = tmp_path / name.replace(".", "_")
        result = app("--output-dir", out, *DIGITS_CNN, "--epochs", "1", "--init-from", tmp_path / name,
                     "--freeze", "features.*")
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"loaded {len(source)} of the model's {len(source)} tensors" in result.stdout, result.stdout
        tuned = last_checkpoint(out)["model"]
        frozen = [k for k in source if k.startswith("features.")]
        assert frozen and all(torch.equal(tuned[k], source[k]) for k in frozen)
        assert not torch.equal(tuned["head.4.weight"], source["head.4.weight"])  # loaded, then trained


@pytest.mark.parametrize("make,args,needles", [
    (None, ["--init-from", "nowhere.pt"], ["--init-from nowhere.pt: no such file"]),
    (lambda p: p.write_text("not weights"), ["--init-from", "{file}"], ["cannot be read as weights"]),
    (lambda p: torch.save({"a.weight": torch.zeros(3)}, p), ["--init-from", "{file}"],
     ["none of its 1 tensors fits this model", "a.weight"]),
    (None, ["--freeze", "stem.*"], ["--freeze 'stem.*' matches no parameter", "features."]),
    (None, ["--freeze", "*"], ["matches every parameter"]),
])
def test_bad_weights_and_freeze_patterns_get_one_message(tmp_path, app, make, args, needles):
    file = tmp_path / "weights.pt"
    if make is not None:
        make(file)
    result = app("--output-dir", tmp_path / "run", *DIGITS_CNN, *[a.format(file=file) for a in args])
    assert_refused(result, *needles)
    assert not (tmp_path / "run" / "checkpoints").exists()
