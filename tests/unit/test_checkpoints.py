"""Checkpoints and the output directory: what is kept, what is refused unread, how a used directory is
continued, replaced or refused."""
import logging
import os
import re

import pytest
import torch

from hvd_train.run import checkpoint
from hvd_train.run import checkpoint as resume
from hvd_train.run.checkpoint import checkpoint_to_resume
from hvd_train.errors import CheckpointError
from hvd_train.run.directory import RunDir


def payload(epoch):
    return {"version": checkpoint.VERSION, "epoch": epoch, "model": {"w": torch.full((2,), float(epoch))}}


def test_checkpointer_keeps_last_best_and_the_newest_n(tmp_path):
    run_dir = RunDir(str(tmp_path))
    saver = checkpoint.Checkpointer(run_dir.checkpoints, keep_last=2)
    for epoch in range(1, 6):
        saver.save(payload(epoch), epoch, is_best=epoch == 2)
    ckpts = tmp_path / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["best.pt", "epoch_0004.pt", "epoch_0005.pt", "last.pt"]
    assert resume.load(str(ckpts / "last.pt"))["epoch"] == 5
    assert resume.load(str(ckpts / "best.pt"))["epoch"] == 2
    assert resume.checkpoint_to_resume(run_dir, "auto") == str(ckpts / "last.pt")


def test_checkpointer_on_other_ranks_writes_nothing(tmp_path):
    checkpoint.Checkpointer(str(tmp_path / "c"), enabled=False).save(payload(1), 1, is_best=True)
    assert not (tmp_path / "c").exists()


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    torch.manual_seed(3)
    state = checkpoint.rng_state()
    expected = torch.rand(3)
    checkpoint.atomic_save({"version": checkpoint.VERSION, "rng": [state]}, str(tmp_path / "c.pt"))
    torch.manual_seed(99)
    checkpoint.set_rng_state(resume.load(str(tmp_path / "c.pt"))["rng"][0])
    assert torch.equal(torch.rand(3), expected)


def test_every_generator_is_seeded_and_its_state_saved_and_put_back_numpy_s_too(tmp_path):
    import random

    import numpy as np

    checkpoint.seed_generators(7)
    np.random.randn()  # a cached Gaussian: part of NumPy's state
    state = checkpoint.rng_state()
    expected = (torch.rand(2), random.random(), np.random.rand(3), np.random.randn())
    checkpoint.atomic_save({"version": checkpoint.VERSION, "rng": [state]}, str(tmp_path / "c.pt"))
    checkpoint.seed_generators(8)
    assert random.random() != expected[1]
    saved = resume.load(str(tmp_path / "c.pt"))["rng"][0]  # weights_only, through the gate
    assert torch.is_tensor(saved["numpy"]["key"]) and saved["numpy"]["key"].dtype == torch.int64
    checkpoint.set_rng_state(saved)
    drawn = (torch.rand(2), random.random(), np.random.rand(3), np.random.randn())
    assert torch.equal(drawn[0], expected[0]) and drawn[1] == expected[1]
    assert np.array_equal(drawn[2], expected[2]) and drawn[3] == expected[3]

    # A checkpoint written before NumPy's state was saved still loads: NumPy's generator stays as it is.
    older = {k: v for k, v in state.items() if k != "numpy"}
    checkpoint.atomic_save({"version": checkpoint.VERSION, "rng": [older]}, str(tmp_path / "old.pt"))
    checkpoint.seed_generators(8)
    numpy_before = np.random.get_state()[1].copy()
    checkpoint.set_rng_state(resume.load(str(tmp_path / "old.pt"))["rng"][0])
    assert torch.equal(torch.rand(2), expected[0]) and np.array_equal(np.random.get_state()[1], numpy_before)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/hvd-train-pwned",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"version": checkpoint.VERSION, "model": _RunsCode()}, path)
    with pytest.raises(CheckpointError, match="evil.pt"):
        resume.load(str(path))
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
        resume.load(str(path))


def test_resume_paths_that_do_not_exist_are_named_and_auto_may_find_nothing(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        resume.checkpoint_to_resume(RunDir(str(tmp_path)), str(tmp_path / "x.pt"))
    assert resume.checkpoint_to_resume(RunDir(str(tmp_path)), "auto") is None


def make_run(directory):
    saver = checkpoint.Checkpointer(str(directory / "checkpoints"))
    saver.save(payload(1), 1, is_best=True)
    (directory / "summary.json").write_text("{}")
    (directory / "notes.txt").write_text("mine")


def test_a_used_output_directory_is_continued_replaced_or_refused(tmp_path):
    def claim(root, resume, overwrite):
        run_dir = RunDir(str(root))
        with run_dir.lock:
            return run_dir.acquire(resume, overwrite, find_checkpoint=checkpoint_to_resume)

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
        RunDir(str(tmp_path)).acquire("auto", overwrite=False, find_checkpoint=checkpoint_to_resume)


class SavedLines(logging.Handler):
    """Each message of the app's log, with whether the checkpoint it names is in place as it is said."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        message = record.getMessage()
        named = re.search(r"(\S+\.pt)\b", message)
        self.lines.append((message, bool(named) and os.path.isfile(named.group(1))))


@pytest.mark.parametrize("background", [False, True])
def test_a_save_says_where_it_writes_and_saved_only_once_the_file_is_in_place(tmp_path, background):
    said = SavedLines()
    logger = logging.getLogger("hvd_train")
    logger.addHandler(said)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        saver = checkpoint.Checkpointer(str(tmp_path), background=background)
        saver.save(payload(3), 3, is_best=True)
        saver.wait()
        saver.save_step(payload(4), 120)
        saver.wait()
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
    epoch, step = tmp_path / "epoch_0003.pt", tmp_path / "step_00000120.pt"
    saved = [(f"checkpoint epoch 3: saved {epoch} (and last.pt, best.pt)", True),
             (f"checkpoint at step 120: saved {step} (and last.pt)", True)]
    if background:  # said as the write starts (the file not there yet), then once it is renamed into place
        saved = [(f"checkpoint epoch 3: writing {epoch} in the background", False), saved[0],
                 (f"checkpoint at step 120: writing {step} in the background", False), saved[1]]
    assert said.lines == saved


def test_resume_auto_names_a_save_its_writer_never_finished_and_what_it_resumes_from(tmp_path, caplog):
    run_dir = RunDir(str(tmp_path))
    checkpoint.Checkpointer(run_dir.checkpoints).save(payload(1), 1, is_best=False)
    (tmp_path / "checkpoints" / "epoch_0002.pt.tmp.k2j4x9q0").write_bytes(b"half a checkpoint")
    with caplog.at_level(logging.WARNING, logger="hvd_train"):
        assert resume.checkpoint_to_resume(run_dir, "auto") == run_dir.last_checkpoint
    assert [r.getMessage() for r in caplog.records] == [
        "--resume auto: a save was not finished: checkpoints/epoch_0002.pt (its writer stopped before the rename "
        "and left checkpoints/epoch_0002.pt.tmp.k2j4x9q0, which this run removes); resuming from "
        "checkpoints/last.pt instead"]


def test_a_killed_writer_leaves_only_temporary_files_that_the_next_run_removes(tmp_path):
    checkpoint.Checkpointer(str(tmp_path)).save(payload(1), 1, is_best=False)
    (tmp_path / "last.pt.tmp.k2j4x9q0").write_bytes(b"half a checkpoint")
    checkpoint.Checkpointer(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["epoch_0001.pt", "last.pt"]
