"""hvd-train doctor's network rows from their inputs: NCCL_DEBUG=INFO's log as horovodrun relays it (captured text:
this machine has no GPU), the figures the bandwidth job prints, and the links' nominal rates. (The bandwidth job
itself, over real and shaped links between namespace hosts: tests/cluster/test_doctor.py.)"""
import json

from hvd_train.tools import doctor_network as net

# Two hosts' NCCL 2.2x start-up lines under horovodrun: gpu-a found its HCAs, gpu-b fell back to sockets.
NCCL_LOG = """\
[0]<stdout>:gpu-a:1811:1811 [0] NCCL INFO Bootstrap : Using ib0:10.1.0.11<0>
[0]<stdout>:gpu-a:1811:1811 [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so)
[0]<stdout>:gpu-a:1811:1893 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.1.0.11<0>
[0]<stdout>:gpu-a:1811:1893 [0] NCCL INFO Using network IB
[1]<stdout>:gpu-b:2290:2290 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.12<0>
[1]<stdout>:gpu-b:2290:2371 [0] NCCL INFO NET/IB : No device found.
[1]<stdout>:gpu-b:2290:2371 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.12<0>
[1]<stdout>:gpu-b:2290:2371 [0] NCCL INFO Using network Socket
[1]<stdout>:gpu-b:2290:2371 [0] NCCL INFO ncclCommInitRank comm 0x55d0c0 rank 1 nranks 2 cudaDev 0 - Init COMPLETE
"""


def test_the_network_nccl_chose_is_read_per_host_from_its_log():
    assert net.nccl_networks(NCCL_LOG) == {"gpu-a": "IB", "gpu-b": "Socket"}
    bare = [line.split(":", 1)[1] for line in NCCL_LOG.splitlines()]
    # horovodrun --mpi's prefixes: Open MPI's --tag-output, MPICH's -l; and none at all
    for prefix in ("[1,0]<stdout>:", "[0] ", ""):
        assert net.nccl_networks("\n".join(prefix + line for line in bare)) == {"gpu-a": "IB", "gpu-b": "Socket"}
    # A plug-in's network of several words; a host name with its domain (NCCL prints the name up to its first dot)
    line = "[0]<stdout>:gpu-e.cluster.example:77:79 [0] NCCL INFO Using network AWS Libfabric\r\n"
    assert net.nccl_networks(line) == {"gpu-e": "AWS Libfabric"}


def test_sockets_on_a_host_with_infiniband_are_warned_of_naming_the_variable():
    status, detail, fix = net.nccl_row("gpu-b", "Socket", ["mlx5_0", "mlx5_1"], {})
    assert status == "WARN" and detail == "NCCL uses Socket although gpu-b has mlx5_0, mlx5_1"
    assert "NCCL_IB_HCA=mlx5_0,mlx5_1" in fix and "libibverbs" in fix
    status, _, fix = net.nccl_row("gpu-b", "Socket", ["mlx5_0"], {"NCCL_IB_DISABLE": "1"})
    assert status == "WARN" and fix == "unset NCCL_IB_DISABLE (it is 1 on gpu-b)"
    assert net.nccl_row("gpu-a", "IB", ["mlx5_0"], {})[0] == "ok"
    assert net.nccl_row("gpu-e", "AWS Libfabric", ["efa_0"], {})[0] == "ok"  # EFA is listed with InfiniBand
    assert net.nccl_row("gpu-c", "Socket", [], {})[:2] == ("ok", "NCCL uses Socket; the host has no InfiniBand or "
                                                                 "RoCE device")
    assert net.nccl_row("gpu-d", None, ["mlx5_0"], {})[0] == "WARN"


def result(busbw_bytes):
    return {"hosts": ["a", "b"], "bytes": 64 << 20, "seconds": 0.5, "busbw": busbw_bytes, "device": "cuda",
            "controller": "MPI"}


def test_a_bandwidth_far_below_the_slowest_link_s_rate_is_warned_of():
    # 25 GbE links; 1.25 GB/s on the wire is 10 Gb/s: 40%, fine. 100 MB/s is 0.8 Gb/s: 3%.
    status, detail, fix = net.bandwidth_row(result(1.25e9), [25000, 25000])
    assert status == "ok" and "10.00 Gb/s bus bandwidth (64 MB in 500 ms, MPI, 2 hosts, CUDA tensors)" in detail
    assert "40% of the slowest link's nominal 25.00 Gb/s" in detail and fix == ""
    status, detail, fix = net.bandwidth_row(result(100e6), [25000, 100000])
    assert status == "WARN" and "3% of the slowest link's nominal 25.00 Gb/s" in detail
    assert "--network-interface" in fix
    status, detail, _ = net.bandwidth_row(result(100e6), [None, None])
    assert status == "ok" and detail.endswith("the link's nominal rate is not readable here")


def test_the_figures_are_read_from_a_line_another_rank_ran_into_and_nothing_else_is_taken():
    figures = result(1e9)
    line = net.MARKER + json.dumps(figures) + "[1] some other rank's output"
    assert net.read_result("noise\n" + line + "\n") == figures
    assert net.read_result(net.MARKER + '{"bytes": "x"}') is None
    assert net.read_result(net.MARKER + json.dumps({**figures, "seconds": float("inf")})) is None
    assert net.read_result(net.MARKER + json.dumps({**figures, "device": None})) is None
    assert net.read_result(net.MARKER + "[1, 2]") is None
    assert net.read_result("nothing here") is None
