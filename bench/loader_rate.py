"""Images per second one rank's training loader delivers (rank 0 of 2), with the app's data code and nothing else:
no model, no step. bench/run.py's data section compares it with what a training step consumes.

    python bench/loader_rate.py --source imagefolder --data-dir photos --workers 2 --out rate.json
    python bench/loader_rate.py --source shards --data-dir shards --workers 1 --out rate.json
"""
import argparse
import glob
import json
import os
import time

from common import ROOT  # noqa: F401  (puts the app on the path)
from hvd_train.data import LoaderSpec, build_loaders
from hvd_train.config import DataConfig
from hvd_train.data import build_datasets


def datasets(source, data_dir, image_size):
    if source == "shards":
        names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(data_dir, "*.tar")))
        last = {split: max(n for n in names if n.startswith(split)) for split in ("train", "val")}
        dc = DataConfig(dataset="shards", image_size=image_size,
                        train_shards=f"{data_dir}/train-{{000000..{last['train'][6:12]}}}.tar",
                        val_shards=f"{data_dir}/val-{{000000..{last['val'][4:10]}}}.tar")
    else:
        dc = DataConfig(dataset=source, data_dir=data_dir, image_size=image_size)
    return build_datasets(dc)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", choices=("imagefolder", "shards"), required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2, help="batches not timed (workers start, files get cached)")
    p.add_argument("--batches", type=int, default=10, help="batches timed")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    train, val, _ = datasets(args.source, args.data_dir, args.image_size)
    spec = LoaderSpec(args.batch_size, 0, args.workers, image_size=args.image_size)
    loader, _, sampler = build_loaders(train, val, spec, rank=0, world_size=2)
    seen, epoch, start, images = 0, 1, None, 0
    while seen < args.warmup + args.batches:
        sampler.set_epoch(epoch)
        for batch, _ in loader:
            seen += 1
            if seen == args.warmup:
                start = time.perf_counter()
            elif seen > args.warmup:
                images += len(batch)
            if seen == args.warmup + args.batches:
                break
        epoch += 1
    rate = images / (time.perf_counter() - start)
    with open(args.out, "w") as f:
        json.dump({"img_per_sec": rate, "source": args.source, "workers": args.workers}, f)


if __name__ == "__main__":
    main()
