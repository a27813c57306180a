"""A rank's GPU and its model, as the app sets them up, on a GPU machine (tests/launch/test_gpu.py).

    gpu_model.py OUT_DIR [train_hvd.py flags, e.g. --model resnet18 --sync-bn]

hvd_utils.init() pins the device, hvd_train.training.build_model_for makes the configured model on it (3x32x32 images,
10 classes). One training-mode forward pass then feeds rank r images of value r + 1 plus noise, so the ranks' batches
differ. Each rank writes OUT_DIR/rank<r>.json: its ranks, the device the app chose, torch's current device, where the
parameters live, the classes of the normalization layers, and for the first BatchNorm the per-channel mean of its
input on this rank and its running mean after the pass.
"""
import json
import sys

import horovod.torch as hvd
import torch

import hvd_utils
from hvd_train.config import parse_config
from hvd_train.data import DataInfo
from hvd_train.training import build_model_for


def main(out_dir, argv):
    cfg = parse_config(argv)
    rt = hvd_utils.init(cpu=cfg.run.device == "cpu")
    torch.manual_seed(0)
    model = build_model_for(cfg, DataInfo(3, 10, 32, 0, 0), rt.device)
    hvd_utils.broadcast_state(model, torch.optim.SGD(model.parameters(), lr=0.1), root_rank=0)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    record = {"rank": rt.rank, "size": rt.size, "local_rank": hvd.local_rank(), "device": str(rt.device),
              "current_device": torch.cuda.current_device() if rt.device.type == "cuda" else None,
              "tensor_ops": rt.tensor_ops,
              "nccl_built": bool(hvd.nccl_built()),
              "param_devices": sorted({str(p.device) for p in model.parameters()}),
              "norm_classes": sorted({f"{type(m).__module__}.{type(m).__name__}" for m in norms}),
              "sync_bn_layers": sum(isinstance(m, hvd.SyncBatchNorm) for m in norms), "norm_layers": len(norms)}
    if norms:
        first, seen = norms[0], []
        first.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().float().mean(dim=(0, 2, 3))))
        gen = torch.Generator().manual_seed(rt.rank)
        images = torch.full((8, 3, 32, 32), float(rt.rank + 1)) + torch.rand(8, 3, 32, 32, generator=gen)
        model.train()
        model(images.to(rt.device))
        record.update(local_input_mean=seen[0].tolist(), running_mean=first.running_mean.tolist(),
                      momentum=first.momentum)
    with open(f"{out_dir}/rank{rt.rank}.json", "w") as f:
        json.dump(record, f)
    hvd_utils.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
