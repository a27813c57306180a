"""Horovod options proven on real 2-rank jobs: accumulation, fp16 and bf16 compression, Adasum, predivide, BatchNorm
statistics, and the one-download-per-host helper."""
import pytest
import torch

from conftest import check_wire_formats, launch, read_json

pytestmark = pytest.mark.distributed


def initial_and_grads(batch, ranks):
    """The worker's starting model and each rank's gradient, computed here in one process."""
    from hvd_train.data.catalog import load_digits_dataset
    from hvd_train.models import build_model

    digits = load_digits_dataset()
    torch.manual_seed(0)
    model = build_model("small_cnn", 1, 10, 8).eval()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    grads = []
    for rank in range(ranks):
        idx = range(rank * batch, (rank + 1) * batch)
        images = torch.stack([digits[i][0] for i in idx])
        labels = torch.stack([digits[i][1] for i in idx])
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return initial, grads


def test_accumulating_two_half_batches_equals_one_full_batch(grad_steps):
    two_ranks, _ = grad_steps
    accumulated, single = torch.load(two_ranks / "accumulate-2.pt"), torch.load(two_ranks / "plain.pt")
    for name in single:
        torch.testing.assert_close(accumulated[name], single[name], rtol=0, atol=1e-6)


def test_fp16_allreduce_compresses_the_gradients(grad_steps):
    two_ranks, _ = grad_steps
    fp16, fp32 = torch.load(two_ranks / "fp16-allreduce.pt"), torch.load(two_ranks / "plain.pt")
    difference = max((fp16[n] - fp32[n]).abs().max().item() for n in fp32)
    assert 0 < difference < 1e-3, "fp16 compression should round the gradients, and only a little"


@pytest.mark.parametrize("launcher,np", [("horovodrun-gloo", 2), ("mpirun", 3)])
def test_a_gradient_that_overflows_fp16_allreduce_survives_bf16_allreduce(tmp_path, worker, launcher, np):
    # Rank r's gradient is (r + 1) x [1e5, 1.001, 1e-3, -2.5] (and twice that): Gloo's bfloat16 sum on 2 ranks,
    # MPI's custom reduction on 3 (a ring of partial sums, and an average's 1/3).
    launch(launcher, np, worker("wire_formats.py"), tmp_path / "grads.pt")
    check_wire_formats(torch.load(tmp_path / "grads.pt"), np)


def test_adasum_combines_the_two_gradients_by_the_adasum_rule(tmp_path, worker):
    launch("mpirun", 2, worker("grad_step.py"), tmp_path / "adasum.pt", 16, "--adasum")
    result = torch.load(tmp_path / "adasum.pt")
    initial, (g0, g1) = initial_and_grads(16, 2)
    for name in g0:
        a, b = g0[name].double(), g1[name].double()
        dot = (a * b).sum()
        combined = (1 - dot / (2 * (a * a).sum())) * a + (1 - dot / (2 * (b * b).sum())) * b
        expected = initial[name].double() - 0.5 * combined
        torch.testing.assert_close(result[name].double(), expected, rtol=1e-4, atol=1e-5, msg=name)


def test_gradient_predivide_factor_keeps_the_average(grad_steps):
    result = torch.load(grad_steps[0] / "predivide-2.pt")
    initial, (g0, g1) = initial_and_grads(16, 2)
    for name in g0:
        torch.testing.assert_close(result[name], initial[name] - 0.5 * (g0[name] + g1[name]) / 2, rtol=0,
                                   atol=1e-6)


@pytest.mark.parametrize("average", [True, False])
def test_batch_norm_statistics_are_averaged_over_the_ranks(tmp_path, worker, average):
    launch("horovodrun-gloo", 2, worker("syncbn_stats.py"), tmp_path, *(["--average"] if average else []))
    # Rank r's inputs are all r + 1: the mean over both ranks is 1.5, each rank's own mean is r + 1.
    for rank in range(2):
        expected = 1.5 if average else rank + 1.0
        assert torch.allclose(torch.load(tmp_path / f"rank{rank}.pt")["running_mean"], torch.full((2,), expected))


def test_sync_bn_replaces_every_batch_norm_and_keeps_its_state():
    import horovod.torch as hvd

    from hvd_utils import sync_batch_norm
    from hvd_train.models import build_model

    model = build_model("resnet18", 3, 10, 32)
    model.bn1.running_mean.fill_(0.25)
    converted = sync_batch_norm(model)
    kinds = {type(m).__name__ for m in converted.modules()}
    assert "BatchNorm2d" not in kinds and "SyncBatchNorm" in kinds
    assert isinstance(converted.bn1, hvd.SyncBatchNorm) and torch.all(converted.bn1.running_mean == 0.25)


def test_only_local_rank_0_downloads_and_the_others_wait(tmp_path, worker):
    launch("mpirun", 2, worker("local_root.py"), tmp_path)
    assert (tmp_path / "downloads.txt").read_text() == "rank 0\n"
    assert [read_json(tmp_path / f"rank{r}.json") for r in range(2)] == [{"saw_file": True}] * 2


def test_a_failed_download_stops_every_rank_with_its_cause_instead_of_hanging(tmp_path, worker):
    proc = launch("horovodrun-gloo", 2, worker("local_root.py"), tmp_path, "--fail", check=False)
    assert proc.returncode != 0
    # Rank 1 waited on rank 0's download (one host): it stops with the same error, not "failed on another host".
    assert [read_json(tmp_path / f"rank{r}.json") for r in range(2)] == [{"error": "the mirror is unreachable"}] * 2


def test_a_rank_waiting_for_a_late_peer_sleeps_instead_of_spinning(tmp_path, worker):
    # Horovod's own wait spun on sched_yield(), a core per waiting rank taken from the ranks still computing (the
    # build's WaitAndClear patch). Sleeping, rank 0 uses a small share of a core: Horovod's background cycle.
    launch("horovodrun-gloo", 2, worker("late_peer.py"), tmp_path / "wait.json", 3)
    got = read_json(tmp_path / "wait.json")
    assert got["waited"] >= 2.5, got  # it did wait for rank 1
    assert got["cpu"] < 0.25 * got["waited"], got
