"""hvd-train predict: the top classes of image files, from a checkpoint, a run directory or an export.

    hvd-train predict runs/cifar10 photos/cat.png photos/more/        # a table: image, top-k classes
    hvd-train predict runs/cifar10/export/model.onnx photos/ --json   # one JSON document

Each image is prepared as the run's validation prepared its samples (the model card's preprocessing: channels,
size, normalisation), so a prediction here is what validation would have made of the same picture.
"""
import argparse
import json
import math
import os
import stat
import sys
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from hvd_train.data.folders import is_image_file
from hvd_train.data.images import kind_of
from hvd_train.errors import UNREADABLE_IMAGE, CheckpointError, ConfigError, say
from hvd_train.provenance import TRUST_FLAG
from hvd_train.tools.inference import ONNX_BYTES_PER_INPUT_BYTE, load_runner

if TYPE_CHECKING:
    from hvd_train.data.images import Preprocessing

BATCH = 64  # images run at once, at most
# What a batch may take without --max-memory-mb: its inputs and the model's work on them, estimated as for an ONNX
# model's cap (hvd_train/tools/inference.py: 64 bytes per byte of input). The card's image_size sizes each input
# (channels x image_size^2 floats): a card saying 3000 would make one 8 x 8 image take gigabytes.
MEMORY = 1024 * 2**20
MiB = 2**20


class InputError(Exception):
    """An image argument that is missing, empty or not an image."""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hvd-train predict", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a run's output directory, a checkpoint, or an export (model.safetensors, "
                   "model.torchscript.pt, model.onnx, with the .json hvd-train export wrote beside it)")
    p.add_argument("images", nargs="+", help="image files, or folders whose image files (recursively) are read")
    p.add_argument("--top-k", type=int, default=5, help="classes shown per image (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--max-memory-mb", type=int, default=None, metavar="MB",
                   help=f"memory a batch of images may take, its inputs and the model's work on them (estimated "
                   f"as {ONNX_BYTES_PER_INPUT_BYTE} times the inputs; default: {MEMORY // MiB} MB), where the "
                   f"model card's image_size sizes each input; and memory an ONNX model may take (default: 4 times "
                   f"its file plus {ONNX_BYTES_PER_INPUT_BYTE} times a batch's input, at least 256 MB): a model card "
                   f"and an ONNX graph are data")
    p.add_argument(TRUST_FLAG, action="store_true", dest="trust_code",
                   help="let the checkpoint or export name code (your own model as an import path), and run a "
                   "TorchScript export, which is a program (torch.jit.load runs its code). Without it a checkpoint, "
                   "a safetensors file and an ONNX file are read as data, and a TorchScript file is refused "
                   "(docs/reliability.md: What is code and what is data)")
    args = p.parse_args(argv)
    if args.top_k < 1:
        p.error(f"--top-k {args.top_k}: must be 1 or more")
    if args.max_memory_mb is not None and not 1 <= args.max_memory_mb <= 2**30:
        p.error(f"--max-memory-mb {args.max_memory_mb}: give a number of megabytes from 1 up")
    return args


def image_files(arguments: Sequence[str]) -> list[str]:
    """Every image file the arguments name, in order: files as given, folders' image files sorted. Anything that
    is not a regular file (a device, a FIFO, a socket, or a link to one) is refused by name."""
    files = []
    for arg in arguments:
        if os.path.isdir(arg):
            found = sorted(os.path.join(root, name) for root, dirs, names in os.walk(arg) for name in names
                           if is_image_file(os.path.join(root, name)))
            if not found:
                raise InputError(f"{arg}: a folder with no image files (.jpg, .png, ...) in it")
            files += [regular(path) for path in found]
        elif os.path.lexists(arg):
            files.append(regular(arg))
        else:
            raise InputError(f"{arg}: no such file or folder")
    return files


def regular(path: str) -> str:
    """`path`, where it is (or links to) a regular file; else InputError, in one line. (The reader checks what it
    opened again: data/images.py.)"""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror}); give image files (.jpg, .png, ...)") from None
    if not stat.S_ISREG(mode):
        raise InputError(f"{path}: {kind_of(mode)}, not a regular file; give image files (.jpg, .png, ...)")
    return path


def batch_size(preprocessing: "Preprocessing", memory: Optional[int] = None) -> int:
    """How many images predict runs at once: BATCH, or fewer where the card's input size needs it to keep the
    batch's inputs and the model's work on them (ONNX_BYTES_PER_INPUT_BYTE per byte of input) within `memory`
    bytes (--max-memory-mb; default MEMORY). InputError where one image alone passes it."""
    size, channels = preprocessing.image_size, preprocessing.channels
    per_image = channels * size * size * 4 * ONNX_BYTES_PER_INPUT_BYTE
    bound = memory or MEMORY
    if per_image > bound:
        raise InputError(f"the model card's preprocessing.image_size {size} makes each input {channels} x {size} x "
                         f"{size} floats, and the model's run on one image about {per_image / MiB:,.0f} MiB "
                         f"({ONNX_BYTES_PER_INPUT_BYTE} times its input), more than predict's bound of "
                         f"{bound / MiB:,.0f} MiB; pass --max-memory-mb {math.ceil(per_image / MiB)} (or more) if "
                         f"you trust this model to need that")
    return min(BATCH, bound // per_image)


def load_images(files: Sequence[str], preprocessing: "Preprocessing") -> torch.Tensor:
    tensors = []
    for path in files:
        try:
            tensors.append(preprocessing.load(path))
        except UNREADABLE_IMAGE as e:  # PIL's ways of saying "not an image I can read"
            raise InputError(f"{path}: cannot read this image ({e}); give image files (.jpg, .png, ...)") from None
    return torch.stack(tensors)


def predict(args: argparse.Namespace) -> list[dict[str, Any]]:
    run, card = load_runner(args.model, args.trust_code, args.max_memory_mb and args.max_memory_mb * 2**20)
    if card.task != "classification":
        raise InputError(f"{args.model}: predict gives the classes of image files, so it needs an image classifier "
                         f"trained with the classification task (the default --task); this model was trained with "
                         f"--task {card.task}. Run it on your own inputs from an export: hvd-train export "
                         f"{args.model} --format onnx")
    preprocessing = card.prepare()
    batch = batch_size(preprocessing, args.max_memory_mb and args.max_memory_mb * MiB)
    files = image_files(args.images)
    results = []
    for start in range(0, len(files), batch):
        chunk = files[start:start + batch]
        probs = torch.softmax(run(load_images(chunk, preprocessing))[0].float(), dim=1)
        top = probs.topk(min(args.top_k, probs.shape[1]), dim=1)
        for path, values, indices in zip(chunk, top.values.tolist(), top.indices.tolist()):
            results.append({"image": path, "top": [{"class": card.class_name(i), "index": i, "probability": p}
                                                   for p, i in zip(values, indices)]})
    return results


def table(results: list[dict[str, Any]]) -> str:
    width = max(len("image"), *(len(r["image"]) for r in results))
    k = len(results[0]["top"])
    lines = [f"{'image':<{width}}  " + "  ".join(f"top-{i + 1:<14}" for i in range(k)).rstrip()]
    for r in results:
        cells = [f"{t['class'][:12]} {100 * t['probability']:.1f}%" for t in r["top"]]
        lines.append(f"{r['image']:<{width}}  " + "  ".join(f"{c:<18}" for c in cells).rstrip())
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
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
