"""--mlflow and --mlflow-uri against a real `mlflow server` (SQLite backend, on loopback): a 2-rank run that crashes
and is resumed is one MLflow run with one value per epoch, equal to metrics.jsonl and summary.json; a server killed
mid-run leaves training finishing with its warning; without a URI the run goes to a store in the output directory.
--wandb: W&B's offline run directories, read back from W&B's own record files, with the same rules."""
import pytest
from mlflow.tracking import MlflowClient

from conftest import QUIET, WORKERS, launch, read_json, run_app

# The digits on 2 ranks, 32 a batch: 22 full steps per rank per epoch. Checkpoints every 2 epochs, so a crash in epoch
# 4 leaves epoch 3's record written but not committed: the resumed run trains it again.
EPOCHS = ("--epochs", "4", "--batch-size", "32", "--checkpoint.every_epochs", "2")
STEPS_PER_EPOCH = 22


def the_run(uri):
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("hvd-train").experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


def history(client, run, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]


def jsonl(path):
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.distributed
def test_a_crashed_and_resumed_run_is_one_mlflow_run_with_one_value_per_epoch(tmp_path, server):
    uri, _, _ = server
    out = tmp_path / "run"
    flags = ("--output-dir", out, "--mlflow-uri", uri, *EPOCHS)
    # Rank 1 fails in epoch 4: epoch 3 was recorded, but its checkpoint is not due until epoch 4.
    crashed = launch("horovodrun-gloo", 2, WORKERS / "faulty_train.py", "1", 3 * STEPS_PER_EPOCH + 2, "raise", "--",
                     *QUIET, *flags, check=False, env={"HVD_TEST_FAULT_TIME": str(tmp_path / "fault")})
    assert crashed.returncode != 0 and [r["epoch"] for r in jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    client, run = the_run(uri)
    assert run.info.status == "FAILED" and [s for s, _ in history(client, run, "val_acc1")] == [1, 2]

    run_app("horovodrun-gloo", 2, *flags, "--resume", "auto")
    client, run = the_run(uri)  # the same run, continued
    records, summary = jsonl(out / "metrics.jsonl"), read_json(out / "summary.json")
    assert run.info.status == "FINISHED"
    for key in ("val_acc1", "val_loss", "train_loss", "lr"):
        assert history(client, run, key) == [(r["epoch"], pytest.approx(r[key])) for r in records], key
    assert [r["epoch"] for r in records] == [1, 2, 3, 4]
    assert run.data.metrics["best_val_acc1"] == pytest.approx(summary["best_val_acc1"])
    assert run.data.metrics["final_val_acc1"] == pytest.approx(summary["final_val_acc1"])
    assert run.data.params["optim.epochs"] == "4" and run.data.params["data.dataset"] == "digits"
    assert run.data.tags["world_size"] == "2" and run.data.tags["controller"] == "Gloo"
    assert run.data.tags["horovod_version"].count(".") >= 2
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "metrics.jsonl", "config.json"} <= artifacts


@pytest.mark.distributed
@pytest.mark.extended
def test_a_server_killed_mid_run_leaves_training_finishing_with_one_warning(tmp_path, server):
    uri, pgid, db = server
    out = tmp_path / "run"
    # Checkpoints written on the training thread: epoch 1's record is sent before step 23 begins. (In the background,
    # it may still be on its way when the server dies; then it is one more epoch that run says it did not log.)
    proc = launch("horovodrun-gloo", 2, WORKERS / "kill_at_step.py", pgid, STEPS_PER_EPOCH + 5, "--", *QUIET,
                  "--output-dir", out, "--mlflow-uri", uri, "--epochs", "3", "--batch-size", "32",
                  "--checkpoint.background", "false")
    summary = read_json(out / "summary.json")
    assert [r["epoch"] for r in summary["history"]] == [1, 2, 3]
    output = proc.stdout + proc.stderr
    warnings = [line for line in output.splitlines() if "could not log" in line]
    assert len(warnings) == 1 and "training goes on" in warnings[0], output[-3000:]
    lost = [line for line in output.splitlines() if "not logged:" in line]
    assert len(lost) == 1 and "epoch(s) 2-3" in lost[0] and "summary.json" in lost[0], output[-3000:]
    # What reached the server before it died is in its store.
    client, run = the_run(f"sqlite:///{db}")
    assert [s for s, _ in history(client, run, "val_acc1")] == [1]


