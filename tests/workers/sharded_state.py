"""A checkpoint's optimizer state through hvd_utils' sharded optimizer on however many ranks run this:

    sharded_state.py CHECKPOINT BUCKET_MB

Every rank builds the checkpoint's model and an optimizer of its kind, sharded (ZeRO-1) in buckets of BUCKET_MB;
rank 0 alone loads the checkpoint's state (as a resumed run does), hvd_utils.broadcast_state deals it out, and
state_dict() gathers it back. Rank 0 prints whether that equals the checkpoint's state exactly, and how many state
bytes each rank holds.
"""
import sys

import horovod.torch as hvd
import torch

import hvd_utils
from hvd_utils.zero import ShardedOptimizer
from hvd_train.config import config_from_dict
from hvd_train import training
from hvd_train.data import build_datasets


def main():
    hvd_utils.init()
    ckpt = torch.load(sys.argv[1], weights_only=True, map_location="cpu")
    cfg = config_from_dict(ckpt["config"])
    info = build_datasets(cfg.data, cfg.run.seed, None)[2]
    model = training.build_model_for(cfg, info, torch.device("cpu"))
    optimizer = ShardedOptimizer(training.build_optimizer(model, cfg.optim, 0.1), bucket_mb=float(sys.argv[2]))
    if hvd.rank() == 0:
        optimizer.load_state_dict(ckpt["optimizer"])
    hvd_utils.broadcast_state(model, optimizer)
    gathered = optimizer.state_dict()
    held = [h for h, in hvd_utils.gather_floats([hvd_utils.optimizer_state_bytes(optimizer)], "held")]
    if hvd.rank() == 0:
        saved = ckpt["optimizer"]
        same = gathered["param_groups"] == saved["param_groups"] and sorted(gathered["state"]) == sorted(saved["state"])
        for pid, entry in saved["state"].items():
            for key, value in entry.items():
                mine = gathered["state"][pid][key]
                same = same and (torch.equal(mine, value) if torch.is_tensor(value) else mine == value)
        whole = sum(v.numel() * v.element_size() for e in saved["state"].values() for v in e.values()
                    if torch.is_tensor(v))
        print(f"equal {same} whole {whole} held {' '.join(str(int(h)) for h in held)}", flush=True)


if __name__ == "__main__":
    main()
