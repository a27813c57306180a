"""hvd-train: data-parallel PyTorch training with Horovod.

Launch (every setting has a default, so each of these trains the small CNN on scikit-learn's digits):

    python train_hvd.py                                          # one process
    horovodrun -np 2 -H localhost:2 python train_hvd.py          # 2 ranks on this machine
    horovodrun -np 8 -H host1:4,host2:4 python train_hvd.py      # 2 hosts, 4 ranks (GPUs) each
    horovodrun -np 8 -hostfile hostfiles/example.txt python train_hvd.py
    mpirun -np 8 -H host1:4,host2:4 --bind-to none --map-by slot -x PATH -x LD_LIBRARY_PATH python train_hvd.py
    mpirun -np 8 -hosts host1:4,host2:4 -bind-to none python train_hvd.py       # MPICH, Intel MPI

Recipes and overrides: `python train_hvd.py --config configs/cifar10_resnet18.yaml --epochs 5 --amp bf16`.
Images/s on synthetic data, like Horovod's pytorch_synthetic_benchmark.py: `--benchmark --model resnet50`.
Continue a run: `--resume auto`; evaluate a checkpoint: `--evaluate --resume runs/x/checkpoints/best.pt`.
Workers that come and go: `horovodrun -np 4 --min-np 2 --max-np 8 --host-discovery-script hostfiles/discover_hosts.py
python train_hvd.py --elastic`. All settings: `python train_hvd.py --help`. Rank 0 prints and writes everything in
--output-dir. The other commands (`hvd-train doctor|shard|export|predict`) are in hvd_train/app.py.

Below is Horovod's recipe, step by step as in Horovod's pytorch_imagenet_resnet50.py; each step is one call, and a
line that exists because of Horovod says so (# Horovod:). What the app adds around the steps (checks, the output
directory, checkpoints and resume, the watchdog, reports, elastic runs) is behind those calls, in hvd_train/.
"""
import hvd_utils
from hvd_train import app, training
from hvd_train.modes import elastic


def main(argv=None, cfg=None):
    """One run with the settings of `argv` (the command line by default), or of a Config already made; returns the
    exit code."""
    cfg = app.configure(argv, cfg)  # defaults < --config YAML < command line, checked

    # Horovod: 1. start Horovod (MPI or Gloo, as the launcher chose), tuned before it reads its settings.
    hvd_utils.start(cpu=cfg.run.device == "cpu", fusion_threshold_mb=cfg.horovod.fusion_threshold_mb,
                    cycle_time_ms=cfg.horovod.cycle_time_ms, gloo_timeout_s=app.gloo_timeout_s(cfg))
    # Horovod: 2. pin this rank to the GPU of its local rank (without GPUs: its share of the host's CPU cores).
    rt = hvd_utils.pin_to_local_rank(cpu=cfg.run.device == "cpu")
    app.prepare_rank(cfg, rt)  # rank 0 logs; signals reported; seed + rank; --output-dir writable
    if app.is_measurement(cfg):  # --benchmark or --evaluate: they measure, and train nothing
        return app.run_measurement(cfg, rt)

    data = training.load_data(cfg, rt)
    # Horovod: 3. each rank reads its own shard of the training set, reshuffled every epoch:
    # DistributedSampler(num_replicas=hvd.size(), rank=hvd.rank()) (an ElasticSampler under --elastic).
    sampler = hvd_utils.shard_sampler(data.train_set, seed=cfg.run.seed, elastic=cfg.horovod.elastic)
    loaders = training.loaders(data, sampler, rt.rank, rt.size)

    model, task = training.model_and_task(cfg, data.info, rt.device)
    # Horovod: 4. the learning rate scaled with the global batch (ranks x batches per allreduce), and the
    # optimizer wrapped in hvd.DistributedOptimizer, which averages the gradients across ranks in backward().
    scaled = training.batching(cfg, rt.size)
    optimizer = training.optimizer(cfg, model, lr=scaled.lr)
    optimizer = hvd_utils.distributed_optimizer(optimizer, model, training.wire_options(cfg))
    trainer = training.trainer(cfg, data.info, rt, model, task, optimizer, scaled)

    if cfg.horovod.elastic:  # workers come and go: the claim, Horovod's state sync (its broadcast) and fit run
        return elastic.train(cfg, rt, data, trainer, loaders)  # inside Horovod's elastic loop
    # Rank 0 claims --output-dir (an earlier run is never clobbered); on --resume it reads the checkpoint.
    with training.open_run(cfg, rt, data.info, trainer) as run:
        # Horovod: 5. every rank starts from rank 0's weights and optimizer state (a resumed run: the checkpoint's).
        hvd_utils.broadcast_state(trainer.model, trainer.optimizer, root_rank=0)
        training.fit(run, loaders)  # epochs of train_one_epoch + evaluate; rank 0 checkpoints and reports
        return training.close_run(run)  # the ranks' weights compared; summary.json


def cli():
    app.cli(main)


if __name__ == "__main__":
    cli()
