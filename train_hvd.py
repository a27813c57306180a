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
from data import BadSampleError, DataError
from hvd_train.build import attach_profiler, build_data, build_trainer, check_choices, load_initial_weights
from hvd_train.config import parse_config
from hvd_train import doctor, interrupt, watchdog
from hvd_train.engine import Hooks, fit
from hvd_train.errors import CheckpointError, ConfigError, NonFiniteLossError, say
from hvd_train.modes import benchmark, elastic, evaluate
from hvd_train.reporting import finish, log_rescale, log_setup
from hvd_train.run_dir import RunDir, check_writable, reported_write, write_json
from hvd_train.run_state import AfterEpoch, RunState, checkpoint_fits, outputs_for, resume
from hvd_train.tracking import open_trackers

log = logging.getLogger("hvd_train")


def setup_logging(is_main):
    # Only rank 0 speaks; the others report warnings and errors only.
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, format="%(message)s", stream=sys.stdout)


def main(argv=None, cfg=None):
    """One run of the app: the settings of `argv` (the command line by default), or a Config already made."""
    # `kill -USR1 <pid>` prints every thread's Python stack to stderr: where a rank that seems stuck is waiting.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
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
    interrupt.install(report=rt.is_main)  # Ctrl-C and SIGTERM: say where the run stopped (hvd_train/interrupt.py)
    torch.manual_seed(cfg.run.seed + rt.rank)  # different dropout per rank; the weights come from rank 0
    # The output directory first: a path that cannot be written fails in one line, before data and model are built.
    # (An elastic worker checks alone: one that joins later must not run a collective outside Horovod's loop.)
    if cfg.horovod.elastic:
        check_writable(cfg.run.output_dir, tidy=False)
    else:
        hvd_utils.decide_on_root(lambda: check_writable(cfg.run.output_dir), "output_dir_check")
    if cfg.benchmark.enabled:
        return benchmark.run(cfg, rt)
    if cfg.run.evaluate:
        return evaluate.run(cfg, rt)
    if cfg.horovod.elastic:
        return elastic.run(cfg, rt)
    return train(cfg, rt)


def train(cfg, rt):
    """Training on a fixed set of ranks; rank 0 writes everything into --output-dir."""
    # Horovod: each rank reads its own shard (DistributedSampler); the learning rate is scaled with the global
    # batch and the optimizer averages gradients across ranks.
    info, (train_loader, val_loader, train_sampler) = build_data(cfg, rt)
    trainer = build_trainer(cfg, info, rt)
    # Rank 0 looks at the output directory: continue, replace or refuse, so an earlier run is never clobbered.
    run_dir = RunDir(cfg.run.output_dir)
    resume_from = hvd_utils.decide_on_root(lambda: run_dir.claim(cfg.checkpoint.resume, cfg.run.overwrite),
                                           "output_dir")
    # Rank 0 holds the directory's lock from the claim to the end of the run: a second job is refused meanwhile.
    with run_dir.lock:
        state = RunState()
        if resume_from:  # every rank gets the checkpoint's weights; refused before anything is written
            resume(resume_from, trainer, state, checkpoint_fits(cfg, info, trainer.task))
        else:
            if cfg.checkpoint.resume:
                log.info("--resume auto: no checkpoint in %s yet, starting afresh", run_dir.checkpoints)
            load_initial_weights(cfg, trainer.model)  # --init-from, on rank 0
            # Horovod: every rank starts from rank 0's weights and optimizer state.
            hvd_utils.broadcast_state(trainer.model, trainer.optimizer, root_rank=0)
        outputs = outputs_for(cfg, info, trainer.task, rt.is_main, state, run_dir)
        attach_profiler(trainer, cfg, rt, run_dir)  # --profile: recording starts in the directory this run owns
        outputs.reporter.track(open_trackers(cfg, rt, state))  # MLflow, W&B: on rank 0
        interrupt.describe_with(lambda: state.where(cfg.optim.epochs, run_dir.checkpoint("last.pt")))
        log_setup(cfg, rt, info, trainer, state.epoch)
        if resume_from:
            log_rescale(cfg, state.resumes[-1], len(train_loader))
        # A full disk stops every rank.
        hvd_utils.decide_on_root(lambda: write_config(outputs.run_dir.config, cfg), "config")
        # A rank that stops making progress ends the job with its name instead of hanging it (every rank starts it).
        watchdog.start(rt, cfg.run.freeze_timeout_s, f"Checkpoints in {outputs.run_dir.checkpoints} are written "
                       "whole or not at all: --resume auto continues from the newest.")
        try:
            hooks = Hooks(train_sampler, AfterEpoch(cfg, trainer, state, outputs), state)
            fit(trainer, train_loader, val_loader, hooks, first_epoch=state.epoch + 1)
            if trainer.profiler is not None:
                trainer.profiler.close()
        except BaseException as e:
            # The tracker's run ends too: killed (Ctrl-C, SIGTERM) or failed; --resume continues it.
            outputs.reporter.end_tracking(None, [], "KILLED" if isinstance(e, interrupt.Interrupted) else "FAILED")
            raise
        finally:
            watchdog.stop()
            outputs.reporter.close()
        return finish(cfg, rt, trainer, state, outputs.reporter)


def write_config(path, cfg):
    with reported_write(path):
        write_json(path, cfg.to_dict())


def cli():
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
