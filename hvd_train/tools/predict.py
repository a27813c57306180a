"""hvd-train predict: the top classes of image files, from a checkpoint, a run directory or an export.

    hvd-train predict runs/cifar10 photos/cat.png photos/more/        # a table: image, top-k classes
    hvd-train predict runs/cifar10/export/model.onnx photos/ --json   # one JSON document

Each image is prepared as the run's validation prepared its samples (the model card's preprocessing: channels,
size, normalisation), so a prediction here is what validation would have made of the same picture.
"""
import argparse
import json
import os
import sys

import torch

from hvd_train.data.errors import UNREADABLE_IMAGE
from hvd_train.data.imagefolder import is_image_file
from hvd_train.errors import CheckpointError, ConfigError, say
from hvd_train.tools.inference import load_runner
from hvd_train.trust import TRUST_FLAG

BATCH = 64


class InputError(Exception):
    """An image argument that is missing, empty or not an image."""


def parse_args(argv):
    p = argparse.ArgumentParser(prog="hvd-train predict", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a run's output directory, a checkpoint, or an export (model.safetensors, "
                   "model.torchscript.pt, model.onnx, with the .json hvd-train export wrote beside it)")
    p.add_argument("images", nargs="+", help="image files, or folders whose image files (recursively) are read")
    p.add_argument("--top-k", type=int, default=5, help="classes shown per image (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--max-memory-mb", type=int, default=None, metavar="MB",
                   help="memory an ONNX model may take (default: 4 times its file plus 64 times a batch's input, at "
                   "least 256 MB): an ONNX graph says what to allocate, and is data")
    p.add_argument(TRUST_FLAG, action="store_true", dest="trust_code",
                   help="let the checkpoint or export name code (your own model as an import path); a model file "
                   "is data otherwise (docs/reliability.md: What is code and what is data)")
    args = p.parse_args(argv)
    if args.top_k < 1:
        p.error(f"--top-k {args.top_k}: must be 1 or more")
    if args.max_memory_mb is not None and not 1 <= args.max_memory_mb <= 2**30:
        p.error(f"--max-memory-mb {args.max_memory_mb}: give a number of megabytes from 1 up")
    return args


def image_files(arguments):
    """Every image file the arguments name, in order: files as given, folders' image files sorted."""
    files = []
    for arg in arguments:
        if os.path.isdir(arg):
            found = sorted(os.path.join(root, name) for root, dirs, names in os.walk(arg) for name in names
                           if is_image_file(os.path.join(root, name)))
            if not found:
                raise InputError(f"{arg}: a folder with no image files (.jpg, .png, ...) in it")
            files += found
        elif os.path.isfile(arg):
            files.append(arg)
        else:
            raise InputError(f"{arg}: no such file or folder")
    return files


def load_images(files, preprocessing):
    tensors = []
    for path in files:
        try:
            tensors.append(preprocessing.load(path))
        except UNREADABLE_IMAGE as e:  # PIL's ways of saying "not an image I can read"
            raise InputError(f"{path}: cannot read this image ({e}); give image files (.jpg, .png, ...)") from None
    return torch.stack(tensors)


def predict(args):
    run, card = load_runner(args.model, args.trust_code, args.max_memory_mb and args.max_memory_mb * 2**20)
    if card.task != "classification":
        raise InputError(f"{args.model}: predict gives the classes of image files, so it needs an image classifier "
                         f"trained with the classification task (the default --task); this model was trained with "
                         f"--task {card.task}. Run it on your own inputs from an export: hvd-train export "
                         f"{args.model} --format onnx")
    preprocessing = card.prepare()
    files = image_files(args.images)
    results = []
    for start in range(0, len(files), BATCH):
        chunk = files[start:start + BATCH]
        probs = torch.softmax(run(load_images(chunk, preprocessing))[0].float(), dim=1)
        top = probs.topk(min(args.top_k, probs.shape[1]), dim=1)
        for path, values, indices in zip(chunk, top.values.tolist(), top.indices.tolist()):
            results.append({"image": path, "top": [{"class": card.class_name(i), "index": i, "probability": p}
                                                   for p, i in zip(values, indices)]})
    return results


def table(results):
    width = max(len("image"), *(len(r["image"]) for r in results))
    k = len(results[0]["top"])
    lines = [f"{'image':<{width}}  " + "  ".join(f"top-{i + 1:<14}" for i in range(k)).rstrip()]
    for r in results:
        cells = [f"{t['class'][:12]} {100 * t['probability']:.1f}%" for t in r["top"]]
        lines.append(f"{r['image']:<{width}}  " + "  ".join(f"{c:<18}" for c in cells).rstrip())
    return "\n".join(lines)


def main(argv):
    args = parse_args(argv)
    try:
        results = predict(args)
    except (CheckpointError, ConfigError, InputError) as e:
        say(f"hvd-train predict: error: {e}")
        return 2
    print(json.dumps(results, indent=2) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
