"""Allreduce bandwidth between the processes of one job, for Horovod (MPI or Gloo) and torch.distributed (Gloo).

Two measurements, each printed as JSON by rank 0:
  sweep  one float32 tensor of each size from 4 KB to 64 MB: time per allreduce, algbw and busbw (nccl-tests);
  copy   no communication: one thread copying a float32 tensor of each size into another (torch's copy_), the
         machine's memory bandwidth that a 2-rank allreduce on one host is bounded by; run without a launcher;
  grads  one training step's gradients (the parameter shapes of --model), sent the way Horovod's
         DistributedOptimizer sends them: all queued at once, fused by Horovod within its fusion threshold and cycle
         time (set with HOROVOD_FUSION_THRESHOLD and HOROVOD_CYCLE_TIME); --fp16 compresses them first.

    horovodrun -np 2 -H localhost:2 --mpi python bench/allreduce.py --backend horovod --out hvd_mpi.json
    torchrun --standalone --nproc-per-node 2 bench/allreduce.py --backend torch --out torch_gloo.json
    python bench/allreduce.py --what copy --out copy.json
"""
import argparse
import time

import torch

from common import busbw, write_result

SIZES = [4 << 10 << (2 * i) for i in range(8)]  # 4 KB, 16 KB, ..., 64 MB


class Horovod:
    name = "horovod"

    def __init__(self):
        import hvd_utils

        self.hvd_utils, self.rt = hvd_utils, hvd_utils.init(cpu=True)
        self.rank, self.size, self.label = self.rt.rank, self.rt.size, f"horovod_{self.rt.controller.lower()}"

    def allreduce(self, tensors, fp16=False):
        return self.hvd_utils.allreduce_average(tensors, name="bench", fp16=fp16)

    def gather(self, value):
        return self.hvd_utils.gather_floats([value], name="bench_gather")

    def close(self):
        self.hvd_utils.shutdown()


class TorchGloo:
    name = "torch"

    def __init__(self):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        self.dist, self.rank, self.size, self.label = dist, dist.get_rank(), dist.get_world_size(), "torch_gloo"

    def allreduce(self, tensors, fp16=False):
        # What DDP does with a bucket: one in-place sum, then the division.
        works = [self.dist.all_reduce(t, async_op=True) for t in tensors]
        for t, work in zip(tensors, works):
            work.wait()
            t.div_(self.size)
        return tensors

    def gather(self, value):
        out = [None] * self.size
        self.dist.all_gather_object(out, [value])
        return out

    def close(self):
        self.dist.destroy_process_group()


def time_op(comm, tensors, min_seconds, min_iters, fp16=False):
    """Seconds per call of comm.allreduce(tensors), the slowest rank's (every rank does the same number of calls:
    the count is fixed from a first timed call agreed across ranks)."""
    comm.allreduce(tensors, fp16)  # warm-up: connections, buffers, Horovod's response cache
    start = time.perf_counter()
    comm.allreduce(tensors, fp16)
    first = max(v[0] for v in comm.gather(time.perf_counter() - start))
    iters = max(min_iters, int(min_seconds / max(first, 1e-6)))
    start = time.perf_counter()
    for _ in range(iters):
        comm.allreduce(tensors, fp16)
    return max(v[0] for v in comm.gather((time.perf_counter() - start) / iters))


def copy_sweep(sizes, min_seconds, min_iters):
    """Bytes/s of one thread's tensor copy at each size: the best of several timed batches, as a ceiling."""
    rows = []
    for nbytes in sizes:
        src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        dst.copy_(src)  # faults the pages in: an allreduce's buffers are not fresh either
        best = float("inf")
        deadline = time.perf_counter() + min_seconds
        while time.perf_counter() < deadline or best == float("inf"):
            start = time.perf_counter()
            for _ in range(min_iters):
                dst.copy_(src)
            best = min(best, (time.perf_counter() - start) / min_iters)
        rows.append({"bytes": nbytes, "seconds": best, "rate": nbytes / best})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("horovod", "torch"), help="sweep, grads: who allreduces")
    p.add_argument("--what", choices=("sweep", "grads", "both", "copy"), default="both")
    p.add_argument("--model", default="resnet18", help="grads: whose parameter shapes to send")
    p.add_argument("--fp16", action="store_true", help="grads: compress to fp16 (Horovod only)")
    p.add_argument("--max-bytes", type=int, default=SIZES[-1], help="sweep: largest size")
    p.add_argument("--min-seconds", type=float, default=0.3, help="time each size for about this long")
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    sizes = [s for s in SIZES if s <= args.max_bytes]
    if args.what == "copy":
        write_result(args.out, {"copy": copy_sweep(sizes, args.min_seconds, args.min_iters)})
        return
    if args.backend is None:
        p.error("--backend is required unless --what copy")
    comm = Horovod() if args.backend == "horovod" else TorchGloo()
    result = {"backend": comm.label, "world_size": comm.size}
    if args.what in ("sweep", "both"):
        result["sweep"] = []
        for nbytes in sizes:
            seconds = time_op(comm, [torch.ones(nbytes // 4)], args.min_seconds, args.min_iters)
            result["sweep"].append({"bytes": nbytes, "seconds": seconds, "algbw": nbytes / seconds,
                                    "busbw": busbw(nbytes, seconds, comm.size)})
    if args.what in ("grads", "both"):
        from hvd_train.models import build_model

        shapes = [q.shape for q in build_model(args.model, 3, 10, 32).parameters()]
        tensors = [torch.ones(s) for s in shapes]
        nbytes = sum(t.numel() * 4 for t in tensors)
        seconds = time_op(comm, tensors, args.min_seconds, args.min_iters, fp16=args.fp16)
        result["grads"] = {"model": args.model, "tensors": len(tensors), "bytes": nbytes, "fp16": args.fp16,
                           "seconds": seconds, "busbw": busbw(nbytes, seconds, comm.size)}
    if comm.rank == 0:
        write_result(args.out, result)
    comm.close()


if __name__ == "__main__":
    main()
