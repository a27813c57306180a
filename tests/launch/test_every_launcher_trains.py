"""train_hvd.py as users launch it: 2 ranks under horovodrun (Gloo and MPI) and mpirun, and one plain process."""
import pytest

from conftest import TRAIN, launch, read_json


LAUNCHERS = ("horovodrun-gloo", "horovodrun-mpi", "mpirun")


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
    """The default digits run (15 epochs, 2 ranks) under each launcher, trained once for the tests that read them
    (xdist_group keeps those tests on one worker): launcher -> (the job's output, its run directory)."""
    root = tmp_path_factory.mktemp("default_runs")
    runs = {}
    for launcher in LAUNCHERS:
        out = root / launcher
        # The first as on a new machine, as `make demo` runs there: matplotlib without its font cache.
        fresh = {"MPLCONFIGDIR": str(tmp_path_factory.mktemp("matplotlib"))} if launcher == LAUNCHERS[0] else None
        runs[launcher] = (launch(launcher, 2, TRAIN, "--output-dir", out, env=fresh).stdout, out)
    return runs


@pytest.mark.distributed
@pytest.mark.xdist_group("default_runs")
@pytest.mark.parametrize("launcher,controller", list(zip(LAUNCHERS, ("Gloo", "MPI", "MPI"))))
def test_two_ranks_reach_the_accuracy_bar_on_the_digits(default_runs, launcher, controller):
    stdout, out = default_runs[launcher]
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2
    assert summary["controller"] == controller
    assert summary["epochs"] == 15 and len(summary["history"]) == 15
    assert summary["global_batch_size"] == 2 * summary["batch_size_per_rank"]
    assert summary["lr"] == pytest.approx(2 * summary["base_lr"])
    assert summary["best_val_acc1"] >= 97.0
    assert summary["final_val_acc1"] >= 97.0
    assert summary["params_in_sync"] is True and len(summary["params_fingerprints"]) == 2
    assert summary["train_samples_per_sec"] > 0 and summary["wall_seconds"] > 0
    # Every validation sample is counted once per epoch, whatever the sharding.
    assert {h["val_count"] for h in summary["history"]} == {359}
    # Only rank 0 reports: one line per epoch in the whole job's output.
    assert stdout.count("epoch 15/15") == 1
    assert read_json(out / "config.json")["run"]["output_dir"] == str(out)


@pytest.mark.distributed
@pytest.mark.xdist_group("default_runs")
@pytest.mark.parametrize("launcher,cycle", list(zip(LAUNCHERS, ("10 ms", "1 ms", "1 ms"))))
def test_each_controller_s_tuning_is_logged(default_runs, launcher, cycle):
    # On CPUs: Gloo's default cycle time, and MPI's under either launcher (tests/launch/test_benchmark.py has a
    # process alone and horovodrun's flags).
    stdout, _ = default_runs[launcher]
    assert f"fusion 8 MB, cycle {cycle}" in stdout, stdout[:2000]


@pytest.mark.distributed
@pytest.mark.xdist_group("default_runs")
def test_a_run_on_a_new_machine_prints_only_the_apps_lines(default_runs):
    # matplotlib builds its font cache on its first import and logs "generated new fontManager" at INFO: among
    # the epoch lines, the README's demo output would not be what it shows.
    stdout, out = default_runs[LAUNCHERS[0]]
    assert "fontManager" not in stdout and (out / "curves.png").is_file(), stdout[-3000:]


@pytest.mark.distributed
def test_a_plain_single_process_trains(tmp_path):
    launch("single", 1, TRAIN, "--output-dir", tmp_path, "--epochs", "3")
    summary = read_json(tmp_path / "summary.json")
    assert summary["world_size"] == 1 and summary["epochs"] == 3
    assert summary["lr"] == summary["base_lr"]
    assert summary["best_val_acc1"] > 50.0


@pytest.mark.distributed
@pytest.mark.xdist_group("default_runs")
def test_same_seed_gives_the_same_result_under_gloo_and_mpi(default_runs):
    # Bitwise: every step's averaged gradients are the same sums, whichever controller carried them.
    results = [read_json(out / "summary.json") for _, out in default_runs.values()]
    for other in results[1:]:
        assert other["params_fingerprints"] == results[0]["params_fingerprints"]
        assert [h["val_loss"] for h in other["history"]] == [h["val_loss"] for h in results[0]["history"]]
