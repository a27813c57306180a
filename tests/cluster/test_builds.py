"""The Horovod builds beyond the CPU one `make setup` installs, compiled for real (cached in ~/.cache/hvd-train, so
only a machine's first run compiles; HVD_CACHE_DIR moves the cache):

- the NCCL build from PyPI's CUDA toolchain on a machine with no GPU, which must list NCCL and still train on CPUs;
- the offline build against a torch that is already installed (a CPU-only torch 2.13.0 in a venv of its own), made
  in a network namespace that has no network at all, then a 2-rank job on it.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, job_env, offline_shell

# One worker builds each variant once (the fixtures are per module, and make test runs files side by side).
pytestmark = [pytest.mark.build, pytest.mark.distributed, pytest.mark.timeout(2400), pytest.mark.xdist_group("builds")]
BUILD = ROOT / "scripts" / "build_horovod.py"


def run(cmd, env=None, timeout=2000, **kw):
    proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env or job_env(), capture_output=True, text=True,
                          timeout=timeout, **kw)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}"
                    f"\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def check_build_lists(report, *names):
    for name in names:
        assert f"[X] {name}" in report, f"{name} missing from horovodrun --check-build:\n{report}"


def train_digits(launcher_cmd, out_dir, env):
    """The default digits run, cut to 3 epochs; returns its summary (the app itself checks the ranks end identical)."""
    run(launcher_cmd + ["train_hvd.py", "--output-dir", out_dir, "--epochs", "3", "--logging.tensorboard=false",
                        "--logging.plot=false"], env=env)
    return json.loads((Path(out_dir) / "summary.json").read_text())


@pytest.fixture(scope="module")
def nccl_build(tmp_path_factory):
    """The NCCL wheel built with PyPI's CUDA toolchain (whatever toolkit the machine has), installed into a folder of
    its own that goes first on PYTHONPATH, so the venv's CPU build stays as it is."""
    proc = run([sys.executable, BUILD, "--gpu", "--cuda-toolkit", "pypi", "--wheel-only"])
    wheel = proc.stdout.strip().splitlines()[-1]
    assert "PyPI's wheels" in proc.stdout and "GPU architectures: sm_75" in proc.stdout, proc.stdout
    target = tmp_path_factory.mktemp("nccl-horovod")
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", target, wheel])
    env = job_env()
    env["PYTHONPATH"] = f"{target}{os.pathsep}{env['PYTHONPATH']}"
    return target, env, json.loads((Path(wheel).parent / "build-info.json").read_text())


def test_nccl_build_from_pypi_toolchain_lists_nccl_and_covers_turing_to_blackwell(nccl_build):
    target, env, info = nccl_build
    report = run([Path(sys.executable).parent / "horovodrun", "--check-build"], env=env).stdout
    check_build_lists(report, "PyTorch", "MPI", "Gloo", "NCCL")
    probe = "import horovod.torch as hvd, sys; print(hvd.__file__); sys.exit(not hvd.nccl_built())"
    assert str(target) in run([sys.executable, "-c", probe], env=env).stdout
    assert info["toolkit_source"] == "pypi" and info["archs"][0] == 75 and 90 in info["archs"], info
    # The library really holds machine code for each architecture, and PTX for the newest (for future GPUs).
    library = next((target / "horovod" / "torch").glob("mpi_lib_v2*.so"))
    cuobjdump = Path(info["toolkit"]) / "bin" / "cuobjdump"
    elf = run([cuobjdump, "--list-elf", library]).stdout
    assert sorted(int(cc) for cc in re.findall(r"\.sm_(\d+)\.cubin", elf)) == info["archs"], elf
    assert f"sm_{info['archs'][-1]}.ptx" in run([cuobjdump, "--list-ptx", library]).stdout


def test_nccl_build_trains_on_cpus_exactly_as_the_cpu_build(nccl_build, tmp_path):
    # On CPU tensors the NCCL build runs the CPU build's operations: the same losses, bit for bit, under either
    # controller (the venv's own CPU build under Gloo is the reference).
    _, env, _ = nccl_build
    runs = [("cpu build", "--gloo", job_env()), ("nccl build", "--gloo", env), ("nccl build", "--mpi", env)]
    losses = {}
    for build, controller, run_env in runs:
        horovodrun = [Path(sys.executable).parent / "horovodrun", "-np", "2", "-H", "localhost:2", controller,
                      sys.executable]
        summary = train_digits(horovodrun, tmp_path / f"{build}{controller}", run_env)
        assert summary["world_size"] == 2 and summary["params_in_sync"], summary
        losses[build, controller] = [h["val_loss"] for h in summary["history"]]
    reference = losses["cpu build", "--gloo"]
    assert len(reference) == 3 and reference[-1] < reference[0], losses  # it learns
    assert all(value == reference for value in losses.values()), losses


TORCH_213 = "torch==2.13.0"


@pytest.fixture(scope="module")
def torch_213_env(tmp_path_factory):
    """A venv with a CPU-only torch 2.13.0 (pip finds it on this machine's disk) and what the app needs, made online;
    the Horovod build into it below is offline."""
    venv = tmp_path_factory.mktemp("torch213") / "venv"
    run([_base_python(), "-m", "venv", venv])
    py = venv / "bin" / "python"
    reqs = {line.split("==")[0]: line.strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    wanted = [reqs[n] for n in ("numpy", "pyyaml", "tqdm", "psutil", "scikit-learn", "cloudpickle", "packaging",
                                "setuptools", "wheel")]
    proc = subprocess.run([py, "-m", "pip", "install", "-q", TORCH_213] + wanted, capture_output=True, text=True)
    if proc.returncode != 0 and "No matching distribution found for torch==2.13.0" in proc.stderr:
        pytest.skip("pip offers no torch 2.13.0 here (this machine's local CPU wheel is missing)")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return py


def _base_python():
    """The interpreter the project venv was made from (a venv of a venv would see the project's packages)."""
    return getattr(sys, "_base_executable", None) or shutil.which("python3")


def test_offline_build_against_an_installed_torch_2_13_then_a_2_rank_job(torch_213_env, tmp_path):
    py = torch_213_env
    torch_file = Path(run([py, "-c", "import torch; print(torch.__file__)"]).stdout.strip())
    before = torch_file.stat().st_mtime_ns
    sdist = run([sys.executable, BUILD, "--print-sdist"]).stdout.strip().splitlines()[-1]   # fetched online
    carried = tmp_path / "horovod-0.28.1.tar.gz"
    shutil.copy(sdist, carried)
    env = job_env()
    env["PATH"] = f"{py.parent}{os.pathsep}/usr/local/bin{os.pathsep}/usr/bin{os.pathsep}/bin"  # no project venv
    env.pop("PYTHONPATH")
    proc = run(offline_shell() + ["bash", ROOT / "scripts" / "install.sh", "--python", py, "--offline",
                                  "--horovod-sdist", carried, "--cpu"], env=env)
    assert "torch 2.13.0" in proc.stdout, proc.stdout
    check_build_lists(proc.stdout, "PyTorch", "MPI", "Gloo")
    assert torch_file.stat().st_mtime_ns == before, "the existing torch was reinstalled"
    assert run([py, "-c", "import torch; print(torch.__version__)"]).stdout.startswith("2.13.0")

    horovodrun = [py.parent / "horovodrun", "-np", "2", "-H", "localhost:2", py]
    summary = train_digits(horovodrun, tmp_path / "run", env)
    assert summary["world_size"] == 2 and summary["params_in_sync"] and summary["final_val_acc1"] >= 50.0, summary
