"""CPU threads per rank follow the CPUs a process may really use: its affinity and its container's CPU quota."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, job_env, read_json
from hvd_utils.runtime import cgroup_cpu_limit, usable_cpus


def cgroup(tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize("files, cpus", [
    ({"cpu.max": "100000 100000\n"}, 1),                         # docker run --cpus 1 (cgroup v2)
    ({"cpu.max": "150000 100000\n"}, 2),                         # --cpus 1.5: two threads can use it
    ({"cpu.max": "50000 100000\n"}, 1),                          # never fewer than one
    ({"cpu.max": "max 100000\n"}, None),                         # no quota
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2),   # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),    # v1, no quota
    ({}, None),                                                  # no cgroup files at all
])
def test_cgroup_cpu_quota_is_read_for_v1_and_v2(tmp_path, files, cpus):
    assert cgroup_cpu_limit(cgroup(tmp_path, files)) == cpus


def test_usable_cpus_never_exceed_the_affinity():
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or shutil.which("taskset") is None,
                    reason="needs taskset and at least 2 CPUs to pin a process to fewer")
def test_a_process_pinned_to_one_cpu_trains_with_one_thread(tmp_path):
    env = job_env()
    env.pop("OMP_NUM_THREADS", None)
    subprocess.run(["taskset", "-c", "0", sys.executable, "train_hvd.py", "--epochs", "1", "--output-dir", tmp_path,
                    "--logging.progress=false", "--logging.tensorboard=false", "--logging.plot=false"],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    assert read_json(tmp_path / "summary.json")["threads_per_rank"] == 1
