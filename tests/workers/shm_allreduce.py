"""Horovod's allreduce on MPI, for each case the shared-memory path covers and some it leaves to MPI_Allreduce.

    shm_allreduce.py OUT_DIR

Rank r's tensor of n elements holds (i % 31) * (r + 1) + r at element i: whole numbers whose sums over 3 ranks stay
exact in every type here (below 256, bfloat16's limit), so every rank knows the exact sum; averages are checked to
each type's precision. Sizes cross the 1 MB block (one element past it, and
several blocks and a remainder). Each rank writes OUT_DIR/rank<r>.json: the cases whose result differed from the
exact sum or average, and a digest of every result, so the test can check that all ranks hold the same bits. Rank
0 adds, from Horovod's timeline, how each case was reduced: SHM_ALLREDUCE (shared memory) or MPI_ALLREDUCE.
"""
import hashlib
import json
import os
import sys

import horovod.torch as hvd
import torch

BLOCK = 1024 * 1024  # scripts/horovod/shm_allreduce.h's HVDT_SHM_BLOCK_BYTES
TYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "int32": torch.int32,
         "int64": torch.int64, "float16": torch.float16}


def values(count, rank, dtype):
    i = torch.arange(count, dtype=torch.int64)
    return ((i % 31) * (rank + 1) + rank).to(dtype)


def exact_sum(count, size, dtype):
    return sum(values(count, r, torch.float64) for r in range(size))


def counts(dtype):
    per_block = BLOCK // torch.tensor([], dtype=dtype).element_size()
    return [1, 7, 1000, per_block + 1, 3 * per_block + 5]


def cases(size):
    """(name, a callable that reduces under that name, the exact expected result in float64)."""
    rank = hvd.rank()
    for type_name, dtype in TYPES.items():
        for count in counts(dtype):
            mine = values(count, rank, dtype)
            yield (f"sum-{type_name}-{count}", lambda name, t=mine: hvd.allreduce(t, op=hvd.Sum, name=name),
                   exact_sum(count, size, dtype))
            if dtype.is_floating_point:  # in place, as DistributedOptimizer averages gradients
                yield (f"average-{type_name}-{count}",
                       lambda name, t=mine.clone(): hvd.allreduce_(t, op=hvd.Average, name=name),
                       exact_sum(count, size, dtype) / size)
    # Several tensors fused into one buffer; Min and Max, which MPI_Allreduce still does.
    sizes = (5, 300000, 70)
    grouped = [values(c, rank, torch.float32) for c in sizes]
    yield ("grouped_sum-float32-3", lambda name: torch.cat(hvd.grouped_allreduce(grouped, op=hvd.Sum, name=name)),
           torch.cat([exact_sum(c, size, torch.float32) for c in sizes]))
    mine = values(1000, rank, torch.float32)
    yield "max-float32-1000", lambda name: hvd.allreduce(mine, op=hvd.Max, name=name), values(1000, size - 1,
                                                                                              torch.float64)
    yield "min-float32-1000", lambda name: hvd.allreduce(mine, op=hvd.Min, name=name), values(1000, 0, torch.float64)


def reduced_by(timeline_path):
    """{tensor: the timeline's reduction activities for it}; Horovod names a tensor allreduce.<case>, and each of a
    group's grouped_allreduce.<case>_<i>of<n>."""
    with open(timeline_path) as f:
        events = json.load(f)
    tensors = {e["pid"]: e["args"]["name"].split(".", 1)[1] for e in events
               if e.get("name") == "process_name" and "name" in e.get("args", {})}
    found = {}
    for e in events:
        if e.get("ph") == "B" and e.get("name") in ("SHM_ALLREDUCE", "MPI_ALLREDUCE"):
            found.setdefault(tensors[e["pid"]], set()).add(e["name"])
    return {case: sorted(names) for case, names in found.items()}


def fill_dev_shm():
    """Fill /dev/shm (a small tmpfs of the test's own) after MPI has set up, as other programs can leave it."""
    with open("/dev/shm/hvd-test-filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))  # page by page, to the last one
        except OSError:  # ENOSPC: full
            pass


def main():
    out_dir = sys.argv[1]
    timeline = os.path.join(out_dir, "timeline.json")
    os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"  # so that it can be started after init, to a file of our choice
    hvd.init()
    if os.environ.get("HVD_TEST_FILL_DEV_SHM") == "1" and hvd.rank() == 0:
        fill_dev_shm()
    hvd.broadcast(torch.zeros(1), root_rank=0, name="filled")  # not an allreduce: the memory is not made yet
    hvd.start_timeline(timeline)
    wrong, digests = [], {}
    for name, run, expected in cases(hvd.size()):
        result = run(name)
        digests[name] = hashlib.sha256(result.view(torch.uint8).numpy().tobytes()).hexdigest()
        # An average is a sum scaled by 1/size, rounded to the type; a sum of these whole numbers is exact.
        rtol = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -24}.get(result.dtype, 0.0)
        if not torch.allclose(result.double(), expected.double(), rtol=rtol, atol=0.0):
            wrong.append(name)
    hvd.stop_timeline()
    report = {"size": hvd.size(), "wrong": wrong, "digests": digests}
    if hvd.rank() == 0:
        report["reduced_by"] = reduced_by(timeline)
    with open(os.path.join(out_dir, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(report, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
