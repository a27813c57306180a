"""Resuming: a resumed run ends bitwise where an uninterrupted one does, says what changes when the ranks do, records
where it continued, drops records the checkpoint does not cover, and refuses a checkpoint it cannot continue (another
model, data set, image size or optimizer; a finished run; a file that is not a checkpoint) with the setting named.
Resumes of one feature (shards, plug-ins, tracking, compile, channels-last, SLURM's requeue) sit with that feature."""
import os
import re
import shutil
import signal
import subprocess

import pytest
import torch

from conftest import (QUIET, ROOT, TRAIN, WORKERS, assert_refused, epochs_in, job_env, last_checkpoint, launch,
                      launch_command, read_json, tensorboard_steps, train_here, wait_for)


@pytest.mark.distributed
def test_resuming_is_bitwise_exact_from_within_an_epoch_and_on_one_rank(tmp_path):
    # Warmup (half an epoch), then a step decay at epoch 2, momentum, dropout, stochastic depth and BatchNorm (timm's
    # resnet10t), whose running statistics each rank updates from its own samples until the epoch's end averages
    # them: every piece of state matters. So do the seeded draws of augmentation (RandAugment, erasing) in loader
    # workers, of mixup/CutMix, and the weight average (whose BatchNorm statistics are each rank's too).
    # The resumed run is killed (SIGKILL, every rank and its loader workers) right after the checkpoint of run step
    # 30, the 8th of epoch 2's 22 (one every 10 steps); epoch 2 is the last, so the resumed run's last steps and its
    # end-of-epoch averaging of the statistics both follow the kill. (A resume from an epoch's end: test_honest_runs.)
    common = ["--lr-schedule", "step", "--optim.lr_milestones", "1", "--warmup-epochs", "0.5", "--model-ema",
              "--model-ema-warmup", "--mixup", "0.4", "--cutmix", "1.0", "--aa", "rand-m7-mstd0.5", "--reprob", "0.3",
              "--workers", "2", "--checkpoint.every_steps", "10", "--model", "timm/resnet10t", "--image-size", "16",
              "--model-args", "drop_rate=0.25", "--drop-path", "0.1", *QUIET]
    launch("mpirun", 2, TRAIN, "--output-dir", tmp_path / "straight", "--epochs", "2", *common)
    killed = launch("mpirun", 2, WORKERS / "killed_after_save.py", "30", "--", "--output-dir", tmp_path / "resumed",
                    "--epochs", "2", *common, check=False)
    assert killed.returncode != 0
    within = last_checkpoint(tmp_path / "resumed")
    assert (within["epoch"], within["step"], within["partial"]["epoch"], within["partial"]["steps"]) == (1, 30, 2, 8)
    assert sorted(os.listdir(tmp_path / "resumed" / "checkpoints"))[-1] == "step_00000030.pt"
    shutil.copytree(tmp_path / "resumed", tmp_path / "on-one-rank")
    proc = launch("mpirun", 2, TRAIN, "--output-dir", tmp_path / "resumed", "--epochs", "2", "--resume", "auto",
                  *common)
    assert "resumed within epoch 2: epoch 2 continues after its step 8, each rank where it was" in proc.stdout
    straight, resumed = last_checkpoint(tmp_path / "straight"), last_checkpoint(tmp_path / "resumed")
    assert straight["epoch"] == resumed["epoch"] == 2 and resumed["partial"] is None
    for part in ("model", "ema"):
        for name, value in straight[part].items():
            assert torch.equal(value, resumed[part][name]), f"{part}.{name} differs after resuming"
    for key, state in straight["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], resumed["optimizer"]["state"][key]["momentum_buffer"])
    # The schedule's position: the rate follows from the steps done (hvd_train/trainer.py).
    assert straight["step"] == resumed["step"]
    assert straight["optimizer"]["param_groups"][0]["lr"] == resumed["optimizer"]["param_groups"][0]["lr"]
    summary = read_json(tmp_path / "resumed" / "summary.json")
    assert [h["epoch"] for h in summary["history"]] == [1, 2] == epochs_in(tmp_path / "resumed")
    # Epoch 2's figures too: each rank's sums of its first 8 steps came back from the checkpoint.
    for key in ("train_loss", "train_count", "val_loss", "val_ema_loss"):
        assert [h[key] for h in summary["history"]] == \
            [h[key] for h in read_json(tmp_path / "straight" / "summary.json")["history"]], key
    assert [(r["epoch"], r["step"]) for r in summary["resumes"]] == [(1, 30)]
    assert summary["last_checkpoint"] == {"epoch": 2, "end_of_epoch": True}
    assert summary["checkpoints_within_epochs"]["count"] == 1  # step 40

    # On one rank, the rest of epoch 2 (every sample the 2 ranks had not read in its first 8 steps) is dealt to it.
    proc = launch("single", 1, TRAIN, "--output-dir", tmp_path / "on-one-rank", "--epochs", "2", "--resume", "auto",
                  *common)
    assert ("resumed within epoch 2: epoch 2 continues after its step 8: the samples it had not trained, dealt out "
            "anew among 1 rank(s) (none read twice)") in proc.stdout
    averaged = ("the checkpoint was taken within epoch 2 on 2 ranks, whose BatchNorm statistics differ: each of the "
                "1 ranks now goes on from their average")
    assert averaged in proc.stdout, proc.stdout[-2000:]
    history = read_json(tmp_path / "on-one-rank" / "summary.json")["history"]
    # 1,438 samples: 2 ranks x 8 steps x 32 read before, and the 926 left make 28 full batches of 32 on one rank.
    assert [h["epoch"] for h in history] == [1, 2] and history[1]["train_count"] == 512 + 28 * 32


@pytest.mark.distributed
def test_photos_stopped_by_sigterm_under_horovodrun_with_loader_workers_resume_bitwise(tmp_path):
    # JPEGs of an image folder: decoded and cropped to uint8 in two loader workers a rank (which horovodrun's
    # SIGTERM reaches too), normalized and randomly erased by the feed (seeded by the step), into torchvision's
    # ResNet-18 (BatchNorm), horovodrun over Gloo: `kill -TERM <horovodrun's pid>` just after a checkpoint within
    # epoch 1 (of 13 steps). The ranks agree on a step, rank 0 saves there, the run stops; resumed, it ends where a
    # run that never stopped ends, bit for bit.
    # A step schedule: its rates do not depend on --epochs, so the stopped run can plan 300 and the other stop
    # where it stopped.
    from formats import write_image_folder

    write_image_folder(tmp_path / "photos", per_class=80, size=48, ext="jpg")
    common = ["--dataset", "imagefolder", "--data-dir", tmp_path / "photos", "--model", "resnet18", "--image-size",
              "32", "--batch-size", "8", "--workers", "2", "--reprob", "0.5", "--lr-schedule", "step",
              "--optim.lr_milestones", "2", "--checkpoint.every_steps", "5", *QUIET]
    run, log = tmp_path / "stopped", tmp_path / "log"
    with open(log, "w") as out:
        proc = subprocess.Popen(launch_command("horovodrun-gloo", 2, [str(TRAIN), "--output-dir", str(run),
                                                                      "--epochs", "300", *common]),
                                cwd=ROOT, env=job_env(), stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            wait_for(lambda: proc.poll() is not None or any(
                int(p.stem.split("_")[1]) >= 5 for p in (run / "checkpoints").glob("step_*.pt")), "a step checkpoint")
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=300)
        finally:
            proc.kill()
    output = log.read_text()
    assert proc.returncode in (143, 137) and "DataLoader worker" not in output, output[-3000:]
    assert "every rank saves a checkpoint at its next step" in output, output[-3000:]
    stopped = last_checkpoint(run)
    # The epoch it stopped within (or, where the step it saved at ended an epoch, the next), trained to its end.
    epoch = stopped["partial"]["epoch"] if stopped["partial"] else stopped["epoch"] + 1
    launch("horovodrun-gloo", 2, TRAIN, "--output-dir", run, "--resume", "auto", "--epochs", epoch, *common)
    launch("horovodrun-gloo", 2, TRAIN, "--output-dir", tmp_path / "straight", "--epochs", epoch, *common)
    straight, resumed = last_checkpoint(tmp_path / "straight"), last_checkpoint(run)
    assert straight["step"] == resumed["step"]
    for name, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][name]), f"{name} differs after resuming"
    for key, state in straight["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], resumed["optimizer"]["state"][key]["momentum_buffer"])
    summaries = [read_json(folder / "summary.json")["history"] for folder in (tmp_path / "straight", run)]
    assert [h["val_loss"] for h in summaries[0]] == [h["val_loss"] for h in summaries[1]]


@pytest.mark.distributed
def test_resuming_on_another_number_of_ranks_says_what_changes(tmp_path):
    launch("mpirun", 2, TRAIN, "--output-dir", tmp_path / "out", "--epochs", "2", *QUIET)
    proc = launch("single", 1, TRAIN, "--output-dir", tmp_path / "out", "--epochs", "3", "--resume", "auto", *QUIET)
    assert ("resuming on 1 rank(s) a run checkpointed on 2: learning rate 0.05 -> 0.025, global batch 64 -> 32 "
            "(both follow the ranks); the schedule goes on by epochs from epoch 3/3, now of 44 steps") in proc.stdout
    summary = read_json(tmp_path / "out" / "summary.json")
    assert summary["world_size"] == 1
    assert [(r["previous_world_size"], r["world_size"], r["epoch"]) for r in summary["resumes"]] == [(2, 1, 2)]


def test_resuming_a_finished_run_refuses_and_writes_nothing(tmp_path, app):
    train_here(app, tmp_path, "--epochs", 2)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    result = app("--output-dir", tmp_path, "--epochs", 2, "--resume", "auto")
    assert_refused(result, "nothing to train", "the checkpoint is at epoch 2 and --epochs is 2", "--evaluate --resume")
    assert "done:" not in result.stdout
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing rewritten


@pytest.mark.parametrize("flag,value,setting", [
    ("--dataset", "synthetic", "in_channels=1"),  # digits are 1-channel 8x8 images; synthetic ones 3-channel
    ("--image-size", "16", "image_size=8"),
    ("--optimizer", "adam", "optimizer_name='sgd'"),
])
def test_a_checkpoint_of_another_data_set_image_size_or_optimizer_is_refused_naming_the_setting(tmp_path, app, flag,
                                                                                                value, setting):
    train_here(app, tmp_path, "--epochs", 1)
    result = app("--output-dir", tmp_path, "--epochs", 3, "--resume", "auto", flag, value)
    assert_refused(result, "checkpoints/last.pt was written with " + setting, "this run has")
    assert epochs_in(tmp_path) == [1]


def test_a_file_that_is_not_a_checkpoint_is_refused_without_torch_s_advice(tmp_path, app):
    foreign = tmp_path / "foreign.pt"
    foreign.write_bytes(b"PK\x03\x04 a zip header and nothing else")
    result = app("--output-dir", tmp_path / "run", "--resume", foreign)
    line = assert_refused(result, str(foreign), "not a checkpoint")
    assert "weights_only" not in result.stdout + result.stderr and "cut short" in line


def test_a_resumed_run_records_its_resume_points_and_whole_run_totals(tmp_path, app):
    # The records are rank 0's; one rank in this process writes them as it does in a job (the ranks a resume finds
    # are recorded in test_resuming_on_another_number_of_ranks_says_what_changes).
    for epochs, resume in ((2, ()), (3, ("--resume", "auto")), (5, ("--resume", "auto"))):
        train_here(app, tmp_path, "--epochs", epochs, *resume)
    summary = read_json(tmp_path / "summary.json")
    assert [(r["epoch"], r["world_size"]) for r in summary["resumes"]] == [(2, 1), (3, 1)]
    history = summary["history"]
    assert [r["epoch"] for r in history] == epochs_in(tmp_path) == [1, 2, 3, 4, 5]
    # Times add up over the parts: the history's clock never restarts, and the run took longer than its last part.
    walls = [r["wall_seconds"] for r in history]
    assert walls == sorted(walls) and summary["wall_seconds"] > summary["process_wall_seconds"] > 0
    assert summary["wall_seconds"] >= walls[-1]
    rate = sum(r["train_count"] for r in history) / sum(r["epoch_seconds"] for r in history)
    assert summary["train_samples_per_sec"] == pytest.approx(rate)


def test_records_after_the_last_checkpoint_are_dropped_on_resume(tmp_path, app):
    # Checkpoints every 2 epochs: epoch 3's record is written, the run is interrupted before epoch 4's checkpoint.
    train_here(app, tmp_path, "--epochs", 3, "--checkpoint.every_epochs", 2)
    (tmp_path / "checkpoints" / "last.pt").unlink()
    os.link(tmp_path / "checkpoints" / "epoch_0002.pt", tmp_path / "checkpoints" / "last.pt")
    assert epochs_in(tmp_path) == [1, 2, 3]
    train_here(app, tmp_path, "--epochs", 4, "--resume", "auto")
    assert epochs_in(tmp_path) == [1, 2, 3, 4]
    assert tensorboard_steps(tmp_path) == [1, 2, 3, 4]


def test_resume_auto_starts_afresh_where_there_is_nothing_to_resume(tmp_path, app):
    result = app("--output-dir", tmp_path, "--epochs", "1", "--resume", "auto")
    assert result.returncode == 0 and "no checkpoint in" in result.stdout and (tmp_path / "summary.json").exists()


def test_a_checkpoint_of_another_model_is_refused_with_the_mismatch_named_leaving_no_new_folder(tmp_path, app):
    result = app("--output-dir", tmp_path / "a", "--epochs", "1")
    assert result.returncode == 0
    # A background save says where it writes, then the file's name once it is in place.
    said = [line for line in result.stdout.splitlines() if line.startswith("checkpoint epoch 1:")]
    assert said == [f"checkpoint epoch 1: writing {tmp_path / 'a' / 'checkpoints' / 'epoch_0001.pt'} in the "
                    f"background", f"checkpoint epoch 1: saved {tmp_path / 'a' / 'checkpoints' / 'epoch_0001.pt'} "
                    f"(and last.pt, best.pt)"], result.stdout
    other_model = ["--model", "resnet18", "--resume", tmp_path / "a" / "checkpoints" / "last.pt"]
    # Refused after the claim made the directory (and its parent): neither is left.
    assert_refused(app("--output-dir", tmp_path / "new" / "b", *other_model),
                   "model_name='small_cnn', this run has model_name='resnet18'")
    assert not (tmp_path / "new").exists()
    # A directory that was there stays, as it was.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert_refused(app("--output-dir", tmp_path / "mine", *other_model), "this run has model_name='resnet18'")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_a_corrupt_checkpoint_is_named(tmp_path, app):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"PK\x03\x04 definitely not a zip")
    assert_refused(app("--output-dir", tmp_path / "out", "--resume", bad), f"{bad}: not a checkpoint, or one cut short")


def cut_short(path):
    """`path` replaced by a copy of its first half, as a copy or write stopped halfway leaves it (a new file: the
    hard links beside it keep the whole one)."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[:len(data) // 2])


def test_resume_auto_passes_over_a_damaged_last_checkpoint_names_it_and_resume_path_stays_strict(tmp_path, app):
    run = tmp_path / "run"
    assert app("--output-dir", run, "--epochs", "3").returncode == 0
    cut_short(run / "checkpoints" / "last.pt")
    result = app("--output-dir", run, "--epochs", "4", "--resume", "auto")
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in (result.stdout + result.stderr).splitlines() if "passed over" in line]
    assert len(said) == 1 and "checkpoints/last.pt (cut short: not a whole zip archive)" in said[0], said
    assert "resuming from checkpoints/epoch_0003.pt, the newest whole checkpoint" in said[0]
    assert "resuming after epoch 3" in result.stdout and epochs_in(run) == [1, 2, 3, 4]
    cut_short(run / "checkpoints" / "last.pt")
    assert_refused(app("--output-dir", tmp_path / "other", "--resume", run / "checkpoints" / "last.pt"),
                   "not a checkpoint, or one cut short")


def test_resume_auto_past_a_save_its_writer_never_finished_says_so_in_one_line(tmp_path, app):
    # A writer killed inside epoch 2's background save leaves only its temporary file; last.pt is epoch 1's.
    run = tmp_path / "run"
    assert app("--output-dir", run, "--epochs", "1").returncode == 0
    (run / "checkpoints" / "epoch_0002.pt.tmp.k2j4x9q0").write_bytes(b"half a checkpoint")
    result = app("--output-dir", run, "--epochs", "2", "--resume", "auto")
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in (result.stdout + result.stderr).splitlines() if "not finished" in line]
    assert said == ["--resume auto: a save was not finished: checkpoints/epoch_0002.pt (its writer stopped before "
                    "the rename and left checkpoints/epoch_0002.pt.tmp.k2j4x9q0, which this run removes); resuming "
                    "from checkpoints/last.pt instead"], result.stdout
    assert "resuming after epoch 1" in result.stdout and epochs_in(run) == [1, 2]
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp." in p.name]


def test_resume_auto_with_no_whole_checkpoint_is_refused_naming_each(tmp_path, app):
    run = tmp_path / "run"
    assert app("--output-dir", run, "--epochs", "1").returncode == 0
    for path in (run / "checkpoints").glob("*.pt"):
        cut_short(path)
    assert_refused(app("--output-dir", run, "--epochs", "2", "--resume", "auto"), "no checkpoint in",
                   "is whole", "checkpoints/last.pt (cut short", "checkpoints/epoch_0001.pt (cut short")


def test_checkpoints_every_few_minutes_follow_rank_0_s_clock(tmp_path, app, monkeypatch):
    # The clock the saves read, made to run 20 s a step: with --checkpoint.every_minutes 1 a checkpoint follows every
    # third step or so, at steps rank 0's clock chose, and the last one is an epoch's end.
    from hvd_train.run import checkpoint as saves

    ticks = iter(range(0, 10**6, 20))
    monkeypatch.setattr(saves.time, "monotonic", lambda: next(ticks))
    result = app("--output-dir", tmp_path, "--epochs", 1, "--checkpoint.every_minutes", 1, "--data.val_fraction", 0.9)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = read_json(tmp_path / "summary.json")
    within = summary["checkpoints_within_epochs"]
    assert within["count"] >= 2 and within["background"] and summary["last_checkpoint"]["end_of_epoch"]
    saved = [line for line in result.stdout.splitlines() if line.startswith("checkpoint within epoch 1, after step")
             and ": saved " in line]
    assert len(saved) == within["count"], result.stdout


def test_checkpoints_within_epochs_change_nothing_of_the_training(tmp_path, app):
    # The same run with and without them: the same weights, bit for bit (the saves draw no random number and the
    # training thread only waits for a copy).
    train_here(app, tmp_path / "plain", "--epochs", 1)
    train_here(app, tmp_path / "saving", "--epochs", 1, "--checkpoint.every_steps", 5)
    plain, saving = last_checkpoint(tmp_path / "plain"), last_checkpoint(tmp_path / "saving")
    assert all(torch.equal(value, saving["model"][name]) for name, value in plain["model"].items())
    assert read_json(tmp_path / "saving" / "summary.json")["checkpoints_within_epochs"]["count"] == 44 // 5


def test_a_run_ahead_of_its_slurm_time_limit_saves_at_a_step_and_exits_to_be_requeued(tmp_path, app, monkeypatch):
    # squeue says 400 s are left (tests/cluster/test_slurm.py reads the real one), and the clock runs 20 s a step:
    # with the default 300 s margin the run saves and stops within a few steps, exit 75 for the batch script.
    from hvd_train.guards import interrupt

    ticks = iter(range(0, 10**6, 20))
    monkeypatch.setattr(interrupt.time, "monotonic", lambda: next(ticks))
    monkeypatch.setattr(interrupt, "slurm_seconds_left", lambda: 400)
    result = app("--output-dir", tmp_path, "--epochs", 2)
    assert result.returncode == 75, result.stdout[-3000:] + result.stderr[-3000:]
    assert "SLURM time limit in 400 s: a checkpoint and a stop (exit 75, to be requeued) 300 s before it" in \
        result.stdout
    said = re.search(r"train_hvd.py: stopped ahead of the job's time limit \(SLURM\) at epoch 1/2, after (\d+) "
                     r"step\(s\) of it; --resume auto continues from \S+last.pt \(epoch 1, after step (\d+) of it\)",
                     result.stderr)
    assert said and said.group(1) == said.group(2), result.stderr[-3000:]
    assert last_checkpoint(tmp_path)["partial"]["steps"] == int(said.group(1)) < 44
