"""Pure pieces: learning-rate scaling and schedules, optimizers, tasks, models, checkpoints, reports."""
import json
import math
import os

import pytest
import torch

from hvd_train import engine
from hvd_train.run import checkpoint
from hvd_train.build import build_optimizer, param_groups
from hvd_train.config import OptimConfig
from hvd_train.engine import StepOptions, Trainer
from hvd_train.errors import CheckpointError
from hvd_train.run.best import averages
from hvd_train.run.reporting import Reporter
from hvd_train.run.directory import RunDir
from hvd_train.schedule import LRSchedule, lr_factor
from hvd_train.tasks import builtin_task
from hvd_utils import lr_scale
from hvd_train.models import build_model, model_names, model_task


@pytest.mark.parametrize("world,accumulate,adasum,expected", [(1, 1, False, 1), (8, 1, False, 8), (32, 2, False, 64),
                                                              (8, 2, True, 2)])
def test_learning_rate_scales_linearly_with_the_global_batch(world, accumulate, adasum, expected):
    assert lr_scale(world, accumulate, adasum) == expected


def test_averages_divide_global_sums_by_the_global_count():
    totals = {"loss": 6.0, "acc1": 300.0, "acc5": 700.0, "count": 7.0}
    assert averages(totals) == {"loss": 6 / 7, "acc1": 300 / 7, "acc5": 100.0, "count": 7}
    vae = averages({"loss": 10.0, "recon": 8.0, "kl": 2.0, "count": 4.0})
    assert vae == {"loss": 2.5, "recon": 2.0, "kl": 0.5, "count": 4}


def test_averages_of_nothing_are_not_a_division_by_zero():
    result = averages({"loss": 0.0, "acc1": 0.0, "acc5": 0.0, "count": 0.0})
    assert result["count"] == 0 and math.isnan(result["acc1"]) and math.isnan(result["loss"])


def lr(step, schedule, **kw):  # 10 steps per epoch, 10 epochs
    return lr_factor(step / 10, epochs=10, schedule=schedule, **kw)


def test_cosine_falls_from_the_peak_to_zero_and_constant_stays():
    assert lr(0, "cosine") == 1.0 and lr(50, "cosine") == pytest.approx(0.5) and lr(100, "cosine") == 0.0
    factors = [lr(s, "cosine") for s in range(101)]
    assert factors == sorted(factors, reverse=True)
    assert {lr(s, "constant") for s in (0, 50, 100)} == {1.0}


def test_warmup_climbs_linearly_from_the_unscaled_rate_then_hands_over():
    kw = dict(warmup_epochs=2, warmup_start=0.25)
    assert lr(0, "constant", **kw) == 0.25 and lr(10, "constant", **kw) == pytest.approx(0.625)
    assert lr(20, "constant", **kw) == 1.0
    assert lr(20, "cosine", **kw) == 1.0 and lr(60, "cosine", **kw) == pytest.approx(0.5)


def test_step_divides_at_milestones_and_exponential_decays_per_epoch():
    kw = dict(milestones=(3, 6), gamma=0.1)
    assert [lr(s, "step", **kw) for s in (29, 30, 59, 60)] == pytest.approx([1, 0.1, 0.1, 0.01])
    assert lr(25, "exponential", gamma=0.5) == pytest.approx(0.5 ** 2.5)


def test_scheduler_changes_the_rate_every_step():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.4)
    schedule, hooks = LRSchedule(OptimConfig(epochs=1, lr=0.4, lr_schedule="cosine"), lr_scale=1), engine.Hooks()
    rates = []
    for step in range(4):
        schedule.apply(optimizer, hooks.position(1, step, 4))
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
    assert rates == pytest.approx([0.4, 0.4 * (0.5 + 0.5 * 2 ** -0.5), 0.2, 0.4 * (0.5 - 0.5 * 2 ** -0.5)])


def test_biases_and_norm_layers_get_no_weight_decay_unless_asked():
    model = build_model("resnet18", 3, 10, 32)
    groups = param_groups(model, 5e-4)
    decayed, free = groups[0]["params"], groups[1]["params"]
    assert all(p.ndim > 1 for p in decayed) and all(p.ndim == 1 for p in free) and free
    assert groups[1]["weight_decay"] == 0.0
    assert len(param_groups(model, 5e-4, decay_norm_and_bias=True)) == 1


@pytest.mark.parametrize("name,cls", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam),
                                      ("adamw", torch.optim.AdamW)])
def test_optimizers_by_name(name, cls):
    model = build_model("small_cnn", 1, 10, 8)
    optimizer = build_optimizer(model, OptimConfig(optimizer=name, weight_decay=1e-4), lr=0.1)
    assert isinstance(optimizer, cls) and optimizer.param_groups[0]["lr"] == 0.1


def trainer_for(model, optimizer, **opts):
    return Trainer(model, builtin_task("classification"), optimizer, schedule=None, device=torch.device("cpu"),
                   opts=StepOptions(**opts))