def test_mlflow_without_a_uri_logs_to_the_output_directory(tmp_path, app):
    result = app("--output-dir", tmp_path, "--epochs", "2", "--mlflow")
    assert result.returncode == 0, result.stderr
    client, run = the_run(f"sqlite:///{tmp_path / 'mlflow.db'}")
    records = jsonl(tmp_path / "metrics.jsonl")
    assert history(client, run, "val_acc1") == [(r["epoch"], pytest.approx(r["val_acc1"])) for r in records]
    # Where the step time went (hvd_train/timing.py): the mean over the ranks, and the slowest rank's own work.
    for key in ("time_data", "time_compute", "time_allreduce_wait", "time_slowest_busy"):
        assert history(client, run, key) == [(r["epoch"], pytest.approx(r[key])) for r in records], key
    assert "summary.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert (tmp_path / "mlflow-artifacts").is_dir()


@pytest.mark.parametrize("flag", ["--mlflow", "--wandb"])
def test_tracking_is_refused_with_elastic(tmp_path, app, flag):
    result = app("--output-dir", tmp_path, "--elastic", flag)
    assert result.returncode == 2 and f"{flag} with --elastic" in result.stderr


def wandb_records(run_dir):
    """(run id, {step: history row}, summary updates) of an offline W&B run directory, read from its .wandb file:
    W&B's protobuf records in LevelDB's log framing (7-byte file header, 32 KiB blocks, each record chunk with a
    7-byte header: CRC, length, type; types 1 and 4 end a record)."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    raw = next(run_dir.glob("run-*.wandb")).read_bytes()
    pos, chunk, run_id, rows, summary = 7, b"", None, {}, {}
    while pos + 7 <= len(raw):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        chunk, pos = chunk + raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        chunk, which = b"", record.WhichOneof("record_type")
        if which == "run":
            run_id = record.run.run_id
        elif which == "history":
            rows[record.history.step.num] = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                             for i in record.history.item}
        elif which == "summary":
            summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.summary.update})
    return run_id, rows, summary


def test_wandb_offline_crash_and_resume_is_one_run_with_one_row_per_epoch(tmp_path):
    """--wandb writes offline run directories (no network); the crashed part and the resumed part are the same
    run id, and their rows together hold each epoch once, equal to metrics.jsonl."""
    steps = 45  # the digits on one rank, 32 a batch
    flags = ("--output-dir", tmp_path, "--wandb", *EPOCHS)
    crashed = launch("single", 1, WORKERS / "faulty_train.py", "0", 3 * steps + 2, "raise", "--", *QUIET, *flags,
                     check=False, env={"HVD_TEST_FAULT_TIME": str(tmp_path / "fault")}, offline=True)
    assert crashed.returncode != 0 and [r["epoch"] for r in jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    run_app("single", 1, *flags, "--resume", "auto", offline=True)
    parts = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(parts) == 2, parts
    (first_id, first, _), (second_id, second, summary) = map(wandb_records, parts)
    assert first_id == second_id and sorted(first) == [1, 2] and sorted(second) == [3, 4]
    records = jsonl(tmp_path / "metrics.jsonl")
    rows = {**first, **second}
    for r in records:
        assert rows[r["epoch"]]["val_acc1"] == pytest.approx(r["val_acc1"])
        assert rows[r["epoch"]]["train_loss"] == pytest.approx(r["train_loss"])
    assert summary["best_val_acc1"] == pytest.approx(read_json(tmp_path / "summary.json")["best_val_acc1"])
    assert (parts[1] / "files" / "summary.json").is_file()
