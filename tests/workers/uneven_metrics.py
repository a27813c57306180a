"""Validation metrics over a set that does not divide by the number of ranks.

    uneven_metrics.py OUT_DIR NUM_SAMPLES:BATCH_SIZE [NUM_SAMPLES:BATCH_SIZE ...]

The "model" is the identity and each sample's input is its logits, so the expected loss and accuracy are known
exactly. For each case, each rank writes OUT_DIR/<n>-<batch>-rank<r>.json with the globally reduced metrics it
computed (one job evaluates every case: the cases need no fresh start).
"""
import json
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import hvd_utils
from hvd_train.data import LoaderSpec, build_loaders
from hvd_train import trainer
from hvd_train.tasks import builtin_task


def fixed_samples(n):
    """Logits that predict class i % 10 for sample i; the label is right for the first half of the samples."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(n, 10, generator=gen)
    predicted = torch.arange(n) % 10
    logits[torch.arange(n), predicted] += 10.0
    labels = torch.where(torch.arange(n) < (n + 1) // 2, predicted, (predicted + 1) % 10)
    return logits, labels


def evaluate_case(rt, out_dir, n, batch):
    logits, labels = fixed_samples(n)
    dataset = TensorDataset(logits, labels)
    _, val_loader, _ = build_loaders(dataset, dataset, LoaderSpec(batch, seed=0), rt.rank, rt.size)
    task, cpu = builtin_task("classification"), torch.device("cpu")
    result = trainer.evaluate_all(nn.Identity(), task, val_loader, cpu)
    result["local_count"] = float(trainer.evaluate(nn.Identity(), task, val_loader, cpu).get("count", 0))
    with open(f"{out_dir}/{n}-{batch}-rank{rt.rank}.json", "w") as f:
        json.dump(result, f)


def main(out_dir, cases):
    rt = hvd_utils.init()
    for case in cases:
        n, batch = map(int, case.split(":"))
        evaluate_case(rt, out_dir, n, batch)
    hvd_utils.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
