"""An output directory owns its files: one writer, no link followed (docs/reliability.md). Each test is an attack as
it was found: a run directory handed over with a planted mlflow.db whose experiment keeps its files on another host
(or in another folder), so that `--resume auto --mlflow`, and a fresh `--overwrite --mlflow` run, sent the run's files
there with the user's MLflow token (or wrote them outside the directory); folder links planted at checkpoints/,
tensorboard/, export/, mlflow-artifacts/ and a dangling mlflow.db, which had the run write where they point; and the
start-up cleanup of temporary files, which deleted a user's `*.tmp.*` files in checkpoints/ or where a link put there
pointed. The app's real runs are few: each attack on a run is refused before it trains, and one run trains."""
import os
import shutil
import sqlite3
import subprocess
import sys

import pytest
import torch

from conftest import assert_refused, epochs_in, job_env
import test_handed_over_files
from test_handed_over_files import CREDENTIALS, handed_over, one_error_line

from hvd_train.errors import CheckpointError
from hvd_train.run import checkpoint
from hvd_train.files import append_line, atomic_write, no_link_below
from hvd_train.run.directory import RunDir
from hvd_train.run.reports import Reporter

# The fixtures of the handed-over files' tests: a real run directory (one epoch, one process) and a TCP listener on
# loopback that records every connection made to it.
trained, listener = test_handed_over_files.trained, test_handed_over_files.listener

# MLflow's own client makes the store, as whoever planted it did: experiment hvd-train (the app's default) with one
# run, keeping their files in mlflow-artifacts/ beside the store, as the app makes it. (In a process of its own:
# MLflow keeps its SQLite engines open in the process that used them.)
PLANT = ("import pathlib, sys\n"
         "from mlflow.tracking import MlflowClient\n"
         "folder = pathlib.Path(sys.argv[1])\n"
         "client = MlflowClient(tracking_uri=f'sqlite:///{folder}/mlflow.db')\n"
         "experiment = client.create_experiment('hvd-train', (folder / 'mlflow-artifacts').as_uri())\n"
         "client.set_terminated(client.create_run(experiment).info.run_id)\n")


