"""A bad setting, alone or under a launcher, stops the run before anything is written, with one message that names
the value, says why and what to give instead; the launcher's ranks all stop and exit with that status. (Refusals of
one feature's settings sit with that feature: recipes in unit/test_config.py, shards, plug-ins, fine-tuning, ...)"""
import pytest

from hvd_train.config import parse_config
from hvd_train.errors import ConfigError
from conftest import assert_refused, run_app


# (the arguments, what the one line says). RECIPE is a recipe with a misspelt key, EMPTY a folder with an empty class.
BAD_SETTINGS = [
    # values the schema refuses
    (["--epochs", "0"], "optim.epochs (--epochs)=0"),
    (["--batch-size", "-4"], "optim.batch_size (--batch-size)=-4"),
    (["--lr", "0"], "optim.lr (--lr)=0"),
    (["--epochs", "three"], "invalid int value: 'three'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--config", "RECIPE"], "unknown key optim.learning_rate; optim has: optimizer, epochs"),
    (["--resume", "auto", "--overwrite"], "contradicts --resume"),
    # names that are not known, or do not fit the data
    (["--model", "resnet9000"], "--model='resnet9000' is not known"),
    (["--dataset", "imagenet"], "--dataset='imagenet' is not known"),
    (["--model", "alexnet"], "cannot take 1x8x8 images"),
    # what this machine or these files cannot give
    (["--device", "cuda"], "--device cuda: no GPU is visible"),
    (["--sync-bn"], "--sync-bn needs GPUs"),
    (["--amp", "fp16"], "--amp fp16 needs a GPU"),
    (["--resume", "nowhere.pt"], "--resume nowhere.pt: no such file"),
    (["--dataset", "cifar10", "--data-dir", "/nonexistent"], "CIFAR-10 not found"),
    (["--dataset", "imagefolder", "--data-dir", "EMPTY"], "class folder(s) cat hold no image files"),
    (["--dataset", "cifar100", "--data-dir", "EMPTY"], "CIFAR-100 not found in EMPTY: it holds cat/. Accepted"),
    (["--batch-size", "2000"], "each of the 1 ranks holds only 1438 of the 1438 training samples"),
    # settings that cannot apply to this run
    (["--data.train_shards", "s/train-{000000..000009}.tar"],
     "--data.train_shards='s/train-{000000..000009}.tar' does not apply to --dataset digits"),
    (["--data.skip_bad_files"], "--data.skip_bad_files=True does not apply to --dataset digits"),
    (["--data.synthetic_samples", "64", "--dataset", "mnist"], "does not apply to --dataset mnist"),
    (["--stop-at", "150"], "--stop-at)=150: val_acc1 is a percentage, so it can never reach 150"),
    (["--shard-optimizer", "--opt", "lamb"], "cannot shard --opt lamb: its update looks at whole tensors"),
    (["--shard-optimizer", "--use-adasum"], "--shard-optimizer)=True: cannot be combined with --use-adasum"),
    (["--shard-optimizer", "--channels-last"], "cannot be combined with --channels-last"),
    (["--bf16-allreduce", "--fp16-allreduce"], "--bf16-allreduce)=True: cannot be combined with --fp16-allreduce"),
    (["--bf16-allreduce", "--use-adasum"], "Adasum reduces float16, float32 and float64 only"),
]


@pytest.mark.parametrize("args,message", BAD_SETTINGS)
def test_a_bad_setting_stops_with_one_message_and_writes_nothing(tmp_path, app, args, message):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("optim:\n  learning_rate: 0.1\n")
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    args = [{"RECIPE": str(recipe), "EMPTY": str(tmp_path / "empty")}.get(a, a) for a in args]
    message = message.replace("EMPTY", str(tmp_path / "empty"))
    assert_refused(app("--output-dir", tmp_path / "out" / "run", *args), message)
    assert not (tmp_path / "out").exists(), "a run refused before its first epoch left a new output folder behind"


def test_a_warmup_longer_than_training_is_refused():
    with pytest.raises(ConfigError, match=r"must be shorter than the 2 epoch\(s\) of training"):
        parse_config(["--warmup-epochs", "5", "--epochs", "2"])


@pytest.mark.distributed
def test_a_refused_setting_under_horovodrun_is_one_line_and_the_ranks_exit_code(tmp_path):
    proc = run_app("horovodrun-gloo", 2, "--output-dir", tmp_path / "out", "--warmup-epochs", "20", check=False)
    assert_refused(proc, "optim.warmup_epochs (--warmup-epochs)=20.0: must be shorter than the 15 epoch(s)")
    assert "horovodrun: rank" in proc.stderr and "exited with status 2" in proc.stderr


@pytest.mark.distributed
def test_a_bad_setting_stops_both_ranks_under_mpirun_with_one_message(tmp_path):
    # Every rank parses the same command line and fails the same way; rank 0 alone says so.
    proc = run_app("mpirun", 2, "--output-dir", tmp_path / "run", "--epochs", "three", check=False)
    assert_refused(proc, "invalid int value: 'three'")
    assert not (tmp_path / "run").exists()
