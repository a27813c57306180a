"""--mlflow and --mlflow-uri against a real `mlflow server` (SQLite backend, on loopback): a 2-rank run that crashes
and is resumed is one MLflow run with one value per epoch, equal to metrics.jsonl and summary.json; a server killed
mid-run leaves training finishing with its warning; without a URI the run goes to a store in the output directory."""
import os
import signal
import subprocess
import urllib.request

import pytest
from mlflow.tracking import MlflowClient

from conftest import BIN, QUIET, WORKERS, job_env, launch, read_json, run_app, wait_for
from test_slurm import free_port

# The digits on 2 ranks, 32 a batch: 23 steps per rank per epoch. Checkpoints every 2 epochs, so a crash in epoch
# 4 leaves epoch 3's record written but not committed: the resumed run trains it again.
EPOCHS = ("--epochs", "4", "--batch-size", "32", "--checkpoint.every_epochs", "2")
STEPS_PER_EPOCH = 23


@pytest.fixture
def server(tmp_path):
    """A real MLflow tracking server on a free loopback port, its runs in SQLite; yields (uri, process group, db)."""
    port, db = free_port(), tmp_path / "mlflow-server.db"
    proc = subprocess.Popen([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination",
                             str(tmp_path / "mlflow-artifacts"), "--workers", "1"],
                            env=job_env(), stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    uri = f"http://127.0.0.1:{port}"

    def healthy():
        assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        try:
            return urllib.request.urlopen(f"{uri}/health", timeout=5).read().strip() == b"OK"
        except OSError:
            return False

    wait_for(healthy, "the MLflow server to answer /health")
    yield uri, proc.pid, db
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


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
def test_a_server_killed_mid_run_leaves_training_finishing_with_one_warning(tmp_path, server):
    uri, pgid, db = server
    out = tmp_path / "run"
    proc = launch("horovodrun-gloo", 2, WORKERS / "kill_at_step.py", pgid, STEPS_PER_EPOCH + 5, "--", *QUIET,
                  "--output-dir", out, "--mlflow-uri", uri, "--epochs", "3", "--batch-size", "32")
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
    assert "summary.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert (tmp_path / "mlflow-artifacts").is_dir()


def test_mlflow_is_refused_with_elastic(tmp_path, app):
    result = app("--output-dir", tmp_path, "--elastic", "--mlflow")
    assert result.returncode == 2 and "--mlflow with --elastic" in result.stderr
