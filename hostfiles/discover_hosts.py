#!/usr/bin/env python3
"""Host discovery for elastic runs: prints the hosts that may take part now, one `host:slots` per line.

    horovodrun -np 8 --min-np 4 --max-np 16 --host-discovery-script hostfiles/discover_hosts.py \
        python train_hvd.py --elastic

Horovod runs this every second or so. Sources, in order:
1. $HVD_HOSTS_FILE, or hostfiles/hosts.txt beside this script: a plain file an operator edits while the job runs
   (`host slots=N` or `host:N` lines, `#` comments); remove a host to drain it, add one to grow the job;
2. SLURM: the nodes of $SLURM_JOB_NODELIST (expanded by `scontrol show hostnames`), with
   $SLURM_NTASKS_PER_NODE slots each (1 when unset).
It prints nothing (and exits 0) when neither is there, so Horovod waits for hosts rather than failing.
"""
import os
import sys

from generate import slurm_hosts
from validate import parse


def from_file(path):
    with open(path) as f:
        hosts, errors = parse(f.read().splitlines(), live=True)
    if errors:
        number, message = errors[0]
        sys.exit(f"{path}:{number}: {message}")
    return hosts


def main():
    path = os.environ.get("HVD_HOSTS_FILE") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "hosts.txt")
    hosts = from_file(path) if os.path.isfile(path) else slurm_hosts()
    for host, slots in hosts:
        print(f"{host}:{slots}")


if __name__ == "__main__":
    main()
