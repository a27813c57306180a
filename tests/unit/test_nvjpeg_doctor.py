"""hvd-train doctor's nvjpeg row (whether nvJPEG can use the GPU's hardware JPEG decoder), and the GPU image's
NVIDIA_DRIVER_CAPABILITIES that gives a container the driver's video libraries it needs.

The decision is a function of what the probe reports (the GPU's name and compute capability, the container's
NVIDIA_DRIVER_CAPABILITIES, whether libnvcuvid.so.1 loads), tested here on those inputs; the real doctor runs too,
without a GPU here (no row) and, marked gpu, on a GPU node (a row naming the GPU)."""
import json
import re
import shlex
import subprocess
import sys

import pytest
import torch

from conftest import BIN, ROOT, job_env
from hvd_train.tools import doctor
from hvd_train.tools import doctor as doctor_checks
from hvd_train.tools.doctor import PROBE

H200 = ("NVIDIA H200", (9, 0))
FALLBACK = "--data.decode gpu decodes on the CUDA cores"


@pytest.mark.parametrize("name, capability, engines", [
    ("Tesla V100-SXM2-32GB", (7, 0), False), ("Tesla T4", (7, 5), False), ("NVIDIA A100-SXM4-80GB", (8, 0), True),
    ("NVIDIA A30", (8, 0), True), ("NVIDIA A10", (8, 6), False), ("NVIDIA GeForce RTX 3090", (8, 6), False),
    ("Orin", (8, 7), False), ("NVIDIA L4", (8, 9), True), ("NVIDIA H100 80GB HBM3", (9, 0), True),
    ("NVIDIA H200", (9, 0), True), ("NVIDIA GH200 480GB", (9, 0), True), ("NVIDIA B200", (10, 0), True),
    ("NVIDIA GB200", (10, 0), True), ("NVIDIA B300", (10, 3), True), ("NVIDIA Thor", (11, 0), True),
    ("NVIDIA RTX PRO 6000 Blackwell", (12, 0), True), ("a GPU of 2030", (13, 0), None)])
def test_which_gpus_have_hardware_jpeg_engines(name, capability, engines):
    assert doctor_checks.jpeg_engines(capability) is engines, name


def test_an_h200_with_the_video_libraries_has_the_hardware_decoder():
    assert doctor_checks.nvjpeg_check(*H200, "compute,utility,video", True) == \
        ("ok", "hardware decoder available (NVIDIA H200; driver video libraries present)", "")
    # Outside a container (no variable) and with `all`, the library is what counts.
    assert doctor_checks.nvjpeg_check(*H200, None, True)[:2] == doctor_checks.nvjpeg_check(*H200, "all", True)[:2] == \
        ("ok", "hardware decoder available (NVIDIA H200; driver video libraries present)")


def test_an_h200_in_a_container_without_the_video_capability_is_warned_with_the_fix():
    status, detail, fix = doctor_checks.nvjpeg_check(*H200, "compute,utility", False)
    assert status == "WARN"
    assert detail == ("hardware decoder not available: this container lacks the driver's video capability "
                      f"(NVIDIA_DRIVER_CAPABILITIES=compute,utility); {FALLBACK}")
    assert fix == "run the image with --gpus all and NVIDIA_DRIVER_CAPABILITIES including video (docker/README.md)"


@pytest.mark.parametrize("capabilities", ["compute,utility,video", "all", "compute, video"])
def test_a_container_that_asks_for_video_but_has_no_video_library_says_the_driver_lacks_it(capabilities):
    status, detail, fix = doctor_checks.nvjpeg_check(*H200, capabilities, False)
    assert status == "WARN" and f"NVIDIA_DRIVER_CAPABILITIES={capabilities} names video" in detail
    assert "libnvcuvid.so.1 does not load" in detail and detail.endswith(FALLBACK)
    assert "libnvidia-decode" in fix and "NVIDIA Container Toolkit" in fix


def test_a_host_outside_a_container_without_the_video_library_is_told_to_install_it():
    status, detail, fix = doctor_checks.nvjpeg_check(*H200, None, False)
    assert status == "WARN" and detail == f"hardware decoder not available: the driver's libnvcuvid.so.1 does not " \
                                          f"load; {FALLBACK}"
    assert "libnvidia-decode" in fix and "video driver capability (docker/README.md)" in fix


@pytest.mark.parametrize("capabilities, video_library", [("compute,utility", False), ("all", True), (None, False)])
def test_a_gpu_without_jpeg_engines_is_no_problem_whatever_the_container(capabilities, video_library):
    assert doctor_checks.nvjpeg_check("Tesla T4", (7, 5), capabilities, video_library) == \
        ("ok", f"no hardware decoder: the Tesla T4 (sm_75) has no hardware JPEG engine; {FALLBACK}", "")


