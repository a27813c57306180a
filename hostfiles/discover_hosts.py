#!/usr/bin/env python3
"""Host discovery for elastic runs: prints the hosts that may take part now, one `host:slots` per line.

    horovodrun -np 8 --min-np 4 --max-np 16 --host-discovery-script hostfiles/discover_hosts.py \
        python train_hvd.py --elastic

Horovod runs this every second or so. Sources, in order:
1. $HVD_HOSTS_FILE, or hostfiles/hosts.txt beside this script: a plain file an operator edits while the job runs
   (`host slots=N` or `host:N` lines, `#` comments); remove a host to drain it, add one to grow the job, leave none
   to drain them all;
2. SLURM: the nodes of $SLURM_JOB_NODELIST (expanded by `scontrol show hostnames`), with $SLURM_NTASKS_PER_NODE
   or else $SLURM_TASKS_PER_NODE slots each (1 when neither is set).
It prints nothing (and exits 0) when neither is there, so Horovod waits for hosts rather than failing. A source it
cannot read ($HVD_HOSTS_FILE naming no file, a bad line, a broken SLURM allocation) is one line on stderr and exit
1: Horovod stops a job whose first discovery fails, and keeps the hosts it has through a later failure (a
half-saved file), where printing nothing would remove them all.
"""
import os
import stat
import sys

from generate import AllocationError, slurm_hosts
from validate import HostListError, parse, read_lines

DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hosts.txt")


def check_owner(path: str) -> None:
    """The host list decides which machines the job's ranks run on (and so ssh to): refused when a user other than
    this one (or root) owns it, or when anyone may write it."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise HostListError(f"{path}: cannot read: {e.strerror or e}") from None
    if info.st_mode & stat.S_IWOTH:
        raise HostListError(f"{path}: every user may write it (mode {stat.filemode(info.st_mode)}), and it decides "
                            f"where the job runs; chmod o-w {path}")
    if info.st_uid not in (os.getuid(), 0):
        raise HostListError(f"{path}: owned by uid {info.st_uid}, not by this user ({os.getuid()}) or root, and it "
                            f"decides where the job runs; use a host list of your own")


def from_file(path: str) -> list[tuple[str, int]]:
    check_owner(path)
    hosts, errors = parse(read_lines(path), live=True)
    if errors:
        number, message = errors[0]
        raise HostListError(f"{path}:{number}: {message}")
    return hosts


def current_hosts() -> list[tuple[str, int]]:
    """The hosts of the first source there is; a file named by $HVD_HOSTS_FILE must be there."""
    path = os.environ.get("HVD_HOSTS_FILE")
    if path and not os.path.exists(path):
        raise HostListError(f"$HVD_HOSTS_FILE={path} does not exist: point it at the live host list (an empty file "
                            f"drains every host), or unset it to use {DEFAULT} or the SLURM allocation")
    if path or os.path.exists(DEFAULT):
        return from_file(path or DEFAULT)
    return slurm_hosts(fix="list the hosts in $HVD_HOSTS_FILE instead")


def main() -> None:
    try:
        hosts = current_hosts()
    except (HostListError, AllocationError) as e:
        sys.exit(f"discover_hosts.py: {e}")
    for host, slots in hosts:
        print(f"{host}:{slots}")


if __name__ == "__main__":
    main()
