"""A cost model of one data-parallel training step, to predict scaling efficiency beyond this machine.

step = forward + backward + exposed communication + latency + straggler wait, where
  communication  = ring allreduce of the gradients: inside a node over NVLink, then between nodes over the network,
                   each 2(k-1)/k x S / B for k participants, S gradient bytes, B the link's achievable bandwidth;
  exposed        = what backward cannot hide: max(0, communication - overlap x backward), since gradients are sent
                   while later layers are still computing, except the ones that come last;
  latency        = 2(k-1) hops x per-hop latency, for each fused buffer (S / fusion threshold), plus Horovod's
                   cycle (half a cycle on average before the first allreduce starts);
  straggler wait = every step waits for the slowest of n ranks: with per-step time jitter of coefficient of variation
                   c, the expected maximum of n is about mean x (1 + c x sqrt(2 ln n)).
efficiency(n) = single-GPU step / step(n).

Measured here: resnet50's gradient bytes and its backward/forward time ratio. Published inputs: GPU throughput
(NVIDIA's ResNet-50 AMP on one A100, about 2,470 images/s at batch 256), link speeds. No GPU was
available to this project's machine, so the GPU compute time is the published one.

    python bench/scaling_model.py            # measures resnet50 here (about a minute), writes docs/scaling.png
"""
import argparse
import json
import math
import os
import statistics
import time

from common import ROOT

GBIT = 1e9 / 8  # bytes/s in one Gb/s

NETWORKS = {  # name: (bytes/s per node, per-hop latency in s); achievable ~ 90% of the line rate for large messages
    "25 Gb/s Ethernet": (0.9 * 25 * GBIT, 25e-6),
    "200 Gb/s InfiniBand": (0.9 * 200 * GBIT, 3e-6),
}
NVLINK = 0.8 * 300e9      # bytes/s, one direction, A100 NVLink 3 (inside a node)
GPUS_PER_NODE = 8


