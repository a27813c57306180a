"""scripts/gpu_check.sh on a machine without a GPU: it stops at its first step, says why, builds nothing; bad
arguments get one message and exit code 2. (Its later steps are tested piece by piece: the offline build in
test_builds.py, the gpu tests' clean skip here, the benchmark pipeline in test_benchmark.py.)"""
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, job_env

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
NO_GPU = shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode != 0


def gpu_check(*args):
    return subprocess.run(["bash", SCRIPT, *map(str, args)], cwd=ROOT, env=job_env(), capture_output=True, text=True,
                          timeout=300)


@pytest.mark.no_gpu
@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU: the script would really run")
def test_without_a_gpu_it_stops_at_the_first_step_and_builds_nothing(tmp_path):
    sdist = tmp_path / "horovod-0.28.1.tar.gz"
    sdist.write_bytes(b"never read: the GPU check comes first")
    proc = gpu_check("--horovod-sdist", sdist, "--python", sys.executable, "--out", tmp_path / "out")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "FAIL  GPU visible" in log and "not a GPU machine" in log
    assert "install.sh" not in log and "PASS" not in log


@pytest.mark.parametrize("args, message", [
    ((), "--horovod-sdist FILE is required"),
    (("--horovod-sdist", "/nonexistent/horovod-0.28.1.tar.gz"), "no such file"),
    (("--horovod-sdist", SCRIPT, "--rounds", "0"), "--rounds must be a positive whole number"),
    (("--horovod-sdist", SCRIPT, "--python", "no-such-python"), "no interpreter 'no-such-python'"),
    (("--frobnicate",), "unknown option '--frobnicate'"),
])
def test_bad_arguments_get_one_message_and_exit_2(args, message):
    proc = gpu_check(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_lists_every_step():
    out = gpu_check("--help").stdout
    for words in ("GPU is visible", "--offline --gpu", "check-build", "pytest -m gpu", "docs/benchmarks.md"):
        assert words in out


@pytest.mark.no_gpu
def test_gpu_marked_tests_skip_cleanly_without_a_gpu():
    if not NO_GPU:
        pytest.skip("this machine has a GPU: the gpu tests run for real")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-p",
                           "no:xdist", "-rs", "tests"], cwd=ROOT, env=job_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " skipped" in proc.stdout and "passed" not in proc.stdout and "failed" not in proc.stdout, proc.stdout
