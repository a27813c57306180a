"""The device's half of the photo pipeline on a GPU (tests/launch/test_gpu.py): the workers' uint8 crops of a folder
against the same draws decoded by nvjpeg and cropped on cuda:0.

    gpu_photos.py FOLDER OUT.json

Writes, for training and for validation, the device the batch was made on and the mean, 99th percentile and largest
difference in levels of 0..255.
"""
import json
import pathlib
import sys

import torch

from hvd_train.data.augment import seed_all
from hvd_train.data.photos import PhotoTransform, collate_encoded, crop_batch, decode_batch


def main(folder, out):
    paths = sorted(str(p) for p in pathlib.Path(folder).glob("*/*.jpg"))
    record = {}
    for train in (True, False):
        plain, encoded = PhotoTransform(224, train), PhotoTransform(224, train).on_device()
        cpu, samples = [], []
        for i, path in enumerate(paths):
            seed_all(i)
            cpu.append(plain(path))
            seed_all(i)
            samples.append((encoded(path), 0))
        batch, _ = collate_encoded(samples)
        device = crop_batch(batch, decode_batch(batch, torch.device("cuda:0")))
        diff = (torch.stack(cpu).float() - device.cpu()).abs()
        record["train" if train else "val"] = {"device": str(device.device), "mean": float(diff.mean()),
                                               "p99": float(diff.flatten().quantile(0.99)), "max": float(diff.max())}
    pathlib.Path(out).write_text(json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:3])
