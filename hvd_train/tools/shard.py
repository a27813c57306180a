"""hvd-train shard: write a data set (one that ships, or your own map-style one) as WebDataset tar shards and their
index (data/shard_writer.py), for training from them with --dataset shards.

    hvd-train shard --from imagefolder --data-dir photos/ --out shards/ --shard-size 5000
    hvd-train shard --from myproj.data:datasets --data-args size=64 --out shards/   # your factory, any samples
    horovodrun -np 8 ... train_hvd.py --dataset shards \\
        --data.train_shards 'shards/train-{000000..000099}.tar' --data.val_shards 'shards/val-{000000..000003}.tar'
"""
import argparse
import sys

from hvd_train.data import DataError
from hvd_train.data.catalog import DATASETS
from hvd_train.config import DataConfig, parse_mapping
from hvd_train.config.fields import MAX_IMAGE_SIDE
from hvd_train.datasets import build_datasets, dataset_factory
from hvd_train.errors import ConfigError
from hvd_train.plugins import is_import_path

SHIPPED = sorted(name for name in DATASETS if name not in ("synthetic", "shards"))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="hvd-train shard", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", required=True, metavar="DATASET",
                   help=f"the data set to write, read from --data-dir as for training: one of "
                   f"{', '.join(SHIPPED)}, or your own factory as package.module:name (its samples are written as "
                   f"they are: tensors, numbers, text, in tuples or dicts)")
    p.add_argument("--data-args", default={}, type=parse_mapping, metavar="KEY=VALUE,...",
                   help="keyword arguments for your own data set factory, as train_hvd.py --data-args")
    p.add_argument("--data-dir", default="datasets", help="where that data set is (default: %(default)s)")
    p.add_argument("--download", action="store_true", help="fetch it into --data-dir first where it is missing "
                   "(needs internet), as train_hvd.py --download does")
    p.add_argument("--out", required=True, help="the directory the shards and index.json go to (new or empty)")
    p.add_argument("--shard-size", type=int, default=10000, help="samples per shard (default: %(default)s); at "
                   "least one shard per rank: a job on N ranks needs N training shards or more")
    p.add_argument("--image-size", type=int, default=0, help="the facts' image size (0: the data set's own)")
    p.add_argument("--max-side", type=int, default=0, metavar="N",
                   help="photos (image folders): images longer than N pixels on their longer side are written "
                   "resized to N there (JPEG quality 90, PNG stays PNG); smaller files go as they are. Decoding then "
                   "costs what an image of that size costs, whatever the camera wrote (0: every file as it is; "
                   "recorded in the index)")
    p.add_argument("--val-fraction", type=float, default=0.2, help="held out where the data set has no split")
    p.add_argument("--split-seed", type=int, default=0, help="seed of that split")
    args = p.parse_args(argv)
    if args.source not in SHIPPED and not is_import_path(args.source):
        p.error(f"--from {args.source}: choose one of {', '.join(SHIPPED)}, or give your own data set factory as "
                f"package.module:name")
    if args.max_side < 0 or args.max_side > MAX_IMAGE_SIDE:
        p.error(f"--max-side {args.max_side}: give a side in pixels, 1 to {MAX_IMAGE_SIDE}, or 0 to keep every "
                f"file as it is (e.g. 512 for training at 224)")
    if args.shard_size < 1:
        p.error(f"--shard-size {args.shard_size}: must be a positive number of samples")
    return args


def main(argv):
    args = parse_args(argv)
    try:
        from hvd_train.data.shard_writer import write_shards

        fetch = getattr(dataset_factory(args.source), "download", None)
        if args.download and fetch is not None:
            fetch(args.data_dir)
        dc = DataConfig(dataset=args.source, data_dir=args.data_dir, image_size=args.image_size,
                        val_fraction=args.val_fraction, split_seed=args.split_seed, args=args.data_args)
        train, val, info = build_datasets(dc)
        index = write_shards(train, val, info, args.source, args.out, args.shard_size, args.max_side)
    except (DataError, ConfigError) as e:
        print(f"hvd-train shard: error: {e}", file=sys.stderr)
        return 2
    shards = index["shards"]
    for split in ("train", "val"):
        names = sorted(n for n in shards if n.startswith(f"{split}-"))
        print(f"{split}: {sum(shards[n] for n in names)} samples in {len(names)} shard(s): "
              f"--data.{split}_shards '{args.out.rstrip('/')}/{split}-{{{names[0][len(split) + 1:-4]}.."
              f"{names[-1][len(split) + 1:-4]}}}.tar'")
    print(f"index: {args.out.rstrip('/')}/index.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
