"""--elastic: the training run inside Horovod's elastic loop, for jobs whose workers come and go."""
import dataclasses
import logging
import os

import engine
import hvd_utils
from checkpoint import Checkpointer, claim_output_dir
from config import ConfigError
from data import build_loaders
from hvd_utils import elastic
from lifecycle import epoch_end_handler, finish, log_setup
from reporting import Reporter, write_json

log = logging.getLogger("hvd_train")


def train_elastic(cfg, rt, train_set, val_set, info, model, task, optimizer, scaler, fits, state):
    """--elastic: the same training inside Horovod's elastic loop, for jobs whose workers come and go.

    Nothing here runs a collective before that loop: a worker that joins later starts this script while the others
    are inside the loop. The output directory is claimed, and a checkpoint loaded, inside it, once.
    """
    if not elastic.under_elastic_launcher():
        raise ConfigError("--elastic needs horovodrun's elastic mode: horovodrun -np N --min-np M --max-np K "
                          "--host-discovery-script hostfiles/discover_hosts.py python train_hvd.py --elastic")
    accumulate, batch = cfg.horovod.batches_per_allreduce, cfg.optim.batch_size * cfg.horovod.batches_per_allreduce
    sampler = elastic.sampler(train_set, cfg.run.seed)
    sampler.set_epoch(1)
    loader_args = dict(seed=cfg.run.seed, workers=cfg.data.workers, pin_memory=rt.device.type == "cuda",
                       train_sampler=sampler)
    train_loader = build_loaders(train_set, val_set, batch, rt.rank, rt.size, **loader_args)[0]
    ckpt_dir = os.path.join(cfg.run.output_dir, "checkpoints")
    progress = {"epoch": 1, "batch": 0, "resets": 0, "redone": 0}
    st = elastic.state(model, optimizer, sampler, epoch=1, batch=0, steps=0, claimed=False)
    checkpointer = Checkpointer(ckpt_dir, cfg.checkpoint.keep_last, enabled=False)
    reporter = Reporter(cfg.run.output_dir, False, cfg.logging.tensorboard)

    def lr_scale_now():
        return hvd_utils.lr_scale(elastic.world()[1], accumulate, cfg.horovod.use_adasum)

    def take_roles():
        # Rank 0 of the current workers writes; after a reset that may be another process than before.
        is_main = elastic.world()[0] == 0
        logging.getLogger().setLevel(logging.INFO if is_main else logging.WARNING)
        checkpointer.enabled = is_main
        reporter.set_enabled(is_main)

    def on_reset():
        if progress["epoch"] == st.epoch:
            progress["redone"] += progress["batch"] - st.batch
        progress["resets"] += 1
        take_roles()
        log.info("workers changed: now %d; continuing from epoch %d, step %d (the last commit)", elastic.world()[1],
                 st.epoch, st.batch)

    st.register_reset_callbacks([on_reset])
    on_epoch_end = epoch_end_handler(cfg, task, model, optimizer, None, scaler, state, fits, checkpointer, reporter,
                                     world_size=lambda: elastic.world()[1], steps_done=lambda: st.steps)

    def make_val_loader():
        rank, size, _ = elastic.world()
        return build_loaders(train_set, val_set, batch, rank, size, **loader_args)[1]

    @elastic.run
    def train(st):
        if not st.claimed:
            resume_from = hvd_utils.decide_on_root(
                lambda: claim_output_dir(cfg.run.output_dir, cfg.checkpoint.resume, cfg.run.overwrite), "output_dir")
            if resume_from:
                meta = hvd_utils.load_weights(resume_from, model, fits, optimizer=optimizer)  # rank 0 reads
                state.update({k: meta[k] for k in ("best_metric", "best_epoch", "history")})
                st.epoch, st.steps = meta["epoch"] + 1, meta["step"] or 0
                sampler.set_epoch(st.epoch)
            st.claimed = True
            take_roles()
            if elastic.world()[0] == 0:
                write_json(os.path.join(cfg.run.output_dir, "config.json"), cfg.to_dict())
            log_setup(cfg, rt, info, task, model, lr_scale_now(), cfg.optim.lr * lr_scale_now(), st.epoch - 1)
            st.commit()
        engine.fit_elastic(st, model, task, optimizer, train_loader, sampler, make_val_loader, rt.device,
                           optim_cfg=cfg.optim, lr_scale_fn=lr_scale_now, commit_every=cfg.horovod.commit_every,
                           progress=progress, accumulate=accumulate, amp=cfg.optim.amp, scaler=scaler,
                           clip_grad=cfg.optim.clip_grad, log_every=cfg.logging.log_every,
                           show_progress=cfg.logging.progress and elastic.world()[0] == 0,
                           progress_every=cfg.logging.progress_every, on_epoch_end=on_epoch_end)

    try:
        train(st)
    finally:
        reporter.close()
    rank, size, local_size = elastic.world()
    now = dataclasses.replace(rt, rank=rank, size=size, local_size=local_size)
    state["elastic"] = {"resets": progress["resets"], "steps_redone": progress["redone"],
                        "commit_every": cfg.horovod.commit_every, "steps": st.steps}
    return finish(cfg, now, model, task, state, cfg.optim.lr * lr_scale_now(), reporter)
