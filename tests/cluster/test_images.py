"""The Docker images, for real (`make test-images`; marked `images`, not part of `make test`): both are built by a
real Docker engine with BuildKit, then train inside one container and across two, with MPI, Gloo and mpirun,
elastically through a `docker kill` and a container that joins.

Needs a running Docker engine (Debian: apt-get install docker.io, then dockerd as root). Where no registry can be
reached, the base image is made from Debian packages by docker/base-image.sh (root and debootstrap) and kept as
hvd-train-base:bookworm for later runs; everything else the tests make (images, containers, a network) is removed,
also when a test fails.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from conftest import ROOT, read_json, wait_for

pytestmark = [pytest.mark.images, pytest.mark.timeout(3600)]

BASE = "python:3.11-slim-bookworm"
STAND_IN = "hvd-train-base:bookworm"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
RUN_ID = uuid.uuid4().hex[:8]
# OpenMPI's complaints inside containers: the refused single-copy mechanism, and any banner of its warnings.
OPENMPI_NOISE = ("Read -1, expected", "single-copy", "process_vm_readv",
                 "--------------------------------------------------------------------------")


def docker(*args, timeout=600, check=True, **kw):
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        pytest.fail(f"docker {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="session")
def engine():
    if shutil.which("docker") is None:
        pytest.fail("no docker command: apt-get install docker.io, start dockerd, then make test-images")
    if docker("info", timeout=60, check=False).returncode != 0:
        pytest.fail("the Docker engine does not answer: start it (dockerd as root), then make test-images")


@pytest.fixture(scope="session")
def base_image(engine):
    """The real base image where it is here or can be pulled; else one made from Debian packages (kept)."""
    if docker("image", "inspect", BASE, check=False).returncode == 0:
        return BASE
    try:
        if docker("pull", BASE, timeout=180, check=False).returncode == 0:
            return BASE
    except subprocess.TimeoutExpired:
        pass
    proc = subprocess.run(["bash", str(ROOT / "docker" / "base-image.sh"), STAND_IN], capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, f"could not make the base image: {proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return STAND_IN


def build(variant, base):
    tag = f"hvd-train-test:{variant}-{RUN_ID}"
    cmd = ["bash", str(ROOT / "docker" / "build.sh"), variant, "--tag", tag, "--base", base]
    if os.path.exists(CA_BUNDLE):
        cmd += ["--ca-bundle", os.environ.get("HVD_CA_BUNDLE", CA_BUNDLE)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    print(f"\nbuilt {tag} in {time.monotonic() - start:.0f} s")  # -s shows it: the cold and warm build times
    return tag


@pytest.fixture(scope="session")
def cpu_image(base_image):
    tag = build("cpu", base_image)
    yield tag
    docker("rmi", "-f", tag, check=False)


@pytest.fixture(scope="session")
def gpu_image(base_image):
    tag = build("gpu", base_image)
    yield tag
    docker("rmi", "-f", tag, check=False)


def check_build(image):
    return docker("run", "--rm", image).stdout


def test_the_cpu_image_has_pytorch_mpi_and_gloo(cpu_image):
    report = check_build(cpu_image)
    assert all(f"[X] {x}" in report for x in ("PyTorch", "MPI", "Gloo")) and "[ ] NCCL" in report, report


def writable_dir(path):
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, 1000, 1000)  # the images train as uid 1000
    return path


def assert_quiet(output):
    noise = [line for line in output.splitlines() if any(n in line for n in OPENMPI_NOISE)]
    assert not noise, "OpenMPI complained inside the container:\n" + "\n".join(noise[:10])


def test_two_ranks_train_the_digits_inside_the_cpu_image_as_a_user(cpu_image, tmp_path):
    out = writable_dir(tmp_path / "out")
    proc = docker("run", "--rm", "-v", f"{out}:/out", cpu_image, "horovodrun", "-np", "2", "-H", "localhost:2",
                  "python", "train_hvd.py", "--output-dir", "/out/run", "--logging.progress=false", timeout=900)
    assert_quiet(proc.stdout + proc.stderr)
    summary = read_json(out / "run" / "summary.json")
    assert summary["world_size"] == 2 and summary["params_in_sync"]
    assert summary["best_val_acc1"] >= 97.0, summary["history"][-1]
    assert (out / "run" / "checkpoints").stat().st_uid == 1000


@pytest.fixture
def containers(cpu_image, tmp_path):
    """Starts containers of the CPU image (a, b, launcher) on demand: a network of their own, one CPU each, sshd on
    12345, a key pair mounted at run time, and a shared folder (the elastic host list, the run's output)."""
    keys = writable_dir(tmp_path / "keys")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "id_ed25519")], check=True)
    shutil.copy(keys / "id_ed25519.pub", keys / "authorized_keys")
    for f in keys.iterdir():
        os.chown(f, 1000, 1000)
        f.chmod(0o600)
    keys.chmod(0o700)
    shared = writable_dir(tmp_path / "shared")
    network = f"hvd-test-{RUN_ID}-{uuid.uuid4().hex[:4]}"
    names = {host: f"{network}-{host}" for host in ("a", "b", "launcher")}
    docker("network", "create", network)
    started = []

    def start(host):
        docker("run", "-d", "--name", names[host], "--hostname", host, "--network", network, "--network-alias", host,
               "--cpus", "1", "--user", "root", "-v", f"{keys}:/home/hvd/.ssh:ro", "-v", f"{shared}:/shared",
               cpu_image, "/opt/hvd-train/docker/start-sshd.sh")
        started.append(names[host])
        probes = []

        def sshd_answers():  # as the training user
            probes.append(docker("exec", "-u", "1000", names[host], "ssh", host, "true", check=False, timeout=60))
            return probes[-1].returncode == 0

        wait_for(sshd_answers, lambda: f"sshd in container {host} to answer: {probes[-1].stderr}", seconds=120)

    try:
        yield names, shared, start
    finally:
        for name in started:
            docker("rm", "-f", name, check=False)
        docker("network", "rm", network, check=False)


