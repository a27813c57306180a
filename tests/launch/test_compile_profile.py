"""--compile and --profile, proven with real 2-rank launches: a compiled model's gradients are still averaged by
Horovod, its checkpoints move between compiled and eager runs (elastic ones too), and a profile holds the training
step's operators and the allreduce in both files."""
import json
import os

import pytest
import torch

from conftest import assert_refused, launch, read_json, run_app
from conftest import elastic_run_losing_a_worker


def train(launcher, np, out, *flags, check=True, env=None):
    return run_app(launcher, np, "--output-dir", out, *flags, check=check, env=env)


@pytest.mark.distributed
def test_a_compiled_step_on_2_ranks_equals_an_eager_step_on_1_rank_with_double_batch(tmp_path, worker):
    batch = 16
    launch("horovodrun-gloo", 2, worker("grad_step.py"), tmp_path / "compiled.pt", batch, "--compile", "--every-rank")
    launch("single", 1, worker("grad_step.py"), tmp_path / "eager.pt", 2 * batch)
    rank0, rank1 = torch.load(tmp_path / "compiled.pt.0"), torch.load(tmp_path / "compiled.pt.1")
    eager = torch.load(tmp_path / "eager.pt")
    assert set(rank0) == set(eager), "a compiled model must save the plain parameter names"
    for name, value in eager.items():
        # The ranks hold exactly the same weights: each applied the same averaged gradient.
        assert torch.equal(rank0[name], rank1[name]), f"{name} differs between the ranks"
        # Compiled kernels sum in another order than eager ones: equal within float32 rounding.
        torch.testing.assert_close(rank0[name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


# The two jobs that compile the default recipe's model on the same shapes run one after the other on one worker:
# the second then finds the first one's kernels in the suite's TorchInductor cache (21 CPU-s against 58 when both
# compiled cold at once, 2 ranks each).
@pytest.mark.distributed
@pytest.mark.xdist_group("compile_default")
@pytest.mark.extended
def test_a_compiled_run_resumes_into_an_eager_one_and_back(tmp_path):
    out = tmp_path / "run"
    proc = train("horovodrun-mpi", 2, out, "--compile", "--epochs", "1")
    assert "torch.compile (mode default)" in proc.stdout
    first = read_json(out / "summary.json")
    assert first["compile"] == "default" and first["params_in_sync"]
    keys = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["model"].keys()
    assert not any("_orig_mod" in k for k in keys), sorted(keys)[:3]

    train("horovodrun-mpi", 2, out, "--resume", "auto", "--epochs", "2", "--compile=false")  # recorded: on
    eager = read_json(out / "summary.json")
    assert eager["compile"] is False and eager["params_in_sync"]
    train("horovodrun-mpi", 2, out, "--resume", "auto", "--epochs", "3", "--compile")
    last = read_json(out / "summary.json")
    assert last["compile"] == "default" and last["params_in_sync"]
    assert [h["epoch"] for h in last["history"]] == [1, 2, 3]
    assert [r["epoch"] for r in last["resumes"]] == [1, 2]
    # Each part went on from the last one's weights: the loss kept falling.
    losses = [h["val_loss"] for h in last["history"]]
    assert losses[2] < losses[1] < losses[0], losses


@pytest.mark.distributed
@pytest.mark.xdist_group("compile_default")
def test_a_compiled_elastic_job_survives_a_lost_worker(tmp_path):
    out = tmp_path / "run"
    elastic_run_losing_a_worker(tmp_path, "--compile", "--output-dir", out)
    summary = read_json(out / "summary.json")
    assert summary["compile"] == "default" and summary["elastic"]["resets"] >= 1
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3]
    keys = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["model"].keys()
    assert not any("_orig_mod" in k for k in keys)


def test_compile_without_a_cpp_compiler_is_refused_before_training(tmp_path, app):
    result = app("--output-dir", tmp_path / "run", "--compile", env={"CXX": "/nonexistent/c++"})
    assert_refused(result, "--compile on the CPU needs a C++ compiler", "/nonexistent/c++")
    assert not (tmp_path / "run").exists()


def _trace_names(path):
    with open(path) as f:
        trace = json.load(f)  # Chrome trace JSON: {"traceEvents": [...]}
    return {event.get("name") for event in trace["traceEvents"]}


@pytest.mark.distributed
def test_profile_on_every_rank_records_the_step_and_the_allreduce(tmp_path):
    out = tmp_path / "run"
    proc = train("horovodrun-mpi", 2, out, "--epochs", "1", "--profile", "--profile-ranks", "all",
                 "--profile-start", "4", "--profile-steps", "2")
    assert "profile of training steps 5-6" in proc.stdout and "ui.perfetto.dev" in proc.stdout
    for rank in (0, 1):
        names = _trace_names(out / "profile" / f"rank{rank}.trace.json")
        assert {"ProfilerStep#4", "ProfilerStep#5"} <= names, sorted(n for n in names if "Step" in str(n))
        assert "ProfilerStep#3" not in names and "ProfilerStep#6" not in names  # exactly the window asked for
        # The step's forward and backward operators, and the wait for Horovod's averaged gradients.
        assert {"aten::conv2d", "aten::convolution_backward", "horovod_synchronize"} <= names
    with open(out / "profile" / "horovod_timeline.json") as f:
        timeline = json.load(f)
    activities = {event.get("name") for event in timeline}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE"} <= activities, activities
    tensors = {event["args"]["name"] for event in timeline if event.get("name") == "process_name"
               and "name" in event.get("args", {})}
    assert any(t.startswith("allreduce.") and t.endswith("features.0.weight") for t in tensors), tensors


@pytest.mark.distributed
def test_profile_on_rank_0_only_and_a_window_past_the_end(tmp_path):
    out = tmp_path / "run"
    train("horovodrun-gloo", 2, out, "--epochs", "1", "--profile", "--profile-steps", "1")
    assert sorted(os.listdir(out / "profile")) == ["horovod_timeline.json", "rank0.trace.json"]
    assert "ProfilerStep#5" in _trace_names(out / "profile" / "rank0.trace.json")

    # The digits' 44 steps per epoch on one process end before step 1001: the run says so and records nothing.
    proc = train("single", 1, tmp_path / "late", "--epochs", "1", "--profile", "--profile-start", "1000")
    assert "before the profiled ones (--profile-start 1000): nothing was recorded" in proc.stdout
    assert not (tmp_path / "late" / "profile").exists()


@pytest.mark.parametrize("flags, message", [
    (["--compile-mode", "max-autotune"], "model.compile_mode (--compile-mode)='max-autotune': has no effect without"),
    (["--compile", "--compile-mode", "fast"], "argument --compile-mode"),
    (["--profile", "--evaluate", "--resume", "auto"], "profile.enabled (--profile)=True: records training steps"),
    (["--profile", "--profile-ranks", "1"], "argument --profile-ranks"),
    (["--profile", "--profile-steps", "0"], "profile.steps (--profile-steps)=0: must be 1 to 1000 steps"),
])
def test_bad_compile_and_profile_settings_get_one_message(tmp_path, app, flags, message):
    assert_refused(app("--output-dir", tmp_path / "run", *flags), message)
    assert not (tmp_path / "run").exists()
