#!/usr/bin/env python3
"""Write the hostfile of the current batch allocation, for horovodrun -hostfile or mpirun -hostfile.

    python hostfiles/generate.py slurm > hosts.txt         # SLURM: $SLURM_JOB_NODELIST and its tasks per node
    python hostfiles/generate.py pbs > hosts.txt           # PBS/Torque: $PBS_NODEFILE (one line per slot)
    python hostfiles/generate.py slurm --format hosts      # host1:4,host2:4 for horovodrun -H

SLURM's slots per node come from $SLURM_NTASKS_PER_NODE (--ntasks-per-node), else $SLURM_TASKS_PER_NODE (what
SLURM placed, e.g. `4(x2),2`), else 1. `--slots N` overrides them (say, the GPUs per node when the scheduler
counts tasks differently).
"""
import argparse
import os
import re
import subprocess
import sys
from collections import Counter
from typing import Optional, Sequence

from validate import HostListError, read_lines

# One group of SLURM's compressed per-node counts: N tasks, on M nodes in a row when written N(xM).
TASK_GROUP = re.compile(r"([1-9]\d*)(?:\(x([1-9]\d*)\))?")


class AllocationError(Exception):
    """The allocation the scheduler describes cannot be read; the message names the value and the fix."""


def slurm_hosts(slots: Optional[int] = None, fix: str = "pass --slots N to give the slots per host"
                ) -> list[tuple[str, int]]:
    """[(host, slots)] of the SLURM job this runs in; [] outside one. `fix` ends the messages about a task count
    (how the caller's user can give the slots instead)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return []
    names = slurm_node_names(nodelist)
    per_node = [slots] * len(names) if slots else slurm_slots(len(names), nodelist, fix)
    return list(zip(names, per_node))


def slurm_node_names(nodelist: str) -> list[str]:
    """The nodes of a SLURM node list (gpu[01-02]: gpu01, gpu02), as `scontrol show hostnames` expands it."""
    where = f"$SLURM_JOB_NODELIST={nodelist!r}"
    try:
        # An argument list, never a shell: the node list comes from the environment.
        proc = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                              errors="replace")
    except FileNotFoundError:
        raise AllocationError(f"cannot expand {where}: scontrol is not on PATH; run this on a node of the SLURM job, "
                              f"or add SLURM's bin directory to PATH") from None
    except OSError as e:
        raise AllocationError(f"cannot run scontrol to expand {where}: {e.strerror or e}") from None
    names = proc.stdout.split()
    if proc.returncode != 0 or not names:
        said = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}, no host names"])[-1]
        raise AllocationError(f"scontrol cannot expand {where} ({said}): check the variable, and run this on a "
                              f"node of the SLURM job") from None
    return names


def slurm_slots(count: int, nodelist: str, fix: str) -> list[int]:
    """The slots of each of `count` nodes: $SLURM_NTASKS_PER_NODE (--ntasks-per-node, the same on every node),
    else $SLURM_TASKS_PER_NODE (always set, one count per node in node order), else 1."""
    variable = next((v for v in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if os.environ.get(v)), None)
    if variable is None:
        return [1] * count
    value = os.environ[variable]
    per_node = expand_counts(variable, value, fix)
    if variable == "SLURM_NTASKS_PER_NODE" and value.isdigit():
        return per_node * count
    if len(per_node) != count:
        raise AllocationError(f"${variable}={value!r} counts tasks for {len(per_node)} node(s), but "
                              f"$SLURM_JOB_NODELIST={nodelist!r} has {count}: run this in the job that set both, "
                              f"or {fix}")
    return per_node


def expand_counts(variable: str, value: str, fix: str) -> list[int]:
    """SLURM's compressed per-node counts, one per node: '2(x2),1' is [2, 2, 1]."""
    counts = []
    for group in value.split(","):
        m = TASK_GROUP.fullmatch(group.strip())
        if not m:
            raise AllocationError(f"${variable}={value!r} is not a count of tasks per node (N, or N(xM) for M nodes "
                                  f"in a row, comma-separated; N, M >= 1): {fix}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def pbs_hosts(slots: Optional[int] = None) -> list[tuple[str, int]]:
    """[(host, slots)] from $PBS_NODEFILE, which lists each host once per slot; [] outside a PBS job."""
    path = os.environ.get("PBS_NODEFILE")
    if not path:
        return []
    name = f"$PBS_NODEFILE={path}"
    counts = Counter(line.strip() for line in read_lines(path, name) if line.strip())
    if not counts:
        raise AllocationError(f"{name} names no hosts: run this inside the PBS job, where PBS writes that file")
    return [(host, slots or n) for host, n in counts.items()]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("scheduler", choices=("slurm", "pbs"))
    parser.add_argument("--format", choices=("hostfile", "hosts"), default="hostfile",
                        help="hostfile: 'host slots=N' lines; hosts: host:N,... for -H")
    parser.add_argument("--slots", type=int, help="slots per host instead of the scheduler's count")
    args = parser.parse_args(argv)
    if args.slots is not None and args.slots < 1:
        parser.error(f"--slots {args.slots}: give at least 1 slot per host")
    try:
        hosts = slurm_hosts(args.slots) if args.scheduler == "slurm" else pbs_hosts(args.slots)
    except (AllocationError, HostListError) as e:
        sys.exit(f"generate.py: {e}")
    if not hosts:
        variable = "SLURM_JOB_NODELIST" if args.scheduler == "slurm" else "PBS_NODEFILE"
        sys.exit(f"generate.py: ${variable} is not set: run this inside a {args.scheduler.upper()} job")
    if args.format == "hosts":
        print(",".join(f"{host}:{slots}" for host, slots in hosts))
    else:
        print("\n".join(f"{host} slots={slots}" for host, slots in hosts))


if __name__ == "__main__":
    main()