def allreduce_seconds(nbytes, gpus, gpus_per_node, net_bw, net_lat, fusion_bytes):
    """Hierarchical ring allreduce: inside each node over NVLink, then across nodes over the network."""
    nodes = max(1, gpus // gpus_per_node)
    local = min(gpus, gpus_per_node)
    buffers = max(1, math.ceil(nbytes / fusion_bytes))
    t = 0.0
    if local > 1:
        t += 2 * (local - 1) / local * nbytes / NVLINK + buffers * 2 * (local - 1) * 2e-6
    if nodes > 1:
        t += 2 * (nodes - 1) / nodes * nbytes / net_bw + buffers * 2 * (nodes - 1) * net_lat
    return t


def step_seconds(gpus, fwd, bwd, nbytes, net, *, overlap=0.8, jitter=0.0, cycle=1e-3, fusion=128 << 20,
                 gpus_per_node=GPUS_PER_NODE):
    if gpus == 1:
        return fwd + bwd
    bw, lat = NETWORKS[net]
    comm = allreduce_seconds(nbytes, gpus, gpus_per_node, bw, lat, fusion)
    exposed = max(0.0, comm - overlap * bwd)
    straggle = (fwd + bwd) * jitter * math.sqrt(2 * math.log(gpus))
    return fwd + bwd + exposed + cycle / 2 + straggle


def efficiency(gpus, fwd, bwd, nbytes, net, **kw):
    return (fwd + bwd) / step_seconds(gpus, fwd, bwd, nbytes, net, **kw)


def measure_resnet50(batch=8, repeats=3):
    """Forward and backward seconds of torchvision's resnet50 at 224 px on this machine (median of repeats)."""
    import torch
    import torch.nn.functional as F

    from hvd_train.models import build_model

    model = build_model("resnet50", 3, 1000, 224)
    x, y = torch.rand(batch, 3, 224, 224), torch.randint(0, 1000, (batch,))
    fwds, bwds = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if i:  # the first is a warm-up
            fwds.append(t1 - t0)
            bwds.append(t2 - t1)
    params = sum(p.numel() for p in model.parameters())
    return {"batch": batch, "forward_s": statistics.median(fwds), "backward_s": statistics.median(bwds),
            "params": params, "grad_bytes": params * 4, "threads": torch.get_num_threads()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu-img-per-sec", type=float, default=2470.0, help="one GPU's images/s (published A100 AMP)")
    p.add_argument("--gpu-batch", type=int, default=256)
    p.add_argument("--jitter", type=float, default=0.02,
                   help="per-step coefficient of variation of compute time across ranks (2%%: see docs/scaling.md)")
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "scaling.png"))
    p.add_argument("--json", default=os.path.join(ROOT, "docs", "scaling.json"))
    args = p.parse_args()

    m = measure_resnet50()
    bwd_ratio = m["backward_s"] / m["forward_s"]
    gpu_step = args.gpu_batch / args.gpu_img_per_sec
    fwd, bwd = gpu_step / (1 + bwd_ratio), gpu_step * bwd_ratio / (1 + bwd_ratio)
    S = m["grad_bytes"]
    counts = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    table = {}
    for net in NETWORKS:
        for label, nbytes in (("fp32 gradients", S), ("fp16 compression", S / 2)):
            table[f"{net}, {label}"] = {n: efficiency(n, fwd, bwd, nbytes, net, jitter=args.jitter) for n in counts}
            table[f"{net}, {label}, no jitter"] = {n: efficiency(n, fwd, bwd, nbytes, net) for n in counts}

    # Horovod's published check: ResNet-101 on Pascal GPUs, 4 per server, 25 Gb/s RoCE, about 90% at 512.
    p100_step, r101_bytes = 64 / 130.0, 44.5e6 * 4
    check = {n: efficiency(n, p100_step / (1 + bwd_ratio), p100_step * bwd_ratio / (1 + bwd_ratio), r101_bytes,
                           "25 Gb/s Ethernet", jitter=args.jitter, gpus_per_node=4, fusion=64 << 20)
             for n in counts}
    check_no_jitter = {n: efficiency(n, p100_step / (1 + bwd_ratio), p100_step * bwd_ratio / (1 + bwd_ratio),
                                     r101_bytes, "25 Gb/s Ethernet", gpus_per_node=4, fusion=64 << 20)
                       for n in counts}
    out = {"measured_here": m, "backward_over_forward": bwd_ratio, "gpu_step_s": gpu_step, "jitter": args.jitter,
           "efficiency": table, "horovod_check_resnet101_p100": check,
           "horovod_check_resnet101_p100_no_jitter": check_no_jitter}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2, sort_keys=True)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, series in table.items():
        if "no jitter" in name:
            continue
        ax.plot(counts, [100 * series[n] for n in counts], marker="o", label=f"ResNet-50 A100 AMP, {name}")
    ax.plot(counts, [100 * check[n] for n in counts], "k--", label="ResNet-101 P100, 25 Gb/s (Horovod's setup)")
    ax.scatter([512], [90], color="k", zorder=5, label="Horovod's published ~90% at 512")
    ax.set(xscale="log", xlabel="GPUs", ylabel="scaling efficiency, %", ylim=(0, 105),
           title="Predicted scaling efficiency (docs/scaling.md)")
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(json.dumps({"backward_over_forward": round(bwd_ratio, 2), "resnet50_cpu_fwd_s": round(m["forward_s"], 3),
                      "resnet50_cpu_bwd_s": round(m["backward_s"], 3), "grad_mb": round(S / 2**20, 1),
                      "at": {k: {n: round(100 * v[n], 1) for n in (8, 64, 512)} for k, v in table.items()},
                      "horovod_check": {n: round(100 * check[n], 1) for n in (8, 64, 512)},
                      "horovod_check_no_jitter": {n: round(100 * check_no_jitter[n], 1) for n in (8, 64, 512)}},
                     indent=1))


if __name__ == "__main__":
    main()