@pytest.fixture(scope="module")
def planted_store(tmp_path_factory):
    """An MLflow store (mlflow.db) of MLflow's making, with MLflow's experiment Default, whose location is in the
    working directory it was made in, and experiment hvd-train with one run."""
    folder = tmp_path_factory.mktemp("planted")
    proc = subprocess.run([sys.executable, "-c", PLANT, str(folder)], cwd=folder, env=job_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return folder / "mlflow.db"


def plant_store(store, run, location):
    """The store copied into run directory `run`, experiment hvd-train and its run keeping their files at `location`
    (what whoever handed the directory over chose)."""
    shutil.copy(store, run / "mlflow.db")
    db = sqlite3.connect(run / "mlflow.db")
    with db:
        db.execute("UPDATE experiments SET artifact_location = ? WHERE name = 'hvd-train'", (location,))
        db.execute("UPDATE runs SET artifact_uri = ? || '/' || run_uuid || '/artifacts'", (location,))
    db.close()
    return run / "mlflow.db"


def contents(folder):
    """{relative path: bytes, or None for a folder} of everything in `folder`, links not followed."""
    found = {}
    for top, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(top, name)
            found[os.path.relpath(path, folder)] = None if os.path.isdir(path) else open(path, "rb").read()
    return found


# --------------------------------------------------------------------------------------------------------------------
# A tracking store found in the directory is state from elsewhere


@pytest.mark.parametrize("where", ["another host", "another folder"])
def test_a_planted_mlflow_store_gets_nothing_from_a_resumed_run(tmp_path, app, trained, planted_store, listener,
                                                                where):
    uri, connections = listener
    elsewhere = tmp_path / "elsewhere"
    location = f"{uri}/stolen" if where == "another host" else elsewhere.as_uri()
    run = handed_over(trained, tmp_path)
    plant_store(planted_store, run, location)
    line = assert_refused(app("--output-dir", run, "--resume", "auto", "--epochs", "2", "--mlflow", env=CREDENTIALS),
                          f"{run / 'mlflow.db'}: its experiment 'hvd-train' keeps its files at {location}, outside "
                          f"{run / 'mlflow-artifacts'}", "--overwrite removes it")
    assert connections == [] and not elsewhere.exists()
    assert not any(secret in line for secret in CREDENTIALS.values())
    assert epochs_in(run) == [1] and not (run / "mlflow-artifacts").exists()


def test_overwrite_removes_a_planted_tracking_store_and_logs_into_the_directorys_own(
        tmp_path, app, trained, planted_store, listener):
    uri, connections = listener
    run = handed_over(trained, tmp_path)
    plant_store(planted_store, run, f"{uri}/stolen")
    (run / "mlflow-artifacts" / "planted").mkdir(parents=True)
    (run / "mlflow-artifacts" / "planted" / "model.pkl").write_bytes(b"theirs")
    (run / "wandb" / "offline-run-planted").mkdir(parents=True)
    result = app("--output-dir", run, "--overwrite", "--epochs", "1", "--mlflow", env=CREDENTIALS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert connections == []
    assert not (run / "wandb").exists() and not (run / "mlflow-artifacts" / "planted").exists()
    db = sqlite3.connect(f"file:{run / 'mlflow.db'}?mode=ro", uri=True)
    locations = [row[0] for row in db.execute("SELECT artifact_location FROM experiments WHERE name = 'hvd-train'")]
    uris = [row[0] for row in db.execute("SELECT artifact_uri FROM runs")]
    db.close()
    assert locations == [(run / "mlflow-artifacts").as_uri()] and len(uris) == 1, (locations, uris)
    assert uris[0].startswith(locations[0] + "/")
    assert [p.name for p in (run / "mlflow-artifacts").rglob("summary.json")] == ["summary.json"]
    RunDir(str(run)).check_mlflow_store()  # the store the app made passes its own check: a resume may use it


def test_the_store_is_read_as_data_and_every_location_must_be_the_directorys(tmp_path, planted_store):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({}, run / "checkpoints" / "last.pt")
    run_dir = RunDir(str(run))
    own = (run / "mlflow-artifacts").as_uri()

    def refused(location=None, runs=None):
        if location is not None:
            plant_store(planted_store, run, location)
        if runs is not None:
            with sqlite3.connect(run / "mlflow.db") as db:
                db.execute("UPDATE runs SET artifact_uri = ?", (runs,))
            db.close()
        with pytest.raises(CheckpointError) as e:
            run_dir.check_mlflow_store(holds_run=True)
        assert "\n" not in str(e.value)
        return str(e.value)

    plant_store(planted_store, run, own)
    run_dir.check_mlflow_store()  # the app's own: MLflow's Default, in the working directory it was made in, unused
    plant_store(planted_store, run, str(run / "mlflow-artifacts" / "1"))  # a plain path
    run_dir.check_mlflow_store()
    assert "keeps its files at file://" in refused(own + "/../../elsewhere")
    assert "outside" in refused(str(tmp_path / "mlflow-artifacts"))
    assert "s3://bucket/x" in refused("s3://bucket/x")
    message = refused("https://bob:pw-4711@example.org/x?token=tok-4711\nforged line")
    assert "pw-4711" not in message and "tok-4711" not in message and "example.org/x" in message
    assert "its run " in refused(own, runs="file:///tmp/elsewhere/artifacts")
    (run / "mlflow.db").write_bytes(b"not a database at all, " * 100)
    assert "cannot be read as an MLflow store" in refused()
    os.remove(run / "mlflow.db")
    (run / "mlflow.db-journal").write_bytes(b"\xd9\xd5\x05\xf9\x20\xa1\x63\xd7" + bytes(504))
    assert "mlflow.db-journal" in refused()
    # --overwrite removes them all, and the run's folders, links themselves (never their targets).
    kept = tmp_path / "someone-elses"
    kept.mkdir()
    (kept / "data.txt").write_text("kept")
    plant_store(planted_store, run, "http://example.org/stolen")
    os.symlink(kept, run / "mlflow-artifacts")
    os.symlink(kept, run / "wandb")
    (run / "summary.json").write_text("{}")
    with run_dir.lock:
        assert run_dir.acquire("", overwrite=True, find_checkpoint=checkpoint.checkpoint_to_resume) is None
    assert sorted(os.listdir(run)) == [] and (kept / "data.txt").read_text() == "kept"


# --------------------------------------------------------------------------------------------------------------------
# One writer, no link followed


@pytest.mark.parametrize("name", ["checkpoints", "tensorboard", "mlflow-artifacts", "mlflow.db"])
def test_a_planted_link_is_refused_and_nothing_is_written_where_it_points(tmp_path, app, trained, name):
    run = handed_over(trained, tmp_path)
    target = tmp_path / "theirs"
    if name == "checkpoints":  # their checkpoints, and a file of theirs the start-up cleanup took for its own
        shutil.move(run / "checkpoints", target)
        (target / "something.tmp.abc").write_text("theirs")
    elif name != "mlflow.db":
        target.mkdir()
        (target / "data.txt").write_text("theirs")
    before = contents(target)
    os.symlink(target, run / name)  # mlflow.db: a dangling link, to a store SQLite would create there
    result = app("--output-dir", run, "--resume", "auto", "--epochs", "2", "--mlflow", "--logging.tensorboard=true")
    assert_refused(result, f"{run / name}: a symbolic link (to {target}) inside the output directory {run}")
    assert contents(target) == before and (target / "something.tmp.abc").exists() == (name == "checkpoints")
    assert (run / name).is_symlink() and epochs_in(run) == [1]


def test_export_never_writes_into_a_planted_export_link(tmp_path, trained, tool):
    run = handed_over(trained, tmp_path)
    shutil.rmtree(run / "export", ignore_errors=True)  # the shared run was exported: the link takes its place
    target = tmp_path / "theirs"
    target.mkdir()
    os.symlink(target, run / "export")
    proc = tool("export", run, "--format", "safetensors")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{run / 'export'}: a symbolic link" in one_error_line(proc.stderr, "hvd-train export")
    assert list(target.iterdir()) == []


def test_the_claim_and_every_writer_refuse_a_link_planted_below_the_directory(tmp_path):
    target = tmp_path / "theirs"
    target.mkdir()
    root = tmp_path / "run"
    (root / "checkpoints").mkdir(parents=True)
    torch.save({}, root / "checkpoints" / "last.pt")
    run_dir = RunDir(str(root))
    for planted in ("export", "profile/rank0.trace.json", "mlflow-artifacts/1/run/artifacts"):
        (root / planted).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, root / planted)
        with run_dir.lock, pytest.raises(CheckpointError, match=f"{root / planted}: a symbolic link"):
            run_dir.acquire("auto", overwrite=False, find_checkpoint=checkpoint.checkpoint_to_resume)
        os.remove(root / planted)
    with run_dir.lock:
        found = run_dir.acquire("auto", overwrite=False, find_checkpoint=checkpoint.checkpoint_to_resume)
        assert found == str(root / "checkpoints" / "last.pt")
    # Planted after the claim: each writer refuses it.
    os.symlink(target, root / "tensorboard")
    with pytest.raises(CheckpointError, match="tensorboard: a symbolic link"):
        Reporter(run_dir, enabled=True, tensorboard=True)
    saver = checkpoint.Checkpointer(run_dir.checkpoints)
    shutil.rmtree(root / "checkpoints")
    os.symlink(target, root / "checkpoints")
    with pytest.raises(CheckpointError, match="checkpoints: a symbolic link"):
        saver.save({"version": checkpoint.VERSION, "epoch": 1}, 1, is_best=True)
    with pytest.raises(CheckpointError, match="checkpoints: a symbolic link"):
        checkpoint.Checkpointer(run_dir.checkpoints)
    with pytest.raises(CheckpointError, match="checkpoints: a symbolic link"):
        atomic_write(str(root / "checkpoints" / "x.json"), lambda f: f.write("{}"), root=str(root))
    with pytest.raises(CheckpointError, match="checkpoints: a symbolic link"):
        append_line(str(root / "checkpoints" / "x.jsonl"), "{}\n", root=str(root))
    assert list(target.iterdir()) == []
    # The output directory itself may be a link: the user's choice.
    os.symlink(root, tmp_path / "latest")
    no_link_below(str(tmp_path / "latest"), str(tmp_path / "latest" / "summary.json"))
    assert RunDir(str(tmp_path / "latest")).export == str(tmp_path / "latest" / "export")


def test_the_names_of_the_directory_are_spelled_in_one_place(tmp_path):
    from hvd_train.run.tracking import local_uri
    from hvd_train.tools.export import default_out

    run_dir = RunDir(str(tmp_path))
    assert local_uri(str(tmp_path)) == "sqlite:///" + run_dir.mlflow_db
    assert default_out(run_dir.last_checkpoint, "onnx") == os.path.join(run_dir.export, "model.onnx")


# --------------------------------------------------------------------------------------------------------------------
# The cleanup of temporary files removes only the app's own


def test_the_start_up_cleanup_removes_only_the_temporary_files_the_app_made(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    left = ["last.pt.tmp.k2j4_6g8", "epoch_0003.pt.tmp.a1b2c3d4", "step_00000120.pt.tmp.zzzzzzzz"]
    theirs = ["notes.tmp.x", "something.tmp.abc", "last.pt.tmp.abc", "mine.pt.tmp.abcdefgh", "last.pt.tmp.ABCDEFGH"]
    for name in left + theirs:
        (folder / name).write_text("half a checkpoint" if name in left else "theirs")
    (folder / "best.pt.tmp.abcdefgh").mkdir()  # a folder of that name: not a file the app made
    os.symlink(victim, folder / "epoch_0001.pt.tmp.abcdefgh")  # a link: removed neither, nor what it points to
    checkpoint.Checkpointer(str(folder))
    assert sorted(os.listdir(folder)) == sorted(theirs + ["best.pt.tmp.abcdefgh", "epoch_0001.pt.tmp.abcdefgh"])
    assert victim.read_text() == "precious"
    # A checkpoints/ link: nothing listed, nothing removed where it points.
    (tmp_path / "run").mkdir()
    os.symlink(folder, tmp_path / "run" / "checkpoints")
    (folder / left[0]).write_text("half a checkpoint of theirs")
    with pytest.raises(CheckpointError, match="a symbolic link"):
        checkpoint.Checkpointer(str(tmp_path / "run" / "checkpoints"))
    assert (folder / left[0]).exists()
