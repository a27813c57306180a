"""The device's half of the photo pipeline on a GPU (tests/launch/test_gpu.py): the workers' uint8 crops of a folder
against the same draws decoded by nvjpeg and cropped on cuda:0.

    gpu_photos.py FOLDER OUT.json

Writes, for training and for validation, the device the batch was made on and the mean, 99th percentile and largest
difference in levels of 0..255.
"""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: the helpers the unit tests use
from formats import both_ways  # noqa: E402


def main(folder, out):
    paths = sorted(str(p) for p in pathlib.Path(folder).glob("*/*.jpg"))
    record = {}
    for train in (True, False):
        cpu, device = both_ways(paths, train, device="cuda:0")
        diff = (cpu.float() - device.cpu()).abs()
        record["train" if train else "val"] = {"device": str(device.device), "mean": float(diff.mean()),
                                               "p99": float(diff.flatten().quantile(0.99)), "max": float(diff.max())}
    pathlib.Path(out).write_text(json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:3])
