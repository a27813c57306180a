"""hostfiles/validate.py: valid files pass with a total; every problem is reported with its line number."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

VALIDATE = ROOT / "hostfiles" / "validate.py"


def validate(tmp_path, text):
    path = tmp_path / "hosts.txt"
    path.write_text(text)
    return subprocess.run([sys.executable, str(VALIDATE), str(path)], capture_output=True, text=True, timeout=30)


def test_the_shipped_example_is_valid():
    proc = subprocess.run([sys.executable, str(VALIDATE), str(ROOT / "hostfiles" / "example.txt")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "2 host(s), 8 slot(s)" in proc.stdout


def test_comments_blank_lines_addresses_and_max_slots_are_fine(tmp_path):
    proc = validate(tmp_path, "# cluster\n\nnode-1 slots=4 max_slots=8  # GPUs\n10.0.0.2 slots=2\n")
    assert proc.returncode == 0, proc.stderr
    assert "node-1:4, 10.0.0.2:2" in proc.stdout


@pytest.mark.parametrize("text,line,message", [
    ("a slots=2\nb\n", 2, "b has no slots=N"),
    ("a slots=0\n", 1, "a has slots=0"),
    ("a slots=2\n\na slots=1\n", 3, "a is listed again (first on line 1)"),
    ("a slots=two\n", 1, "slots='two' on a is not a whole number"),
    ("a slots=2 gpus=4\n", 1, "unknown option 'gpus=4'"),
    ("a slots=4 max_slots=2\n", 1, "max_slots=2 below slots=4"),
    ("slots=4\n", 1, "is not a host name"),
    ("# nothing\n", 1, "no hosts"),
    ("a slots=1\nnode1:4\n", 2, "write 'node1 slots=4' in a hostfile"),
])
def test_each_problem_is_named_with_its_line(tmp_path, text, line, message):
    proc = validate(tmp_path, text)
    assert proc.returncode == 1
    [report] = [row for row in proc.stderr.splitlines() if message in row]
    assert f"hosts.txt:{line}: " in report


def test_all_problems_are_reported_at_once(tmp_path):
    proc = validate(tmp_path, "a\nb slots=0\nc slots=1\n")
    assert proc.returncode == 1 and proc.stderr.count("hosts.txt:") == 2


def test_a_missing_file_is_an_error_not_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, str(VALIDATE), str(tmp_path / "nope")], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 1 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr


DISCOVER = ROOT / "hostfiles" / "discover_hosts.py"


def discover(env_extra, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "HVD_HOSTS_FILE"}
    env["HVD_HOSTS_FILE"] = str(tmp_path / "absent.txt")
    env.update(env_extra)
    return subprocess.run([sys.executable, str(DISCOVER)], capture_output=True, text=True, env=env, timeout=30)


def test_discovery_reads_the_operators_file_in_either_spelling(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("# live hosts\nnode1 slots=4\nnode2:2\nnode3 slots=0  # drained\n")
    proc = discover({"HVD_HOSTS_FILE": str(hosts)}, tmp_path)
    assert proc.returncode == 0 and proc.stdout.split() == ["node1:4", "node2:2"]


def test_discovery_takes_a_bare_host_as_one_slot_and_refuses_a_host_listed_twice(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node1\nnode2 slots=2\n")
    assert discover({"HVD_HOSTS_FILE": str(hosts)}, tmp_path).stdout.split() == ["node1:1", "node2:2"]
    hosts.write_text("node1:2\nnode1 slots=2\n")
    proc = discover({"HVD_HOSTS_FILE": str(hosts)}, tmp_path)
    assert proc.returncode != 0 and "hosts.txt:2: node1 is listed again" in proc.stderr


def test_discovery_names_a_bad_line(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node1 slots=4\nnode2 4\n")
    proc = discover({"HVD_HOSTS_FILE": str(hosts)}, tmp_path)
    assert proc.returncode != 0 and "hosts.txt:2:" in proc.stderr


def test_discovery_falls_back_to_the_slurm_allocation(tmp_path):
    proc = discover({"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NTASKS_PER_NODE": "4",
                     "PATH": fake_scontrol(tmp_path)}, tmp_path)
    assert proc.returncode == 0 and proc.stdout.split() == ["gpu01:4", "gpu02:4"]


def test_discovery_with_no_source_prints_nothing(tmp_path):
    proc = discover({}, tmp_path)
    assert proc.returncode == 0 and proc.stdout == ""


GENERATE = ROOT / "hostfiles" / "generate.py"


def fake_scontrol(tmp_path):
    """Stands in for SLURM's controller: expands gpu[01-02] as `scontrol show hostnames` does."""
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && [ \"$3\" = 'gpu[01-02]' ] && "
                    "printf 'gpu01\\ngpu02\\n'\n")
    fake.chmod(0o755)
    return f"{fake.parent}{os.pathsep}{os.environ['PATH']}"


def generate(tmp_path, *args, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_"))}
    env.update(env_extra)
    return subprocess.run([sys.executable, str(GENERATE), *args], capture_output=True, text=True, env=env,
                          timeout=30)


def test_slurm_allocation_becomes_a_valid_hostfile_or_a_host_list(tmp_path):
    slurm = dict(SLURM_JOB_NODELIST="gpu[01-02]", SLURM_NTASKS_PER_NODE="4(x2)", PATH=fake_scontrol(tmp_path))
    proc = generate(tmp_path, "slurm", **slurm)
    assert proc.returncode == 0 and proc.stdout.splitlines() == ["gpu01 slots=4", "gpu02 slots=4"]
    (tmp_path / "hosts.txt").write_text(proc.stdout)
    assert validate(tmp_path, proc.stdout).returncode == 0
    assert generate(tmp_path, "slurm", "--format", "hosts", "--slots", "8", **slurm).stdout.strip() == \
        "gpu01:8,gpu02:8"


def test_pbs_nodefile_lines_are_counted_into_slots(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("n1\nn1\nn2\nn1\nn2\n")
    proc = generate(tmp_path, "pbs", PBS_NODEFILE=str(nodefile))
    assert proc.returncode == 0 and proc.stdout.splitlines() == ["n1 slots=3", "n2 slots=2"]


def test_outside_a_job_the_generator_says_what_is_missing(tmp_path):
    proc = generate(tmp_path, "slurm")
    assert proc.returncode != 0 and "$SLURM_JOB_NODELIST is not set" in proc.stderr
    proc = generate(tmp_path, "pbs", "--slots", "0", PBS_NODEFILE="x")
    assert proc.returncode != 0 and "--slots 0" in proc.stderr