def test_a_gpu_newer_than_the_list_is_said_to_be_unknown():
    status, detail, _ = doctor_checks.nvjpeg_check("a GPU of 2030", (13, 0), "compute,utility", False)
    assert status == "ok" and detail.startswith("hardware decoder unknown: the a GPU of 2030 (sm_130)")
    assert detail.endswith("the driver's video libraries are missing")


def test_a_mig_instance_is_available_only_if_its_profile_has_engines():
    _, detail, _ = doctor_checks.nvjpeg_check("NVIDIA H100 80GB HBM3 MIG 1g.10gb", (9, 0), "all", True)
    assert detail.startswith("hardware decoder available if this MIG instance's profile has JPEG engines")


def gpu_host_facts(**overrides):
    """What the probe reports for a healthy one-GPU host, as check_host reads it."""
    versions = {"python": "3.11.2", "torch": "2.15.0", "horovod": "0.28.1", "hvd-train": "0.1.0"}
    facts = dict(versions, build={"MPI": True, "Gloo": True, "NCCL": True}, interfaces={"eth0": ["10.0.0.5"]},
                 resolves_to="10.0.0.5", hostname="node1", gpus=1, cpus=16, mpirun="/usr/bin/mpirun", skew=0.0,
                 disk_free=100 * 2**30, disk_path="/data", disk_writable=True, gpu_model=["NVIDIA H200", [9, 0]],
                 video_library=False, driver_capabilities="compute,utility")
    facts.update(overrides)
    return facts, versions


def test_check_host_adds_the_row_for_a_gpu_host_from_the_probes_facts():
    facts, reference = gpu_host_facts()
    report = doctor.Report()
    doctor_checks.check_host(report, "node1", 1, facts, reference, doctor.parse_args(["-H", "node1:1"]))
    rows = [r for r in report.rows if r[1] == "nvjpeg"]
    assert rows == [("node1", "nvjpeg", *doctor_checks.nvjpeg_check("NVIDIA H200", (9, 0), "compute,utility", False))]
    # The same facts from a host without a GPU: no row.
    facts, reference = gpu_host_facts(gpus=0, gpu_model=None)
    report = doctor.Report()
    doctor_checks.check_host(report, "node1", 1, facts, reference, doctor.parse_args(["-H", "node1:1"]))
    assert "nvjpeg" not in [r[1] for r in report.rows]


def test_the_probe_reports_the_facts_the_row_needs(tmp_path):
    env = dict(job_env(), NVIDIA_DRIVER_CAPABILITIES="compute,utility")
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["driver_capabilities"] == "compute,utility" and isinstance(facts["video_library"], bool)
    if facts["gpus"]:
        name, capability = facts["gpu_model"]
        assert name == torch.cuda.get_device_name(0) and capability == list(torch.cuda.get_device_capability(0))
    else:
        assert facts["gpu_model"] is None


def run_doctor(tmp_path):
    proc = subprocess.run([str(BIN / "hvd-train"), "doctor", "-H", "localhost:1", "--gloo", "--output-dir",
                           str(tmp_path)], env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.no_gpu
@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="this machine has a GPU: the doctor reports an nvjpeg row")
def test_the_real_doctor_has_no_nvjpeg_row_on_a_host_without_a_gpu(tmp_path):
    out = run_doctor(tmp_path)
    assert "a job would start" in out and re.search(r"^localhost\s+slots\s+ok\s+1 slot\(s\), no GPU", out, re.M), out
    assert "nvjpeg" not in out, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_the_real_doctor_says_whether_this_gpu_has_the_hardware_decoder(tmp_path):
    out = run_doctor(tmp_path)
    row = re.search(r"^localhost\s+nvjpeg\s+(ok|WARN)\s+(.*)$", out, re.M)
    assert row, out
    name = torch.cuda.get_device_name(0)
    assert name in row.group(2) and "decoder" in row.group(2), out


# --------------------------------------------------------------------------------------------------------------------
# The GPU image (make test-images checks the built image's Config.Env too)


def dockerfile_env(path):
    """Every variable the Dockerfile's ENV instructions set (KEY=VALUE form), the last value of each."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for word in shlex.split(line[4:]):
                key, sep, value = word.partition("=")
                assert sep, f"{path.name}: ENV {line[4:]!r} is not in KEY=VALUE form"
                env[key] = value
    return env


def test_the_gpu_image_gives_its_containers_the_drivers_video_capability():
    env = dockerfile_env(ROOT / "docker" / "Dockerfile.gpu")
    assert env.get("NVIDIA_DRIVER_CAPABILITIES") == "compute,utility,video", env
    # What the doctor would say on an H200 inside it, were the video library missing: not that the image lacks it.
    _, detail, _ = doctor_checks.nvjpeg_check(*H200, env["NVIDIA_DRIVER_CAPABILITIES"], False)
    assert "lacks the driver's video capability" not in detail
