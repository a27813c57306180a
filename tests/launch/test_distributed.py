"""Distributed behaviour proven with real 2-rank jobs (horovodrun and mpirun on the CPU), no mocks."""
import pytest
import torch

from conftest import WORKERS, launch, read_json
from workers.uneven_metrics import fixed_samples

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("launcher", ["horovodrun-gloo", pytest.param("mpirun", marks=pytest.mark.extended)])
def test_one_step_on_2_ranks_equals_1_rank_with_double_batch(tmp_path, worker, launcher, grad_steps):
    if launcher == "horovodrun-gloo":
        two_ranks = torch.load(grad_steps[0] / "plain.pt")
    else:
        launch(launcher, 2, worker("grad_step.py"), tmp_path / "np2.pt", 16)
        two_ranks = torch.load(tmp_path / "np2.pt")
    one_rank = torch.load(grad_steps[1] / "plain.pt")  # batch 32
    initial = _initial_params()
    assert any(not torch.equal(value, initial[name]) for name, value in one_rank.items()), "the step did nothing"
    for name, value in one_rank.items():
        torch.testing.assert_close(two_ranks[name], value, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _initial_params():
    from hvd_train.models import build_model

    torch.manual_seed(0)
    return build_model("small_cnn", 1, 10, 8).state_dict()


@pytest.mark.parametrize("launcher", ["horovodrun-mpi", pytest.param("mpirun", marks=pytest.mark.extended)])
def test_ranks_seeded_differently_are_identical_after_initial_broadcast(tmp_path, worker, launcher):
    launch(launcher, 2, worker("broadcast_seeds.py"), tmp_path)
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    weight = "features.0.weight"
    assert not torch.equal(rank0["before"]["params"][weight], rank1["before"]["params"][weight]), \
        "the ranks started equal: the test proves nothing"
    assert not torch.equal(rank0["before"]["momentum"][0], rank1["before"]["momentum"][0])
    for name, value in rank0["after"]["params"].items():
        assert torch.equal(value, rank1["after"]["params"][name]), f"{name} differs after the broadcast"
        assert torch.equal(value, rank0["before"]["params"][name]), f"{name} is not rank 0's value"
    for buf0, buf1, buf0_before in zip(rank0["after"]["momentum"], rank1["after"]["momentum"],
                                       rank0["before"]["momentum"]):
        assert torch.equal(buf0, buf1), "momentum buffers differ after the optimizer state broadcast"
        assert torch.equal(buf0, buf0_before)


UNEVEN = [(7, 2), (7, 8), (3, 1)]


@pytest.fixture(scope="module")
def uneven_results(tmp_path_factory):
    """One 2-rank job evaluates every case of UNEVEN (xdist_group keeps its readers on one worker)."""
    out = tmp_path_factory.mktemp("uneven")
    launch("horovodrun-gloo", 2, WORKERS / "uneven_metrics.py", out, *(f"{n}:{b}" for n, b in UNEVEN))
    return out


@pytest.mark.xdist_group("uneven")
@pytest.mark.parametrize("num_samples,batch", UNEVEN)
def test_validation_metrics_are_exact_when_shards_are_uneven(uneven_results, num_samples, batch):
    logits, labels = fixed_samples(num_samples)
    expected_loss = torch.nn.functional.cross_entropy(logits.double(), labels).item()
    expected_acc1 = 100.0 * ((num_samples + 1) // 2) / num_samples
    results = [read_json(uneven_results / f"{num_samples}-{batch}-rank{r}.json") for r in range(2)]
    assert [r["local_count"] for r in results] == [(num_samples + 1) // 2, num_samples // 2]
    for result in results:
        assert result["count"] == num_samples, "a sample was counted twice or not at all"
        assert result["acc1"] == pytest.approx(expected_acc1, abs=1e-9)
        assert result["loss"] == pytest.approx(expected_loss, rel=1e-5)


@pytest.mark.parametrize("launcher", [pytest.param("horovodrun-gloo", marks=pytest.mark.extended), "mpirun"])
def test_every_rank_ends_training_with_identical_parameters(tmp_path, worker, launcher):
    launch(launcher, 2, worker("fit_sync.py"), tmp_path)
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), f"{name} differs between the ranks after training"


def test_horovod_starts_again_after_shutdown_under_gloo_every_time(tmp_path):
    # hvd.init() after hvd.shutdown() rendezvoused under the first init's keys, which horovodrun's store still held:
    # a rank that read its peer's old address connected to a closed port and Gloo's exception aborted it (SIGABRT,
    # "connect ... Connection refused"), within the first 50 cycles in every run before the build's patch.
    out = tmp_path / "cycles.json"
    launch("horovodrun-gloo", 2, WORKERS / "reinit_cycles.py", out, 150)
    assert read_json(out) == {"cycles": 150, "sum": [2.0] * 4}
