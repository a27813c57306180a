"""Horovod's allreduce on MPI through memory the ranks of one node share (scripts/horovod/shm_allreduce.h, called
by scripts/horovod/patches/0023-shm-allreduce.patch), proven on real jobs under mpirun and horovodrun: exact sums
and averages of every type it covers, across its 1 MB blocks, the same bits on every rank and as MPI_Allreduce
gives, MPI_Allreduce kept for the rest and for buffers below HVD_TRAIN_SHM_MIN_BYTES, and HVD_TRAIN_SHM_ALLREDUCE=0
turning it off."""
import json
import subprocess

import pytest
import torch

from conftest import find_mpirun, job_env, launch, launch_command

pytestmark = pytest.mark.distributed

SHARED = ("float32", "float64", "bfloat16", "int32", "int64")
# Every buffer through shared memory however small, where a test checks the path itself (the default keeps small
# buffers on MPI_Allreduce, which is faster there).
EVERY_SIZE = {"HVD_TRAIN_SHM_MIN_BYTES": "0"}


def run_worker(tmp_path, worker, launcher, np, env=None):
    launch(launcher, np, worker("shm_allreduce.py"), tmp_path, env=env)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(np)]
    for rank, report in enumerate(reports):
        assert report["size"] == np and report["wrong"] == [], (rank, report["wrong"])
        assert report["digests"] == reports[0]["digests"], f"rank {rank} holds other bits than rank 0"
    return reports[0]["reduced_by"], reports[0]["digests"]


def through_shared_memory(case):
    """Whether the worker's case is one the shared-memory allreduce covers: a sum or an average of its types."""
    op, dtype = case.split("-")[:2]
    return op in ("sum", "average", "grouped_sum") and dtype in SHARED


def check_paths(reduced_by):
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


def assert_all_on_mpi(reduced_by):
    assert reduced_by and set(map(tuple, reduced_by.values())) == {("MPI_ALLREDUCE",)}, reduced_by


def test_sums_and_averages_go_through_shared_memory_exactly(tmp_path, worker):
    check_paths(run_worker(tmp_path, worker, "mpirun", 2, env=EVERY_SIZE)[0])


def test_buffers_below_the_threshold_keep_to_mpi_allreduce(tmp_path, worker):
    # HVD_TRAIN_SHM_MIN_BYTES=4096: of the cases the shared memory covers, those of 4096 bytes or more take it, the
    # smaller ones MPI_Allreduce; the results are exact and the same bits on every rank either way.
    reduced_by, _ = run_worker(tmp_path, worker, "horovodrun-mpi", 2, env={"HVD_TRAIN_SHM_MIN_BYTES": "4096"})
    ungrouped = [case for case in reduced_by if through_shared_memory(case) and not case.startswith("grouped")]
    assert len(ungrouped) == 40, sorted(reduced_by)
    for case in ungrouped:
        dtype, count = case.split("-")[1:]
        path = "SHM_ALLREDUCE" if int(count) * getattr(torch, dtype).itemsize >= 4096 else "MPI_ALLREDUCE"
        assert reduced_by[case] == [path], (case, reduced_by[case])
    assert {tuple(reduced_by[case]) for case in ungrouped} == {("SHM_ALLREDUCE",), ("MPI_ALLREDUCE",)}


def test_three_ranks_get_the_same_bits_as_mpi_allreduce_gives_them(tmp_path, worker):
    # 3 ranks: segments of uneven length, sums over more than two slots, and averages scaled by 1/3 (rounded), which
    # the shared-memory path scales in cache where Horovod scales the buffer after MPI_Allreduce: the same bits (the
    # worker's sums are exact, so the order of the additions cannot change them).
    (tmp_path / "shm").mkdir()
    (tmp_path / "mpi").mkdir()
    reduced_by, shm_digests = run_worker(tmp_path / "shm", worker, "horovodrun-mpi", 3, env=EVERY_SIZE)
    check_paths(reduced_by)
    reduced_by, mpi_digests = run_worker(tmp_path / "mpi", worker, "horovodrun-mpi", 3,
                                         env={"HVD_TRAIN_SHM_ALLREDUCE": "0"})
    assert_all_on_mpi(reduced_by)  # HVD_TRAIN_SHM_ALLREDUCE=0 keeps every allreduce on MPI
    assert shm_digests == mpi_digests


def test_without_a_usable_dev_shm_every_allreduce_stays_on_mpi(tmp_path, worker):
    # Where /dev/shm cannot hold the allreduce's memory, the ranks agree to keep to MPI_Allreduce and the job goes
    # on. OpenMPI runs where /dev/shm is read-only (some containers have no writable one); MPICH and Intel MPI do
    # not start there at all, so under them /dev/shm is Docker's default 64 MB, filled by another program once MPI
    # has set up: the memory's allocation fails at once (not with SIGBUS at its first write).
    env = job_env()
    if find_mpirun()[1] == "openmpi":
        mount = "mount -t tmpfs -o ro tmpfs /dev/shm"
    else:
        mount, env["HVD_TEST_FILL_DEV_SHM"] = "mount -t tmpfs -o size=64m tmpfs /dev/shm", "1"
    own_dev_shm = ["unshare", "--mount", "sh", "-c", f'{mount} && exec "$@"', "own-shm"]
    cmd = own_dev_shm + launch_command("mpirun", 2, [str(worker("shm_allreduce.py")), str(tmp_path)])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0]["wrong"] == reports[1]["wrong"] == []
    assert_all_on_mpi(reports[0]["reduced_by"])