@pytest.fixture
def two_containers(containers):
    names, shared, start = containers
    start("a")
    start("b")
    return names, shared


def exec_in(container, *cmd, timeout=900, env=()):
    args = ["exec", "-u", "1000"] + [f"--env={e}" for e in env] + [container, *cmd]
    return docker(*args, timeout=timeout)


def check_across_containers(summary, controller):
    assert summary["world_size"] == 2 and summary["local_size"] == 1 and summary["controller"] == controller
    assert summary["params_in_sync"] and len(summary["params_fingerprints"]) == 2
    assert summary["threads_per_rank"] == 1, "--cpus 1: each rank takes one thread"


TRAIN = ["python", "train_hvd.py", "--epochs", "2", "--logging.progress=false"]


@pytest.mark.parametrize("controller", ["MPI", "Gloo"])
def test_horovodrun_across_two_containers(two_containers, controller):
    names, shared = two_containers
    flag = "--mpi" if controller == "MPI" else "--gloo"
    proc = exec_in(names["a"], "horovodrun", "-np", "2", "-H", "a:1,b:1", flag, *TRAIN, "--output-dir", "/shared/run")
    assert_quiet(proc.stdout + proc.stderr)
    check_across_containers(read_json(shared / "run" / "summary.json"), controller)


def test_mpirun_across_two_containers(two_containers):
    names, shared = two_containers
    proc = exec_in(names["a"], "mpirun", "-np", "2", "-H", "a:1,b:1", "--bind-to", "none", "-x", "PATH", *TRAIN,
                   "--output-dir", "/shared/run")
    assert_quiet(proc.stdout + proc.stderr)
    check_across_containers(read_json(shared / "run" / "summary.json"), "MPI")


