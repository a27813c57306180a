"""Exact averages and what rank 0 reports: metrics.jsonl, TensorBoard, curves, records replaced after an elastic
rollback, where an interruption left the run."""
import json
import math

from hvd_train.tasks import averages
from hvd_train.run.reports import Reporter
from hvd_train.run.directory import RunDir

from conftest import trainer_for


def test_averages_divide_global_sums_by_the_global_count():
    totals = {"loss": 6.0, "acc1": 300.0, "acc5": 700.0, "count": 7.0}
    assert averages(totals) == {"loss": 6 / 7, "acc1": 300 / 7, "acc5": 100.0, "count": 7}
    vae = averages({"loss": 10.0, "recon": 8.0, "kl": 2.0, "count": 4.0})
    assert vae == {"loss": 2.5, "recon": 2.0, "kl": 0.5, "count": 4}


def test_averages_of_nothing_are_not_a_division_by_zero():
    result = averages({"loss": 0.0, "acc1": 0.0, "acc5": 0.0, "count": 0.0})
    assert result["count"] == 0 and math.isnan(result["acc1"]) and math.isnan(result["loss"])


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


def test_the_data_line_shows_the_factorys_call_on_one_line_with_uris_redacted():
    import torch
    from hvd_train.run.reports import describe_call

    path = "/data/" + "a-long-folder-name/" * 8
    shown = describe_call("mydata:sets", {
        "seed": 42, "image_size": 64, "scale": 0.5, "flip": True, "root": path, "note": "two\nlines", "none": None,
        "sizes": (32, 64), "table": {"a": 1}, "many": list(range(100)), "weights": torch.zeros(3),
        "url": "https://bob:secret@host/d?token=abc", "transform": object()})
    assert shown == (f"mydata:sets(seed=42, image_size=64, scale=0.5, flip=True, root={path!r}, note='two\\nlines', "
                     f"none=None, sizes=(32, 64), table={{'a': 1}}, many=<list of 100>, weights=<Tensor>, "
                     f"url='https://host/d?token=REDACTED', transform=<object>)")
    assert describe_call("plugs:views", {}) == "plugs:views()" and describe_call("digits", None) == "digits"
