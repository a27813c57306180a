"""Every rank averages rank-dependent tensors with hvd_utils.allreduce_average (fused, and fp16-compressed) and
writes what it got; the test compares with the arithmetic mean."""
import json
import sys

import torch

import hvd_utils


def main(out):
    rt = hvd_utils.init(cpu=True)
    shapes = [(3,), (4, 5), (1000,), (2, 3, 3)]
    mine = [torch.full(s, float(rt.rank + 1)) + torch.arange(torch.Size(s).numel()).reshape(s) * 0.5
            for s in shapes]
    fused = hvd_utils.allreduce_average([t.clone() for t in mine], name="avg")
    half = hvd_utils.allreduce_average([t.clone() for t in mine], name="avg16", fp16=True)
    if rt.rank == 0:
        with open(out, "w") as f:
            json.dump({"size": rt.size, "fused": [t.flatten().tolist() for t in fused],
                       "fp16": [t.flatten().tolist() for t in half], "dtypes": [str(t.dtype) for t in half]}, f)
    hvd_utils.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