def elastic_job(container, np, epochs, discovery="hostfiles/discover_hosts.py"):
    cmd = ["docker", "exec", "-u", "1000", "--env=HVD_HOSTS_FILE=/shared/hosts.txt", container, "horovodrun",
           "-np", str(np), "--min-np", "1", "--max-np", "2", "--host-discovery-script", discovery,
           "--network-interface", "eth0",  # else Horovod waits for two hosts to compare their interfaces
           "python", "train_hvd.py", "--elastic", "--epochs", str(epochs), "--horovod.commit_every", "5",
           "--output-dir", "/shared/run", "--logging.progress=false", "--logging.tensorboard=false"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def follow(job, when, action, seconds=900):
    """Reads the job's output to its end; runs `action` once, at the first line containing `when`."""
    lines, done = [], False
    deadline = time.monotonic() + seconds
    try:
        for line in job.stdout:
            lines.append(line)
            if not done and when in line:
                action()
                done = True
            assert time.monotonic() < deadline, "the elastic job did not finish in time:\n" + "".join(lines[-50:])
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    output = "".join(lines)
    assert done, f"never saw {when!r}:\n{output[-3000:]}"
    assert job.returncode == 0, output[-3000:]
    return output


def test_an_elastic_job_survives_docker_kill_of_one_container(two_containers):
    names, shared = two_containers
    (shared / "hosts.txt").write_text("a:1\nb:1\n")
    job = elastic_job(names["a"], np=2, epochs=8)
    output = follow(job, "epoch 1/8", lambda: docker("kill", names["b"]))
    assert "workers changed: now 1" in output
    summary = read_json(shared / "run" / "summary.json")
    assert summary["world_size"] == 1 and summary["elastic"]["resets"] >= 1
    assert summary["elastic"]["steps_redone"] <= 5
    assert [h["epoch"] for h in summary["history"]] == list(range(1, 9))
    assert summary["best_val_acc1"] >= 97.0


# The project's discovery script, also leaving what it last told Horovod where the test can read it.
RECORDING_DISCOVERY = """#!/bin/sh
python /opt/hvd-train/hostfiles/discover_hosts.py > /shared/discovered.new || exit 1
mv -f /shared/discovered.new /shared/discovered && cat /shared/discovered
"""


def training_pids(container):
    """Host PIDs of the training processes in `container` (not horovodrun, not a shell or ssh around them)."""
    rows = [line.split(None, 1) for line in docker("top", container, "-eo", "pid,args").stdout.splitlines()[1:]]
    wrappers = ("sh ", "/bin/sh", "bash", "ssh")
    return [int(pid) for pid, args in rows
            if "train_hvd.py" in args and "horovodrun" not in args and not args.startswith(wrappers)]


def test_an_elastic_job_grows_when_a_container_is_started_and_added_to_the_host_list(containers):
    # Launched from outside its host list: a job whose hosts are all its launcher's own runs Horovod's rendezvous
    # on loopback, which no host added later can reach.
    names, shared, start = containers
    start("launcher")
    start("a")
    (shared / "hosts.txt").write_text("a:1\n")
    discovery = shared / "discover.sh"
    discovery.write_text(RECORDING_DISCOVERY)
    discovery.chmod(0o755)
    job = elastic_job(names["launcher"], np=1, epochs=8, discovery="/shared/discover.sh")

    def add_b():
        # The lone worker is held still until Horovod has seen b, so the join never races the end of training
        # however fast this machine is; once resumed it meets the news at its next commit.
        start("b")
        held = training_pids(names["a"])
        assert held, docker("top", names["a"], "-eo", "pid,args").stdout
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        try:
            (shared / "hosts.txt").write_text("a:1\nb:1\n")
            discovered = shared / "discovered"
            wait_for(lambda: discovered.exists() and "b:1" in discovered.read_text(), "Horovod to discover b")
        finally:
            for pid in held:
                os.kill(pid, signal.SIGCONT)

    output = follow(job, "epoch 1/8", add_b)
    assert "workers changed: now 2" in output
    summary = read_json(shared / "run" / "summary.json")
    assert summary["world_size"] == 2 and summary["params_in_sync"] and len(summary["params_fingerprints"]) == 2
    assert [h["epoch"] for h in summary["history"]] == list(range(1, 9))
    assert summary["best_val_acc1"] >= 97.0


def test_the_gpu_image_has_nccl_mpi_and_gloo(gpu_image):
    report = check_build(gpu_image)
    assert all(f"[X] {x}" in report for x in ("PyTorch", "NCCL", "MPI", "Gloo")), report


def test_the_gpu_image_asks_for_the_drivers_video_capability(gpu_image):
    # Without `video` the NVIDIA Container Toolkit mounts no video libraries, and nvJPEG never reaches the hardware
    # JPEG decoder of an A100/H100/H200 (docker/README.md).
    env = json.loads(docker("image", "inspect", "--format", "{{json .Config.Env}}", gpu_image).stdout)
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility,video" in env, env


def test_the_gpu_image_runs_the_acceptance_scripts_cpu_side_offline(gpu_image, tmp_path):
    # What a GPU node with no network does first: the carried sdist, the image's own torch, the NCCL build found
    # installed (the image keeps no CUDA compiler) and listed by horovodrun --check-build.
    sdist = subprocess.run([sys.executable, str(ROOT / "scripts" / "horovod" / "build_horovod.py"), "--print-sdist"],
                           capture_output=True, text=True, timeout=600, check=True).stdout.strip().splitlines()[-1]
    out = writable_dir(tmp_path / "out")
    proc = docker("run", "--rm", "--network", "none", "-v", f"{sdist}:/carried/{os.path.basename(sdist)}:ro",
                  "-v", f"{out}:/out", gpu_image, "bash", "scripts/gpu_check.sh", "--no-gpu", "--python",
                  "/opt/hvd-train/.venv/bin/python", "--horovod-sdist", f"/carried/{os.path.basename(sdist)}",
                  "--out", "/out", timeout=900)
    log = (out / "gpu_check.log").read_text()
    assert "PASS  Horovod with NCCL against this machine's torch (offline)" in log, log[-3000:]
    assert "PASS  horovodrun --check-build lists NCCL" in log and "SKIP  GPU tests (--no-gpu)" in log
    assert "Horovod is already installed from this build" in proc.stdout


DOCKER_RUNNABLE = re.compile(r"<!-- runnable with docker -->\n```bash\n(.*?)```", re.DOTALL)
README_TAGS = ("hvd-train:cpu", "hvd-train:gpu")  # what docker/README.md's commands name


def image_id(tag):
    proc = docker("image", "inspect", "--format", "{{.Id}}", tag, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def test_the_docker_readmes_commands_run_as_written(cpu_image, gpu_image, base_image):
    # After the two builds above, from the same Dockerfiles, base and CA: the README's builds come from the cache.
    # The base is the environment's default (HVD_BASE_IMAGE) where python:3.11-slim-bookworm cannot be had; the tags
    # the README names are given back to the images they named before.
    blocks = DOCKER_RUNNABLE.findall((ROOT / "docker" / "README.md").read_text())
    assert len(blocks) >= 2, "docker/README.md's build commands are marked runnable"
    env = dict(os.environ, HVD_BASE_IMAGE=base_image)
    if os.path.exists(CA_BUNDLE):
        env.setdefault("HVD_CA_BUNDLE", CA_BUNDLE)
    before = {tag: image_id(tag) for tag in README_TAGS}
    output = ""
    try:
        for block in blocks:
            proc = subprocess.run(["bash", "-e", "-c", block], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=3600)
            assert proc.returncode == 0, f"{block}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            output += proc.stdout
    finally:
        for tag, was in before.items():
            if was:
                docker("tag", was, tag, check=False)
            else:
                docker("rmi", tag, check=False)
    assert all(f"[X] {x}" in output for x in ("PyTorch", "NCCL", "MPI", "Gloo")), output[-3000:]
