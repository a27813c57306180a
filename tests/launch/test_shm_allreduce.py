"""Horovod's allreduce on MPI through memory the ranks of one node share (scripts/shm_allreduce.h, patched into
Horovod by scripts/build_horovod.py), proven on real jobs under mpirun and horovodrun: exact sums and averages of
every type it covers, across its 1 MB blocks, the same bits on every rank, MPI_Allreduce kept for the rest, and
HVD_TRAIN_SHM_ALLREDUCE=0 turning it off."""
import json

import pytest

from conftest import launch

pytestmark = pytest.mark.distributed

SHARED = ("float32", "float64", "bfloat16", "int32", "int64")


def run_worker(tmp_path, worker, launcher, np, env=None):
    launch(launcher, np, worker("shm_allreduce.py"), tmp_path, env=env)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(np)]
    for rank, report in enumerate(reports):
        assert report["size"] == np and report["wrong"] == [], (rank, report["wrong"])
        assert report["digests"] == reports[0]["digests"], f"rank {rank} holds other bits than rank 0"
    return reports[0]["reduced_by"]


def through_shared_memory(case):
    """Whether the worker's case is one the shared-memory allreduce covers: a sum or an average of its types."""
    op, dtype = case.split("-")[:2]
    return op in ("sum", "average", "grouped_sum") and dtype in SHARED


@pytest.mark.parametrize("launcher, np", [("mpirun", 2), ("horovodrun-mpi", 3)])
def test_sums_and_averages_go_through_shared_memory_exactly(tmp_path, worker, launcher, np):
    # 3 ranks: segments of uneven length and the sum over more than two slots.
    reduced_by = run_worker(tmp_path, worker, launcher, np)
    shared = [case for case in reduced_by if through_shared_memory(case)]
    # 5 sizes of 3 float types (sum and average) and 2 integer types (sum), and the grouped tensors.
    assert len([c for c in shared if not c.startswith("grouped")]) == 40, sorted(reduced_by)
    assert any(c.startswith("grouped_sum") for c in shared), sorted(reduced_by)
    for case in shared:
        assert reduced_by[case] == ["SHM_ALLREDUCE"], (case, reduced_by[case])
    # float16 (no shared-memory sum), Min and Max: MPI's own allreduce.
    kept = [case for case in reduced_by if case not in shared]
    assert len(kept) == 5 * 2 + 2, sorted(kept)
    for case in kept:
        assert reduced_by[case] == ["MPI_ALLREDUCE"], (case, reduced_by[case])


def test_hvd_train_shm_allreduce_0_keeps_every_allreduce_on_mpi(tmp_path, worker):
    reduced_by = run_worker(tmp_path, worker, "horovodrun-mpi", 2, env={"HVD_TRAIN_SHM_ALLREDUCE": "0"})
    assert reduced_by and set(map(tuple, reduced_by.values())) == {("MPI_ALLREDUCE",)}, reduced_by