def test_gradient_accumulation_splits_the_batch_without_changing_the_gradient():
    torch.manual_seed(0)
    images, labels = torch.randn(12, 1, 8, 8), torch.randint(0, 10, (12,))
    results = []
    for accumulate in (1, 3, 5):  # 5 does not divide 12: the chunks are weighted by size
        torch.manual_seed(1)
        model = build_model("small_cnn", 1, 10, 8).eval()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        sums = engine.train_step(trainer_for(model, optimizer, accumulate=accumulate), (images, labels))
        assert int(sums["count"]) == 12
        results.append([p.detach().clone() for p in model.parameters()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_clipping_bounds_the_update():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.train_step(trainer_for(model, optimizer, clip_grad=0.01), (100 * torch.randn(8, 4), torch.zeros(8).long()))
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert moved.norm() == pytest.approx(0.01, rel=1e-4)


def test_bf16_autocast_runs_the_forward_in_bfloat16_on_the_cpu():
    model = torch.nn.Linear(4, 2)
    with engine.autocast(torch.device("cpu"), "bf16"):
        assert model(torch.randn(3, 4)).dtype == torch.bfloat16
    with engine.autocast(torch.device("cpu"), "off"):
        assert model(torch.randn(3, 4)).dtype == torch.float32


def test_vae_loss_has_reconstruction_and_kl_terms():
    model = build_model("vae", 1, 10, 8)
    images = torch.rand(5, 1, 8, 8)
    task = builtin_task("vae")
    loss, sums = task.step(model, (images, torch.zeros(5).long()))
    assert sums["loss"].item() == pytest.approx(sums["recon"].item() + sums["kl"].item(), rel=1e-6)
    assert loss.item() == pytest.approx(sums["loss"].item() / 5, rel=1e-6) and sums["kl"].item() >= 0
    assert set(sums) == set(task.keys) == {"count", "loss", "recon", "kl"}
    assert model_task("vae") == "vae" and model_task("resnet50") == "classification"


@pytest.mark.parametrize("name,channels,size", [("small_cnn", 1, 8), ("resnet18", 1, 28), ("resnet18", 3, 32),
                                                ("mobilenet_v3_small", 3, 64), ("vae", 1, 28)])
def test_models_adapt_to_channels_classes_and_size(name, channels, size):
    model = build_model(name, channels, 7, size).eval()
    out = model(torch.randn(2, channels, size, size))
    assert (out[0] if isinstance(out, tuple) else out).shape == ((2, channels, size, size) if name == "vae"
                                                                 else (2, 7))


def test_small_images_get_the_small_image_resnet_stem():
    model = build_model("resnet18", 3, 10, 32)
    assert model.conv1.stride == (1, 1) and isinstance(model.maxpool, torch.nn.Identity)
    assert build_model("resnet18", 3, 10, 224).conv1.stride == (2, 2)


def test_unknown_models_and_too_small_images_are_refused_clearly():
    assert "resnet50" in model_names() and "small_cnn" in model_names()
    with pytest.raises(ValueError, match="unknown model 'vgg9000'"):
        build_model("vgg9000", 1, 10, 8)
    with pytest.raises(ValueError, match="cannot take 3x16x16 images"):
        build_model("alexnet", 3, 10, 16)


def payload(epoch):
    return {"version": checkpoint.VERSION, "epoch": epoch, "model": {"w": torch.full((2,), float(epoch))}}


def test_checkpointer_keeps_last_best_and_the_newest_n(tmp_path):
    run_dir = RunDir(str(tmp_path))
    saver = checkpoint.Checkpointer(run_dir.checkpoints, keep_last=2)
    for epoch in range(1, 6):
        saver.save(payload(epoch), epoch, is_best=epoch == 2)
    ckpts = tmp_path / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["best.pt", "epoch_0004.pt", "epoch_0005.pt", "last.pt"]
    assert checkpoint.load(str(ckpts / "last.pt"))["epoch"] == 5
    assert checkpoint.load(str(ckpts / "best.pt"))["epoch"] == 2
    assert run_dir.resolve("auto") == str(ckpts / "last.pt")


def test_checkpointer_on_other_ranks_writes_nothing(tmp_path):
    checkpoint.Checkpointer(str(tmp_path / "c"), enabled=False).save(payload(1), 1, is_best=True)
    assert not (tmp_path / "c").exists()


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    torch.manual_seed(3)
    state = checkpoint.rng_state()
    expected = torch.rand(3)
    checkpoint.atomic_save({"version": checkpoint.VERSION, "rng": [state]}, str(tmp_path / "c.pt"))
    torch.manual_seed(99)
    checkpoint.set_rng_state(checkpoint.load(str(tmp_path / "c.pt"))["rng"][0])
    assert torch.equal(torch.rand(3), expected)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/hvd-train-pwned",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"version": checkpoint.VERSION, "model": _RunsCode()}, path)
    with pytest.raises(CheckpointError, match="evil.pt"):
        checkpoint.load(str(path))
    assert not os.path.exists("/tmp/hvd-train-pwned")


@pytest.mark.parametrize("content", [b"", b"not a checkpoint", None])
def test_unreadable_checkpoints_name_the_file(tmp_path, content):
    path = tmp_path / "bad.pt"
    if content is None:
        checkpoint.atomic_save(payload(1), str(path))
        path.write_bytes(path.read_bytes()[:100])  # truncated
    else:
        path.write_bytes(content)
    with pytest.raises(CheckpointError, match="bad.pt"):
        checkpoint.load(str(path))


def test_resume_paths_that_do_not_exist_are_named_and_auto_may_find_nothing(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        RunDir(str(tmp_path)).resolve(str(tmp_path / "x.pt"))
    assert RunDir(str(tmp_path)).resolve("auto") is None


def make_run(directory):
    saver = checkpoint.Checkpointer(str(directory / "checkpoints"))
    saver.save(payload(1), 1, is_best=True)
    (directory / "summary.json").write_text("{}")
    (directory / "notes.txt").write_text("mine")


def test_a_used_output_directory_is_continued_replaced_or_refused(tmp_path):
    def claim(root, resume, overwrite):
        run_dir = RunDir(str(root))
        with run_dir.lock:
            return run_dir.claim(resume, overwrite)

    assert claim(tmp_path / "new", "", overwrite=False) is None
    make_run(tmp_path)
    with pytest.raises(CheckpointError, match="already holds a run .*--resume auto.*--overwrite"):
        claim(tmp_path, "", overwrite=False)
    assert claim(tmp_path, "auto", overwrite=False) == str(tmp_path / "checkpoints" / "last.pt")
    assert claim(tmp_path, "", overwrite=True) is None
    assert sorted(os.listdir(tmp_path)) == ["new", "notes.txt"], "only the run's own files are replaced"


def test_resume_auto_refuses_a_run_without_a_checkpoint(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no checkpoints/last.pt to continue from"):
        RunDir(str(tmp_path)).claim("auto", overwrite=False)


def test_a_killed_writer_leaves_only_temporary_files_that_the_next_run_removes(tmp_path):
    checkpoint.Checkpointer(str(tmp_path)).save(payload(1), 1, is_best=False)
    (tmp_path / "last.pt.tmp.1234").write_bytes(b"half a checkpoint")
    checkpoint.Checkpointer(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["epoch_0001.pt", "last.pt"]


def test_reporter_writes_json_lines_tensorboard_events_and_a_png(tmp_path):
    reporter = Reporter(RunDir(str(tmp_path)), enabled=True)
    history = [{"epoch": e, "lr": 0.1, "train_loss": 1.0 / e, "val_loss": 1.5 / e, "val_acc1": 50.0 + e}
               for e in (1, 2, 3)]
    for record in history:
        reporter.epoch(record)
    png = reporter.plot(history)
    reporter.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [s.value for s in events.Scalars("val/acc1")] == [51.0, 52.0, 53.0]


def test_reporter_on_other_ranks_writes_nothing(tmp_path):
    reporter = Reporter(RunDir(str(tmp_path / "r")), enabled=False)
    reporter.epoch({"epoch": 1})
    assert reporter.plot([{"epoch": 1}]) is None
    assert not (tmp_path / "r").exists()


def test_an_epoch_that_ends_again_after_an_elastic_rollback_replaces_its_record_and_best():
    from hvd_train.run.state import RunState
    state, task = RunState(), trainer_for(None, None).task
    for epoch, acc in [(1, 50.0), (2, 70.0), (3, 60.0), (2, 55.0), (3, 52.0)]:  # a rollback into epoch 2
        state.add(task, {"epoch": epoch, "val_acc1": acc})
    assert [(h["epoch"], h["val_acc1"]) for h in state.history] == [(1, 50.0), (2, 55.0), (3, 52.0)]
    assert (state.best_metric, state.best_epoch) == (55.0, 2)


def test_an_interruption_names_the_last_epoch_whose_record_and_checkpoint_are_written():
    from hvd_train.run.state import RunState
    state, task = RunState(), trainer_for(None, None).task
    assert state.where(5, "last.pt") == "at the end of epoch 0/5; no checkpoint was written yet, so --resume auto " \
                                        "starts afresh"
    state.in_epoch, state.epoch_first_step, state.step = 1, 0, 3
    assert state.where(5, "last.pt").startswith("at epoch 1/5, after 3 step(s) of it; no checkpoint")
    # Epoch 1's steps are done and recorded in the run state, its files not yet written: it is still epoch 1.
    state.add(task, {"epoch": 1, "val_acc1": 50.0})
    assert state.where(5, "last.pt").startswith("at epoch 1/5, after 3 step(s) of it")
    state.saved_epoch = state.closed_epoch = 1  # what AfterEpoch does once they are
    assert state.where(5, "last.pt") == "at the end of epoch 1/5; --resume auto continues from last.pt (the end of " \
                                        "epoch 1)"
