"""Training on a fixed set of ranks, the usual run: data, Trainer, the output directory claimed, rank 0's weights
(or a checkpoint's) on every rank, fit() with the watchdog, the summary. train_hvd.main chooses it."""
import logging

import hvd_utils
from hvd_train import interrupt, watchdog
from hvd_train.build import attach_profiler, build_data, build_trainer, load_initial_weights
from hvd_train.engine import Hooks, fit
from hvd_train.reporting import finish, log_rescale, log_setup
from hvd_train.run_dir import RunDir, write_config
from hvd_train.run_state import AfterEpoch, RunState, checkpoint_fits, outputs_for, resume
from hvd_train.tracking import open_trackers

log = logging.getLogger("hvd_train")


def run(cfg, rt):
    """Training on a fixed set of ranks; rank 0 writes everything into --output-dir."""
    # Horovod: each rank reads its own shard (DistributedSampler); the learning rate is scaled with the global
    # batch and the optimizer averages gradients across ranks.
    info, (train_loader, val_loader, train_sampler) = build_data(cfg, rt)
    trainer = build_trainer(cfg, info, rt)
    # --init-from on rank 0, before the output directory is claimed: a file that does not fit leaves nothing behind
    # (a resumed run then replaces these weights with its checkpoint's).
    load_initial_weights(cfg, trainer.model)
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
            # Horovod: every rank starts from rank 0's weights and optimizer state.
            hvd_utils.broadcast_state(trainer.model, trainer.optimizer, root_rank=0)
            if trainer.ema is not None:  # --model-ema averages from the weights every rank now holds
                trainer.ema.restart(trainer.model)
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
