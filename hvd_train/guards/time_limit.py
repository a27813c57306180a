"""A SLURM job's time limit, read once on rank 0, so that the run saves and stops before SLURM kills it."""
import logging
import os
import re
import shutil
import subprocess
import time

log = logging.getLogger("hvd_train")
# squeue's %L: [days-]hours:minutes:seconds, minutes:seconds, or a word (UNLIMITED, NOT_SET, INVALID).
TIME_LEFT = re.compile(r"(?:(?:(\d+)-)?(\d+):)?(\d+):(\d+)")


def parse_time_left(text):
    """Seconds from squeue's %L, or None where it names no limit."""
    m = TIME_LEFT.fullmatch(text.strip())
    if m is None:
        return None
    days, hours, minutes, seconds = (int(v) if v else 0 for v in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def slurm_seconds_left(env=None):
    """Seconds until this SLURM job's time limit (squeue -j $SLURM_JOB_ID -o %L), or None: not a SLURM job, no
    limit, or squeue cannot tell (said in one line)."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        return None
    squeue = shutil.which("squeue")
    if squeue is None:
        log.info("SLURM job %s: no squeue on this node, so the time limit is not watched (SIGUSR1 still saves)", job)
        return None
    try:
        out = subprocess.run([squeue, "-h", "-j", job, "-o", "%L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.info("SLURM job %s: squeue failed (%s), so the time limit is not watched", job, e)
        return None
    return parse_time_left(out.stdout) if out.returncode == 0 else None


def deadline(margin_s, is_main):
    """time.monotonic() by which a save-and-stop must have begun (rank 0, under a SLURM time limit), else None."""
    if not is_main or not margin_s:
        return None
    left = slurm_seconds_left()
    if left is None:
        return None
    if left <= margin_s:
        log.info("SLURM time limit in %d s, within --checkpoint.before_time_limit_s %g: not watched (lower that "
                 "setting, or ask SLURM for more time)", left, margin_s)
        return None
    log.info("SLURM time limit in %d s: a checkpoint and a stop (exit 75, to be requeued) %g s before it", left,
             margin_s)
    return time.monotonic() + left - margin_s
