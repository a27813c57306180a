#!/usr/bin/env python3
"""Write the hostfile of the current batch allocation, for horovodrun -hostfile or mpirun -hostfile.

    python hostfiles/generate.py slurm > hosts.txt         # SLURM: $SLURM_JOB_NODELIST, $SLURM_NTASKS_PER_NODE
    python hostfiles/generate.py pbs > hosts.txt           # PBS/Torque: $PBS_NODEFILE (one line per slot)
    python hostfiles/generate.py slurm --format hosts      # host1:4,host2:4 for horovodrun -H

`--slots N` overrides the slots per host (say, the GPUs per node when the scheduler counts tasks differently).
"""
import argparse
import os
import subprocess
import sys
from collections import Counter


def slurm_hosts(slots=None):
    """[(host, slots)] of the SLURM job this runs in; [] outside one."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return []
    # An argument list, never a shell: the node list comes from the environment.
    names = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                           check=True).stdout.split()
    # SLURM writes "4" or, for uneven allocations, "4(x2),2"; the first count is the one per node here.
    per_node = slots or int(os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0].split(",")[0])
    return [(name, per_node) for name in names]


def pbs_hosts(slots=None):
    """[(host, slots)] from $PBS_NODEFILE, which lists each host once per slot; [] outside a PBS job."""
    path = os.environ.get("PBS_NODEFILE")
    if not path:
        return []
    with open(path) as f:
        counts = Counter(line.strip() for line in f if line.strip())
    return [(host, slots or n) for host, n in counts.items()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("scheduler", choices=("slurm", "pbs"))
    parser.add_argument("--format", choices=("hostfile", "hosts"), default="hostfile",
                        help="hostfile: 'host slots=N' lines; hosts: host:N,... for -H")
    parser.add_argument("--slots", type=int, help="slots per host instead of the scheduler's count")
    args = parser.parse_args(argv)
    if args.slots is not None and args.slots < 1:
        parser.error(f"--slots {args.slots}: give at least 1 slot per host")
    hosts = slurm_hosts(args.slots) if args.scheduler == "slurm" else pbs_hosts(args.slots)
    if not hosts:
        variable = "SLURM_JOB_NODELIST" if args.scheduler == "slurm" else "PBS_NODEFILE"
        sys.exit(f"generate.py: ${variable} is not set: run this inside a {args.scheduler.upper()} job")
    if args.format == "hosts":
        print(",".join(f"{host}:{slots}" for host, slots in hosts))
    else:
        print("\n".join(f"{host} slots={slots}" for host, slots in hosts))


if __name__ == "__main__":
    main()
