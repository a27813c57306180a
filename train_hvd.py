"""hvd-train: data-parallel PyTorch training with Horovod.

Launch (every setting has a default, so each of these trains the small CNN on scikit-learn's digits):

    python train_hvd.py                                          # one process
    horovodrun -np 2 -H localhost:2 python train_hvd.py          # 2 ranks on this machine
    horovodrun -np 8 -H host1:4,host2:4 python train_hvd.py      # 2 hosts, 4 ranks (GPUs) each
    horovodrun -np 8 -hostfile hostfiles/example.txt python train_hvd.py
    mpirun -np 8 -H host1:4,host2:4 -bind-to none -map-by slot -x PATH -x LD_LIBRARY_PATH python train_hvd.py

Recipes and overrides: `python train_hvd.py --config configs/cifar10_resnet18.yaml --epochs 5 --amp bf16`.
Images/s on synthetic data, like Horovod's pytorch_synthetic_benchmark.py: `--benchmark --model resnet50`.
Continue a run: `--resume auto`; evaluate a checkpoint: `--evaluate --resume runs/x/checkpoints/best.pt`.
All settings: `python train_hvd.py --help`. Rank 0 prints and writes everything in --output-dir.
"""
import faulthandler
import logging
import signal
import sys
import traceback

import torch

import hvd_utils
from hvd_train.data import BadSampleError, DataError
from hvd_train.build import check_choices
from hvd_train.config import parse_config
from hvd_train import doctor, interrupt
from hvd_train.errors import CheckpointError, ConfigError, NonFiniteLossError, say
from hvd_train.modes import benchmark, elastic, evaluate, fixed
from hvd_train.run_dir import check_writable, keep_private

log = logging.getLogger("hvd_train")


def setup_logging(is_main):
    # Only rank 0 speaks; the others report warnings and errors only.
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, format="%(message)s", stream=sys.stdout)


def main(argv=None, cfg=None):
    """One run of the app: the settings of `argv` (the command line by default), or a Config already made."""
    # `kill -USR1 <pid>` prints every thread's Python stack to stderr: where a rank that seems stuck is waiting.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    keep_private()  # files this run writes: owner and group only (hvd_train/run_dir.py)
    cfg = cfg or parse_config(argv)
    check_choices(cfg)
    if cfg.profile.enabled:  # before hvd.init(): Horovod's timeline can then be switched on for the profiled steps
        hvd_utils.timeline.enable_dynamic()
    # Horovod: start, pin this rank to the GPU of its local rank (the CPU without one), set its CPU threads.
    # Training on a fixed set of ranks has a watchdog (hvd_train/watchdog.py) that names a frozen rank; Gloo's own
    # 30 s timeout must not end the job first, blaming the ranks that waited.
    watched = not (cfg.horovod.elastic or cfg.benchmark.enabled or cfg.run.evaluate) and cfg.run.freeze_timeout_s
    rt = hvd_utils.init(cpu=cfg.run.device == "cpu", fusion_threshold_mb=cfg.horovod.fusion_threshold_mb,
                        cycle_time_ms=cfg.horovod.cycle_time_ms,
                        gloo_timeout_s=cfg.run.freeze_timeout_s + 60 if watched else 0)
    setup_logging(rt.is_main)
    for note in getattr(cfg, "notes", ()):  # a resume or evaluation given a setting again, changed
        log.info("changed from the run's recorded settings: %s", note)
    interrupt.install(report=rt.is_main)  # Ctrl-C and SIGTERM: say where the run stopped (hvd_train/interrupt.py)
    torch.manual_seed(cfg.run.seed + rt.rank)  # different dropout per rank; the weights come from rank 0
    # The output directory first: a path that cannot be written fails in one line, before data and model are built.
    # (An elastic worker checks alone: one that joins later must not run a collective outside Horovod's loop.)
    if cfg.horovod.elastic:
        check_writable(cfg.run.output_dir, tidy=False)
    else:
        hvd_utils.decide_on_root(lambda: check_writable(cfg.run.output_dir), "output_dir_check")
    # The mode, decided here once. Each builds what it uses (hvd_train/build.py) and runs the one loop (engine.fit):
    # data -> model, task and Horovod-wrapped optimizer -> the run directory claimed -> weights broadcast from rank
    # 0 (or a checkpoint loaded) -> fit -> summary.
    if cfg.benchmark.enabled:
        return benchmark.run(cfg, rt)
    if cfg.run.evaluate:
        return evaluate.run(cfg, rt)
    if cfg.horovod.elastic:
        return elastic.run(cfg, rt)
    return fixed.run(cfg, rt)


def cli():
    keep_private()
    if sys.argv[1:2] == ["doctor"]:  # hvd-train doctor -H ...: check the hosts of a job before it runs
        sys.exit(doctor.main(sys.argv[2:]))
    if sys.argv[1:2] == ["shard"]:  # hvd-train shard --from ... --out ...: write a data set as tar shards
        from hvd_train import shard_cli

        sys.exit(shard_cli.main(sys.argv[2:]))
    if sys.argv[1:2] == ["export"]:  # hvd-train export RUN_DIR --format onnx: the weights for use elsewhere
        from hvd_train import export

        sys.exit(export.main(sys.argv[2:]))
    if sys.argv[1:2] == ["predict"]:  # hvd-train predict RUN_DIR image.jpg: top classes of image files
        from hvd_train import predict

        sys.exit(predict.main(sys.argv[2:]))
    sys.exit(guarded(main))


def guarded(run):
    """run() with every failure reported once, as cli() and hvd_train.run() do; returns the exit code."""
    code = 1
    try:
        code = run()
    except (ConfigError, DataError, CheckpointError, NonFiniteLossError) as e:
        # Raised on every rank at the same point (checked on all, or sent from rank 0), so none waits on another;
        # rank 0 alone says it. Exit 2: a setting or a file to fix; 3: the training diverged.
        if hvd_utils.launcher_rank() == 0:
            say(f"train_hvd.py: error: {e}")
        code = 3 if isinstance(e, NonFiniteLossError) else 2
    except BadSampleError as e:
        # Met by this rank alone, mid-epoch: it names the file; the other ranks stop as their peer is gone.
        say(f"train_hvd.py: rank {hvd_utils.launcher_rank()}: error: {e}")
        code = 2
    except interrupt.Interrupted as e:
        # Ctrl-C or SIGTERM: rank 0 says where the run stopped and where --resume auto continues.
        interrupt.report()
        code = e.exit_code
    except hvd_utils.PeerFailure:
        if interrupt.signalled():  # the signal reached another rank first, which ended the collective
            interrupt.report()
            code = 128 + interrupt.signalled()
        else:
            # This rank was waiting in a collective when another one failed: that rank reports the cause.
            say(f"train_hvd.py: rank {hvd_utils.launcher_rank()}: stopping because another rank failed (its error is "
                f"reported above or by the launcher)")
            code = 1
    except Exception:
        # A bug or a fault on this rank alone: its traceback, once, with the rank named.
        say(f"train_hvd.py: rank {hvd_utils.launcher_rank()} failed:\n{traceback.format_exc()}")
        code = 1
    finally:
        hvd_utils.shutdown()
    return code


if __name__ == "__main__":
    cli()
