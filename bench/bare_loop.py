"""The bare PyTorch training loop the app is measured against: one process, no Horovod, no bookkeeping.

Same model, batch, optimizer (SGD, momentum 0.9), precision, memory format and threads as
`python train_hvd.py --benchmark`; the batch lives in memory, so only forward, backward and the optimizer step are
timed.

    python bench/bare_loop.py --model resnet18 --image-size 32 --batch-size 32 --threads 2
    python bench/bare_loop.py --device cuda --model resnet50 --image-size 224 --classes 1000 --batch-size 128 \\
        --amp bf16 --channels-last
"""
import torch

from common import fixed_batch, rate_summary, sgd_step, step_args, threads_for, timed_rates, write_result
from hvd_train.models import build_model, is_channels_last


def main():
    parser = step_args(__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: GPU 0, the clock read after the GPU has finished the timed steps")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible (torch.cuda.is_available() is False)")
    if args.amp == "fp16" and args.device != "cuda":
        parser.error("--amp fp16 needs --device cuda (as in the app; use --amp bf16 on the CPU)")
    device, sync = torch.device("cpu"), None
    if args.device == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        sync = torch.cuda.synchronize
    # The app's threads: on the CPU one share of the cores per process; on a GPU torch's own default.
    threads = (args.threads or torch.get_num_threads()) if args.device == "cuda" else threads_for(args.threads, 1)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model(args.model, args.channels, args.classes, args.image_size)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = sgd_step(model, optimizer, *fixed_batch(torch, args, device=device), amp=args.amp)
    rates = timed_rates(step, args.batch_size, args.num_warmup_batches, args.num_iters, args.num_batches_per_iter,
                        sync=sync)
    write_result(args.out, {"peer": "bare_loop", "model": args.model, "world_size": 1, "threads_per_rank": threads,
                            "device": str(device), "amp": args.amp, "channels_last": is_channels_last(model),
                            **rate_summary([rates])})


if __name__ == "__main__":
    main()
