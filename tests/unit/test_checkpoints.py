"""Checkpoints and the output directory: what is kept, what is refused unread, how a used directory is
continued, replaced or refused."""
import os

import pytest
import torch

from hvd_train.run import checkpoint
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
    (tmp_path / "last.pt.tmp.k2j4x9q0").write_bytes(b"half a checkpoint")
    checkpoint.Checkpointer(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["epoch_0001.pt", "last.pt"]
