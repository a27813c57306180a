"""The peer of the recipe section: the same training recipe through timm's own components in a plain one-process
PyTorch loop (no Horovod, no hvd-train engine), on the same digits split, for the same epochs.

It takes from the app only the model registry and the digits' pixels and split (data, not training code); the
transforms, mixing, loss, average of the weights and optimizer are timm's and torch's, called as timm's train.py
calls them.
"""
import argparse
import json
import math
import random

import numpy as np
import torch
import torch.nn.functional as F

import common  # noqa: F401  (puts the project on sys.path)
from hvd_train.data.augment import ThroughPIL, fix_posterize
from hvd_train.data.catalog import read_digits
from hvd_train.data.samplers import split_indices
from hvd_train.models import build_model


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--val-fraction", type=float, default=0.75)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.025)
    p.add_argument("--aa", default="rand-m9-mstd0.5-inc1")
    p.add_argument("--reprob", type=float, default=0.25)
    p.add_argument("--mixup", type=float, default=0.2)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--out", default="")
    args = p.parse_args()
    from timm.data import Mixup
    from timm.data.auto_augment import rand_augment_transform
    from timm.data.random_erasing import RandomErasing
    from timm.loss import SoftTargetCrossEntropy
    from timm.utils import ModelEmaV3
    from torchvision.transforms import v2 as T

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.set_num_threads(1)
    images, labels = read_digits()
    x = F.interpolate(torch.from_numpy(images).unsqueeze(1) / 16.0, size=args.image_size, mode="bilinear",
                      antialias=True)
    y = torch.from_numpy(labels)
    train_idx, val_idx = split_indices(len(y), args.val_fraction, 0)  # the app's split (data.split_seed 0)
    fix_posterize()
    size = args.image_size
    steps = [T.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1))]
    if args.aa:
        policy = rand_augment_transform(args.aa, {"translate_const": int(size * 0.45), "img_mean": (0, 0, 0)})
        steps.append(ThroughPIL(policy))
    augment = T.Compose(steps)
    erase = RandomErasing(args.reprob, mode="pixel", device="cpu")
    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing, num_classes=10)
    model = build_model("small_cnn", 1, 10, size)
    ema = ModelEmaV3(model, decay=args.ema_decay, use_warmup=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = SoftTargetCrossEntropy()
    # timm's training loader drops the last incomplete batch (drop_last=True), as the app does by default.
    steps_per_epoch = len(train_idx) // args.batch_size
    step = 0
    for epoch in range(args.epochs):
        model.train()
        order = [train_idx[i] for i in torch.randperm(len(train_idx)).tolist()]
        for start in range(0, steps_per_epoch * args.batch_size, args.batch_size):
            batch = order[start:start + args.batch_size]
            xb = torch.stack([erase(augment(x[i])) for i in batch])
            yb = y[batch]
            if len(batch) % 2:  # timm's Mixup needs an even batch
                xb, yb = xb[:-1], yb[:-1]
            xb, targets = mixup(xb, yb) if args.mixup or args.cutmix else (xb, F.one_hot(yb, 10).float())
            for group in optimizer.param_groups:  # cosine over the steps, as the app's default schedule
                group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / (args.epochs * steps_per_epoch)))
            loss = loss_fn(model(xb), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            ema.update(model, step=step)
    result = {name: top1(m, x[val_idx], y[val_idx]) for name, m in (("model", model), ("ema", ema.module))}
    result["best"] = max(result.values())
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)


@torch.no_grad()
def top1(model, x, y):
    model.eval()
    return 100.0 * (model(x).argmax(1) == y).float().mean().item()


if __name__ == "__main__":
    main()
