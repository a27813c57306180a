"""SLURM for real: a one-machine cluster (munged, slurmctld and slurmd with a minimal configuration in a temporary
directory) runs hostfiles/slurm_train.sbatch with 2 tasks. generate.py reads the allocation through the real
scontrol, and a job requeued mid-run continues from its last checkpoint (--resume auto). Skipped, with the reason,
where SLURM is not installed or cannot start."""
import os
import shutil
import socket
import subprocess

import pytest

from conftest import ROOT, free_port, job_env, read_json, wait_for

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


def test_sbatch_trains_with_two_tasks_and_a_requeued_job_resumes(slurm, tmp_path):
    log = tmp_path / "job.log"
    # The script's GPU request and two nodes, replaced for this one CPU node; every other line is as shipped. No
    # --output-dir: the script's own, runs/slurm-<job name>-<job id>, is this job's alone and survives its requeue.
    name = f"hvd-test-{os.getpid()}"
    proc = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0",
                           "--cpus-per-task=1", "--open-mode=append", f"--output={log}", f"--job-name={name}",
                           str(ROOT / "hostfiles" / "slurm_train.sbatch"), "--epochs", "10",
                           "--batch-size", "8", "--logging.progress=false"],
                          cwd=ROOT, env=slurm, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    out = ROOT / "runs" / f"slurm-{name}-{job}"
    try:
        trained_and_resumed(slurm, job, out, log)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def trained_and_resumed(slurm, job, out, log):
    # As soon as the first checkpoint is written, SLURM requeues the job (a preemption, a node failure); the nine
    # epochs still to train keep it running until the requeue arrives.
    wait_for(lambda: (out / "checkpoints" / "last.pt").exists() or job_state(slurm, job) in ("FAILED", "GONE"),
             "the first checkpoint", seconds=300)
    requeue = subprocess.run(["scontrol", "requeue", job], env=slurm, capture_output=True, text=True)
    assert requeue.returncode == 0, requeue.stderr
    wait_for(lambda: job_state(slurm, job) in ("COMPLETED", "FAILED", "CANCELLED", "GONE"), "the requeued job",
             seconds=600)
    output = log.read_text()
    assert job_state(slurm, job) == "COMPLETED", output[-3000:]
    # generate.py read the allocation through scontrol: this node, 2 slots.
    assert f"1 host(s), 2 slot(s): {socket.gethostname().split('.')[0]}:2" in output
    assert "resuming after epoch" in output  # the second start continued from the checkpoint
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2 and summary["params_in_sync"]
    assert [h["epoch"] for h in summary["history"]] == list(range(1, 11))
    assert summary["final_val_acc1"] > 90.0
