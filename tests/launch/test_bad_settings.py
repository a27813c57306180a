"""A bad setting, alone or under a launcher, stops the run before anything is written, with one message that names
the value, says why and what to give instead; the launcher's ranks all stop and exit with that status. (Refusals of
one feature's settings sit with that feature: recipes in unit/test_config.py, shards, plug-ins, fine-tuning, ...)"""
import subprocess
import sys

import pytest

from hvd_train.config import parse_config
from hvd_train.errors import ConfigError
from conftest import QUIET, ROOT, TRAIN, WORKERS, assert_refused, job_env, launch, run_app


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
    (["--data.decode", "gpu"], "data.decode (--data.decode)=gpu: this run trains on cpu; nvjpeg needs a GPU"),
    (["--data.decode", "jpeg"], "argument --data.decode: invalid choice: 'jpeg' (choose from 'auto', 'cpu', 'gpu')"),
    (["--resume", "nowhere.pt"], "--resume nowhere.pt: no such file"),
    (["--dataset", "cifar10", "--data-dir", "/nonexistent"], "CIFAR-10 not found"),
    (["--dataset", "imagefolder", "--data-dir", "EMPTY"], "class folder(s) cat hold no image files"),
    (["--dataset", "cifar100", "--data-dir", "EMPTY"], "CIFAR-100 not found in EMPTY: it holds cat/. Accepted"),
    (["--batch-size", "2000"], "each of the 1 ranks holds only 1438 of the 1438 training samples"),
    (["--logging.straggler_pct", "0"], "logging.straggler_pct=0.0: must be a percentage above 0 and at most 1000"),
    (["--logging.straggler_pct", "5000"], "logging.straggler_pct=5000.0: must be a percentage above 0"),
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
    (["--powersgd-rank", "-1"], "horovod.powersgd_rank (--powersgd-rank)=-1: must be a rank of 1 or more"),
    (["--powersgd-rank", "2", "--powersgd-min-compression", "0.5"], "=0.5: must be a factor of 1 or more"),
    (["--powersgd-rank", "2", "--powersgd-start-step", "-3"], "must be a number of optimizer steps, or -1"),
    (["--powersgd-rank", "2", "--shard-optimizer"], "=2: cannot be combined with --shard-optimizer"),
    (["--powersgd-rank", "4", "--use-adasum"], "=4: cannot be combined with --use-adasum"),
    (["--powersgd-rank", "2", "--epochs", "2", "--powersgd-start-step", "90"],
     "--powersgd-start-step)=90: the run has only 88 optimizer steps (2 epochs of 44), so PowerSGD would never"),
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
@pytest.mark.parametrize("launcher", [pytest.param("mpirun", marks=pytest.mark.extended), "horovodrun-gloo"])
def test_a_recipe_one_rank_alone_refuses_stops_the_job_at_once_with_rank_0_naming_it(tmp_path, launcher):
    # Rank 1's copy of the recipe holds a type error, rank 0's is fine: rank 1 tells the others as Horovod starts,
    # and the job stops there (it waited a minute for the launcher, then printed from rank 1 itself).
    (tmp_path / "recipe0.yaml").write_text("optim:\n  lr: 0.05\n")
    (tmp_path / "recipe1.yaml").write_text("optim:\n  lr: abc\n")
    proc = launch(launcher, 2, WORKERS / "recipe_per_rank.py", "--config", tmp_path / "recipe{rank}.yaml",
                  "--output-dir", tmp_path / "run", *QUIET, check=False)
    line = assert_refused(proc, f"{tmp_path / 'recipe1.yaml'}: optim.lr: expected float, got str 'abc'")
    assert line.startswith(("train_hvd.py: rank 1: error:", "[0]")) and "rank 1: error:" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.distributed
def test_a_bad_setting_stops_both_ranks_under_mpirun_with_one_message(tmp_path):
    # Every rank parses the same command line and fails the same way; rank 0 alone says so.
    proc = run_app("mpirun", 2, "--output-dir", tmp_path / "run", "--epochs", "three", check=False)
    assert_refused(proc, "invalid int value: 'three'")
    assert not (tmp_path / "run").exists()


def test_more_loader_workers_than_a_rank_s_cores_is_said_in_one_line(tmp_path):
    # One usable core (as a batch system's binding gives it) and two loader workers: the run goes on, warned once.
    cmd = ["taskset", "-c", "0", sys.executable, str(TRAIN), *QUIET, "--workers", "2", "--epochs", "1",
           "--output-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    said = [line for line in output.splitlines() if "--workers 2: more loader workers than the 1 core(s) each rank "
            "has here (1 usable, 1 rank(s) on this host)" in line]
    assert len(said) == 1 and said[0].startswith("warning:"), output[-3000:]
    assert "This DataLoader will create" not in output  # torch's paragraph per loader says it again
