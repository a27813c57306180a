"""Deployment files: the Dockerfiles pass hadolint, every build step they run is one the tests run too, and the
SLURM script and Kubernetes manifest are well formed."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import BIN, ROOT, job_env

DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))


def run_steps(dockerfile):
    """The shell commands of every RUN instruction, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    return [line[4:].strip() for line in text.splitlines() if line.startswith("RUN ")]


def installer_calls(dockerfile):
    calls = []
    for step in run_steps(dockerfile):
        for command in step.split("&&"):
            words = shlex.split(command)
            if "scripts/install.sh" in words:
                calls.append(words[words.index("scripts/install.sh") + 1:])
    return calls


def test_there_is_a_gpu_and_a_cpu_image():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.gpu"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(dockerfile):
    proc = subprocess.run([str(BIN / "hadolint"), "--config", str(ROOT / ".hadolint.yaml"), str(dockerfile)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_build_horovod_only_through_the_installer_and_run_as_a_user(dockerfile):
    steps = run_steps(dockerfile)
    deps, full = installer_calls(dockerfile)
    # torch and Horovod in a layer of their own before the source is copied, then the app: the same installer.
    assert deps == full + ["--deps-only"], "the two installer runs differ in more than --deps-only"
    for step in steps:
        assert "pip install" not in step and "horovod" not in step.lower(), f"a build step beside the installer: {step}"
    text = dockerfile.read_text()
    assert re.search(r"^USER 1000:1000$", text, re.M), "training must not run as root"
    assert not re.search(r"ssh-keygen|id_rsa|id_ed25519|authorized_keys.*COPY", text), "no keys in the image"


def test_the_cpu_image_installer_step_is_run_by_the_tests(tmp_path):
    flags = installer_calls(ROOT / "docker" / "Dockerfile.cpu")[-1]
    venv = Path(sys.executable).parent.parent
    flags = [str(venv) if flag == "/opt/hvd-train/.venv" else flag for flag in flags]
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), *flags], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[X] PyTorch" in proc.stdout and "[X] MPI" in proc.stdout and "[X] Gloo" in proc.stdout


def test_the_installer_stops_before_the_venv_when_the_disk_is_short(tmp_path):
    # A first install needs about 10 GiB (torch's wheel brings its CUDA libraries); running out half-way in pip
    # left a broken venv and a pip error far from the cause. Asking for more than any disk has stands in for a
    # full disk here.
    env = job_env()
    env["HVD_INSTALL_NEEDS_GB"] = "1000000"
    venv = tmp_path / "venv"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--venv", str(venv), "--no-apt"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "not enough disk space" in proc.stderr and "1000000 GiB" in proc.stderr and "--venv" in proc.stderr
    assert not venv.exists(), "nothing may be created before the check"


def test_the_gpu_image_installer_flags_are_the_installers_own():
    flags = installer_calls(ROOT / "docker" / "Dockerfile.gpu")[-1]
    usage = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--help"], capture_output=True, text=True,
                           timeout=30).stdout
    for flag in (f for f in flags if f.startswith("--")):
        assert flag in usage, f"{flag} is not an install.sh option"
    assert "--gpu" in flags


def test_a_gpu_build_pointed_at_a_missing_cuda_toolkit_stops_before_downloading(tmp_path):
    env = job_env()
    env["CUDA_HOME"] = str(tmp_path / "no-cuda")
    env["HVD_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_horovod.py"), "--gpu"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"CUDA_HOME={tmp_path / 'no-cuda'} is not a complete CUDA toolkit" in proc.stderr, proc.stderr
    assert "downloading" not in proc.stdout and not (tmp_path / "cache").exists()


def test_slurm_script_is_valid_bash_that_launches_train_hvd_per_gpu():
    script = ROOT / "hostfiles" / "slurm_train.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    text = script.read_text()
    assert "#SBATCH --gpus-per-node" in text and "hostfiles/generate.py slurm" in text
    assert "mpirun" in text and "train_hvd.py" in text and "--resume auto" in text


def test_kubernetes_manifest_is_an_mpijob_on_the_gpu_image():
    job = yaml.safe_load((ROOT / "docker" / "mpijob.yaml").read_text())
    assert job["kind"] == "MPIJob" and job["apiVersion"].startswith("kubeflow.org/")
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    worker = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert launcher["image"] == worker["image"] == "hvd-train:gpu"
    assert "/opt/hvd-train/train_hvd.py" in launcher["command"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == job["spec"]["slotsPerWorker"]
    assert (ROOT / worker["command"][0].replace("/opt/hvd-train/", "")).is_file()


@pytest.mark.parametrize("args", [["--mpi", "openmpi4"], ["--mpi"]], ids=["unknown", "missing"])
def test_an_mpi_the_installer_does_not_know_is_refused_before_anything_is_made(tmp_path, args):
    venv = tmp_path / "venv"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--venv", str(venv), *args], cwd=ROOT,
                          env=job_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and proc.stderr.count("error:") == 1, proc.stderr
    assert "system" in proc.stderr and "openmpi" in proc.stderr and "mpich" in proc.stderr, proc.stderr
    assert not venv.exists()
