"""SLURM for real: a one-machine cluster (munged, slurmctld and slurmd with a minimal configuration in a temporary
directory) runs hostfiles/slurm_train.sbatch with 2 tasks. generate.py reads the allocation through the real
scontrol and the run its time limit through the real squeue; a job warned ahead of its time limit saves at a step,
requeues itself and continues within the epoch, and, preempted (requeued from outside), does it again; it ends with
the weights of a run never stopped. Skipped, with the reason, where SLURM is not installed or cannot start."""
import os
import re
import shutil
import socket
import subprocess

import pytest
import torch

from conftest import ROOT, free_port, job_env, launch_command, read_json, wait_for

pytestmark = pytest.mark.distributed
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")


def slurm_conf(d, host):
    return f"""ClusterName=hvdtest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits out the credential lifetime (cred_expire, 120 s by default) before it may start again, and a
# pending job is looked at by the main scheduling loop (sched_interval, 60 s): both shortened for a test cluster.
AuthInfo=socket={d}/munge.socket,cred_expire=15
SchedulerParameters=sched_interval=5,bf_interval=5
CredType=cred/munge
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def slurm(tmp_path):
    """The environment for sbatch/scontrol of a running one-node SLURM cluster; stopped afterwards."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing; Debian: apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("starting slurmd needs root")
    d = tmp_path / "slurm"
    for sub in ("state", "spool"):
        (d / sub).mkdir(parents=True)
    (d / "munge.key").write_bytes(os.urandom(1024))
    os.chmod(d / "munge.key", 0o400)
    host = socket.gethostname().split(".")[0]
    (d / "slurm.conf").write_text(slurm_conf(d, host))
    env = {**job_env(), "SLURM_CONF": str(d / "slurm.conf")}
    daemons = []

    def start(*cmd):
        daemons.append(subprocess.Popen(list(cmd), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    try:
        start("munged", "-F", "-f", f"--socket={d}/munge.socket", f"--key-file={d}/munge.key",
              f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munge.seed")
        wait_for(lambda: (d / "munge.socket").exists(), "munged's socket", seconds=60)
        start("slurmctld", "-D", "-i")
        start("slurmd", "-D")

        def idle():
            proc = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            return proc.stdout.strip() == "idle"

        try:
            wait_for(idle, "the SLURM node to become idle", seconds=60)
        except AssertionError:
            logs = "".join(p.read_text()[-1500:] for p in d.glob("*.log"))
            pytest.skip(f"SLURM did not start on this machine:\n{logs}")
        yield env
    finally:
        for daemon in reversed(daemons):
            daemon.kill()
            daemon.wait()


def job_state(env, job):
    proc = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True)
    return next((w.split("=", 1)[1] for w in proc.stdout.split() if w.startswith("JobState=")), "GONE")


# The job's settings; the reference run outside SLURM trains with the same ones. A checkpoint every 40 steps (an
# epoch is 89 steps of 8 per rank), and each step paced to take at least 60 ms (tests/workers/paced), so that the
# job is still running when the test signals it, however fast the machine. Two loader workers per rank: SLURM's
# signals (USR1 to the batch script, TERM to every process of the job) must reach the ranks, never their workers.
# timm's resnet10t with GroupNorm (one group) in place of BatchNorm: a normalization without running statistics,
# whose resume must be as exact.
JOB = ["--epochs", "3", "--batch-size", "8", "--checkpoint.every_steps", "40", "--logging.progress=false",
       "--workers", "2", "--model", "timm/resnet10t", "--model-args", "norm_layer=groupnorm1", "--image-size", "16"]
PACED = {"PYTHONPATH": f"{ROOT / 'tests' / 'workers' / 'paced'}{os.pathsep}{ROOT}", "HVD_TEST_STEP_PAUSE_S": "0.06"}


def test_a_warned_then_preempted_job_requeues_itself_and_ends_with_the_weights_of_one_never_stopped(slurm, tmp_path):
    log = tmp_path / "job.log"
    # The script's GPU request and two nodes, replaced for this one CPU node; every other line is as shipped. No
    # --output-dir: the script's own, runs/slurm-<job name>-<job id>, is this job's alone and survives its requeues.
    name = f"hvd-test-{os.getpid()}"
    proc = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0",
                           "--cpus-per-task=1", "--open-mode=append", f"--output={log}", f"--job-name={name}",
                           str(ROOT / "hostfiles" / "slurm_train.sbatch"), *JOB],
                          cwd=ROOT, env={**slurm, **PACED}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    out = ROOT / "runs" / f"slurm-{name}-{job}"
    # The same training, never stopped: mpirun as the script runs it, one thread per rank as SLURM gives it.
    reference = subprocess.Popen(launch_command("mpirun", 2, [str(ROOT / "train_hvd.py"), "--output-dir",
                                                              str(tmp_path / "reference"), *JOB]),
                                 cwd=ROOT, env={**job_env(), "OMP_NUM_THREADS": "1"},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        warned_preempted_and_finished(slurm, job, out, log)
        assert reference.wait(timeout=600) == 0
        straight = torch.load(tmp_path / "reference" / "checkpoints" / "last.pt", weights_only=True)
        stopped = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
        for key, value in straight["model"].items():
            assert torch.equal(value, stopped["model"][key]), f"{key} differs from the run that never stopped"
        assert straight["step"] == stopped["step"] == 3 * 89  # 719 samples a rank: 89 full batches of 8
    finally:
        reference.kill()
        shutil.rmtree(out, ignore_errors=True)


def warned_preempted_and_finished(slurm, job, out, log):
    def parts():
        return log.read_text().count("hvd-train default: 2 rank(s)") if log.exists() else 0

    # SLURM's warning (what --signal=B:USR1@300 sends the batch script ahead of the time limit), once epoch 1 is
    # written: the ranks save at a step and exit 75, and the script requeues the job.
    wait_for(lambda: epochs_done(out) >= 1 or job_state(slurm, job) in ("FAILED", "GONE"), "epoch 1", seconds=300)
    warn = subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, capture_output=True, text=True)
    assert warn.returncode == 0, warn.stderr
    # The requeued job continues within the epoch; then a preemption (scontrol requeue: SIGTERM to every process)
    # once it has written a checkpoint of its own.
    wait_for(lambda: parts() >= 2 or job_state(slurm, job) in ("FAILED", "GONE"), "the job's second start",
             seconds=300)
    first = checkpoint_step(out)
    wait_for(lambda: checkpoint_step(out) > first or job_state(slurm, job) in ("FAILED", "GONE", "COMPLETED"),
             "a checkpoint of the second start", seconds=300)
    requeue = subprocess.run(["scontrol", "requeue", job], env=slurm, capture_output=True, text=True)
    assert requeue.returncode == 0, requeue.stderr
    wait_for(lambda: parts() >= 3 and job_state(slurm, job) in ("COMPLETED", "FAILED", "CANCELLED", "GONE"),
             "the job to finish", seconds=600)
    output = log.read_text()
    assert job_state(slurm, job) == "COMPLETED", output[-3000:]
    # generate.py read the allocation through scontrol: this node, 2 slots. The run read its time limit (24 h).
    assert f"1 host(s), 2 slot(s): {socket.gethostname().split('.')[0]}:2" in output
    assert re.search(r"SLURM time limit in 8\d{4} s: a checkpoint and a stop \(exit 75, to be requeued\) 300 s "
                     r"before it", output), output[-3000:]
    assert re.search(r"train_hvd.py: interrupted by SIGUSR1 at epoch \d/3, after \d+ step\(s\) of it; --resume auto "
                     r"continues from \S+ \(epoch \d, after step \d+ of it\)", output), output[-3000:]
    assert f"hvd-train stopped to be continued: requeueing job {job}" in output
    assert output.count("resumed within epoch") == 2, output[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2 and summary["params_in_sync"]
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3] and len(summary["resumes"]) == 2


def epochs_done(out):
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def checkpoint_step(out):
    """The run step of the newest checkpoint (0 before the first); it is replaced whole, never half-written."""
    try:
        return torch.load(out / "checkpoints" / "last.pt", weights_only=True)["step"]
    except (FileNotFoundError, RuntimeError):
        return 0


@pytest.mark.parametrize("text, seconds", [("1-02:03:04", 93784), ("02:03:04", 7384), ("03:04", 184), ("0:05", 5),
                                           ("UNLIMITED", None), ("NOT_SET", None), ("INVALID", None), ("", None)])
def test_squeue_s_time_left_is_read_in_all_its_forms(text, seconds):
    from hvd_train.guards.interrupt import parse_time_left

    assert parse_time_left(text) == seconds
