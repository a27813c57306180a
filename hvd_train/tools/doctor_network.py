"""hvd-train doctor's network rows: the allreduce bandwidth between the hosts, measured through Horovod with one rank
a host and the controller the job will use, beside the link's nominal rate; on GPU hosts, the transport NCCL chose.

    horovodrun -np 2 -H host1:1,host2:1 [--gloo] python -m hvd_train.tools.doctor_network   (run by the doctor)

Each rank allreduces one float32 tensor (on its GPU where it has one, so that NCCL carries it), doubling its size
from 1 MB until one allreduce takes half a second or the tensor is 256 MB, then times three more; rank 0 prints one
JSON line. The bus bandwidth is nccl-tests' busbw: what each rank's link carried, 2 (n - 1) / n times the tensor per
allreduce for a ring, comparable with the link's rate whatever the number of hosts.
"""
import json
import math
import re
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

if TYPE_CHECKING:
    from types import ModuleType

START_BYTES, MAX_BYTES = 1 << 20, 256 << 20
LONG_ENOUGH_S = 0.5  # one allreduce this long is timed well by the clock, on any link
SLOW_SHARE = 0.1  # below this share of the link's nominal rate, the doctor warns
MARKER = "doctor-network: "

# NCCL_DEBUG=INFO's line for the network it chose, one per rank ("HOST:PID:TID [DEV] NCCL INFO Using network IB";
# HOST is the host name up to its first dot), after the launcher's prefix: horovodrun --gloo's "[RANK]<stdout>:",
# Open MPI's --tag-output "[1,RANK]<stdout>:", MPICH's -l "[RANK] ".
NCCL_NETWORK = re.compile(r"^(?:\[[\d,]+\](?:<std\w+>)?:?\s*)?(?P<host>[^\s:]+):\d+:\d+ \[\d+\] NCCL INFO Using "
                          r"network (?P<net>[^\r\n]+?)\s*$", re.M)


def measure_links() -> None:
    import hvd_utils

    hvd_utils.start()
    # On a GPU where this Horovod can reduce there (a CPU-only build would abort on a CUDA tensor).
    rt = hvd_utils.pin_to_local_rank(cpu=not hvd_utils.gpu_tensors_supported())
    hosts = hvd_utils.gather_objects(hvd_utils.host_name(), name="doctor.hosts")
    size = START_BYTES
    timed(hvd_utils, torch.ones(size // 4, device=rt.device))  # untimed: NCCL sets up its communicator in the first
    while True:
        tensor = torch.ones(size // 4, device=rt.device)
        seconds = timed(hvd_utils, tensor)
        if seconds >= LONG_ENOUGH_S or size >= MAX_BYTES:
            break
        size *= 2
    seconds = statistics.median(timed(hvd_utils, tensor) for _ in range(3))
    if rt.rank == 0:
        ring = 2 * (rt.size - 1) / rt.size
        print(MARKER + json.dumps({"hosts": hosts, "bytes": size, "seconds": seconds,
                                   "busbw": size * ring / seconds, "device": rt.device.type,
                                   "controller": rt.controller}), flush=True)
    hvd_utils.shutdown()


def timed(hvd_utils: "ModuleType", tensor: torch.Tensor) -> float:
    """Seconds for one allreduce of `tensor`, the same on every rank (the slowest rank's)."""
    if tensor.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    hvd_utils.allreduce_average([tensor], name=f"doctor.{tensor.numel()}")
    if tensor.is_cuda:
        torch.cuda.synchronize()
    return max(seconds for seconds, in hvd_utils.gather_floats([time.perf_counter() - start], name="doctor.seconds"))


def read_result(output: str) -> Optional[dict[str, Any]]:
    """The figures rank 0 printed, or None. (mpirun may run another rank's output into the same line: the object is
    read up to its end.)"""
    for line in output.splitlines():
        if MARKER not in line:
            continue
        try:
            result, _ = json.JSONDecoder().raw_decode(line.split(MARKER, 1)[1])
        except ValueError:
            continue
        if not isinstance(result, dict):
            continue
        numbers = [result.get(k) for k in ("bytes", "seconds", "busbw")]
        if all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in numbers) \
                and isinstance(result.get("hosts"), list) and result.get("device") in ("cpu", "cuda") \
                and isinstance(result.get("controller"), str):
            result["bytes"] = int(result["bytes"])
            return result
    return None


def nccl_networks(output: str) -> dict[str, str]:
    """{host (up to its first dot): the network NCCL said it uses there ("IB", "Socket", a plug-in's name)} from
    NCCL_DEBUG=INFO's log."""
    return {m["host"].split(".")[0]: m["net"] for m in NCCL_NETWORK.finditer(output)}


def rate(bits_per_s: float) -> str:
    return f"{bits_per_s / 1e9:.2f} Gb/s" if bits_per_s >= 1e9 else f"{bits_per_s / 1e6:.1f} Mb/s"


def bandwidth_row(result: dict[str, Any], speeds_mbit: Sequence[Optional[float]]) -> tuple[str, str, str]:
    """(status, detail, fix) of the allreduce row: `speeds_mbit` are the hosts' nominal link rates (Mb/s), None
    where a host's could not be read."""
    bits = result["busbw"] * 8
    detail = (f"{rate(bits)} bus bandwidth ({result['bytes'] >> 20} MB in {result['seconds'] * 1e3:.0f} ms, "
              f"{result['controller']}, {len(result['hosts'])} hosts, {result['device'].upper()} tensors)")
    known = [s for s in speeds_mbit if s]
    if not known:
        return "ok", detail + "; the link's nominal rate is not readable here", ""
    nominal = min(known) * 1e6
    detail += f", {bits / nominal:.0%} of the slowest link's nominal {rate(nominal)}"
    if bits >= SLOW_SHARE * nominal:
        return "ok", detail, ""
    return ("WARN", detail, "the hosts talk well below their links' rate: check that the job's interface is the "
            "fast one (--network-interface), that no other traffic or shaping (tc) shares it, and for GPUs the nccl "
            "row; a communication-bound job then gains from --bf16-allreduce and --batches-per-allreduce")


def nccl_row(host: str, network: Optional[str], infiniband: list[str],
             environment: dict[str, str]) -> tuple[str, str, str]:
    """(status, detail, fix) of a GPU host's nccl transport row: `infiniband` lists its /sys/class/infiniband
    devices, `environment` its NCCL_* variables."""
    if network is None:
        return "WARN", "NCCL said nothing of its network (no 'Using network' line)", \
            "run the job once with NCCL_DEBUG=INFO and read which network NCCL chose"
    if not network.lower().startswith("socket"):  # IB, or a plug-in's network (AWS Libfabric on EFA, ...)
        return "ok", f"NCCL uses {network}" + (f" ({', '.join(infiniband)})" if infiniband else ""), ""
    if not infiniband:
        return "ok", f"NCCL uses {network}; the host has no InfiniBand or RoCE device", ""
    if environment.get("NCCL_IB_DISABLE", "0") not in ("", "0"):
        fix = f"unset NCCL_IB_DISABLE (it is {environment['NCCL_IB_DISABLE']} on {host})"
    else:
        fix = (f"set NCCL_IB_HCA={','.join(infiniband)} for the job, and check that libibverbs (rdma-core) is "
               f"installed on {host} and, in a container, that /dev/infiniband is passed in")
    return "WARN", f"NCCL uses {network} although {host} has {', '.join(infiniband)}", fix


if __name__ == "__main__":
    sys.exit(measure_links())  # type: ignore[func-returns-value]
