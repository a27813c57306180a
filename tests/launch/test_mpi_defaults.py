"""The OpenMPI-side defaults hvd_utils.runtime sets for CPU jobs, checked in real 2-rank horovodrun jobs."""
import pytest

from conftest import launch, read_json

# Each rank starts Horovod the app's way, then asks glibc whether a 64 MB malloc got a mapping of its own (mallinfo2's
# hblks, the blocks mapped for one allocation each and unmapped on free, goes up by one) or came from the kept heap.
PROBE = """
import ctypes, json, os
import hvd_utils

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

rt = hvd_utils.init(cpu=True)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2().hblks
block = libc.malloc(64 << 20)
mapped = libc.mallinfo2().hblks - before
libc.free(block)
with open(os.path.join(os.environ["PROBE_DIR"], f"rank{rt.rank}.json"), "w") as f:
    json.dump({"rank": rt.rank, "mapped_blocks": mapped, "yield": os.environ.get("OMPI_MCA_mpi_yield_when_idle")}, f)
hvd_utils.shutdown()
"""


def probe(tmp_path, launcher, env=None):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    launch(launcher, 2, script, env={"PROBE_DIR": str(tmp_path), **(env or {})})
    return [read_json(tmp_path / f"rank{rank}.json") for rank in (0, 1)]


@pytest.mark.distributed
def test_an_mpi_launch_on_cpus_reuses_freed_memory_instead_of_mapping_large_blocks_afresh(tmp_path):
    for rank in probe(tmp_path, "horovodrun-mpi"):
        assert rank["mapped_blocks"] == 0  # OpenMPI's per-call scratch buffer comes from the kept heap
        assert rank["yield"] == "1"


@pytest.mark.distributed
@pytest.mark.parametrize("launcher, env", [("horovodrun-mpi", {"MALLOC_ARENA_MAX": "4"}),
                                           ("horovodrun-gloo", None)])
def test_glibc_malloc_is_left_alone_when_the_user_set_it_or_under_gloo(tmp_path, launcher, env):
    for rank in probe(tmp_path, launcher, env):
        assert rank["mapped_blocks"] >= 1  # glibc's default: a 64 MB block gets its own mapping
