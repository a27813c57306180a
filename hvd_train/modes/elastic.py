"""--elastic: the training loop of a fixed run (trainer.fit_epochs) inside Horovod's elastic loop, for jobs whose
workers come and go (horovodrun --min-np/--max-np --host-discovery-script).

State committed with state.commit() survives: on a reset every worker rolls back to the last commit and re-enters
fit_epochs() at that epoch; the sampler yields only the samples the epoch has not processed, and the learning rate
follows the fraction of the epoch done, so the schedule holds whatever the number of workers.
"""
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Optional, Union

import hvd_utils
from hvd_train.data import build_loaders, check_world
from hvd_train.run.checkpoint import checkpoint_to_resume, resume
from hvd_train.run.reports import log_setup, write_summary
from hvd_train.run.state import AfterEpoch, RunState, outputs_for
from hvd_train.run.tracking import local_mlflow
from hvd_train.trainer import Hooks, batching, fit_epochs
from hvd_train.training import attach_profiler, close_profiler, load_initial_weights, write_config_everywhere
from hvd_utils import elastic

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader, Sampler

    from hvd_train.config import Config
    from hvd_train.data.shards import ShardLoader
    from hvd_train.trainer import Trainer
    from hvd_train.training import Data

log = logging.getLogger("hvd_train")


class ElasticHooks(Hooks):
    """fit_epochs()'s hooks in an elastic run: the step counters, and the sampler's position, are committed every
    `commit_every` steps and after each epoch; st.resets and st.redone count the resets and the steps they rolled
    back (in the state, so a worker that joins later reports the whole run's).

    Tar shards (data/shards.py; sampler None) plan each epoch whole for a number of ranks: their hooks commit at
    epoch ends only, so a reset rolls the model back to the start of the epoch in progress, which is then read again
    from its beginning, planned for the new set of workers. The steps since that start are redone (counted), and no
    update from a sample of that epoch survives twice."""
    sampler: Any  # Horovod's ElasticSampler; tar shards: the training loader of the current workers
    state: RunState  # after_epoch's, never None here

    def __init__(self, st: "elastic.TorchState", after_epoch: AfterEpoch,
                 sampler: "Optional[elastic.ElasticSampler]" = None, commit_every: int = 0,
                 batch_size: int = 0) -> None:
        super().__init__(sampler, after_epoch, after_epoch.state)  # tar shards: each entry sets its loader
        self.st, self.commit_every, self.batch_size = st, commit_every, batch_size
        self.by_sample = sampler is not None  # Horovod's ElasticSampler: the position within an epoch survives
        self.epochs = after_epoch.trainer.epochs
        self.done = {"epoch": 1, "batch": 0}  # the last step done, before any rollback

    def epoch_start(self, epoch: int) -> None:
        # Horovod's ElasticSampler starts a new epoch when set_epoch is called at the end of the last; a tar
        # shard loader plans its epoch here.
        if not self.by_sample:
            super().epoch_start(epoch)

    def position(self, epoch: int, step: int, steps: int) -> float:
        if not self.by_sample:
            return super().position(epoch, step, steps)
        return epoch - 1 + min(1.0, self.sampler.processed_num / len(self.sampler.dataset))

    def after_step(self, epoch: int, step: int, steps: int, sums: "dict[str, torch.Tensor]") -> None:
        st = self.st
        st.batch += 1
        st.steps += 1
        self.done = {"epoch": epoch, "batch": st.batch}
        if self.by_sample:
            self.sampler.record_batch(st.batch, self.batch_size)
            if st.batch % self.commit_every == 0:
                st.commit()  # also where a worker learns that hosts were added or removed

    def epoch_end(self, epoch: int, record: dict[str, Any]) -> bool:
        st = self.st
        self.state.set_steps(st.steps)
        stop = super().epoch_end(epoch, record)
        if self.by_sample:
            self.sampler.set_epoch(epoch + 1)
        st.batch, st.epoch = 0, (self.epochs + 1 if stop else epoch + 1)
        # The history and best metric travel with the state: a worker that joined later, and may be rank 0 once
        # the others are gone, writes the whole run into its checkpoints and summary.
        st.run = dict(self.state.checkpoint_fields(), history=list(self.state.history))
        st.commit()
        return stop

    def count_reset(self) -> None:
        if self.done["epoch"] == self.st.epoch:
            self.st.redone += self.done["batch"] - self.st.batch
        self.st.resets += 1
        self.st.save()  # the restore point stays the last commit; only the counts are kept from here


def train(cfg: "Config", rt: hvd_utils.Runtime, data: "Data", trainer: "Trainer",
          loaders: ("tuple[Union[DataLoader, ShardLoader], Union[DataLoader, ShardLoader], "
                    "Union[Sampler[int], ShardLoader]]")) -> int:
    """Train the parts train_hvd.py built (data, Trainer with Horovod's optimizer, the loaders over Horovod's
    ElasticSampler) inside Horovod's elastic loop. Nothing here runs a collective before that loop: a worker that
    joins later starts the script while the others are inside it. The output directory is claimed, and a
    checkpoint loaded, inside it, once."""
    train_loader, _, sampler = loaders
    streamed = data.streamed
    if streamed:
        sampler = None  # tar shards: the loader is built for the current workers in the elastic loop
    state, outputs = RunState(), outputs_for(cfg, data.info, trainer.task, is_main=False)
    # Written in the step: the writing rank can change at a reset, and its checkpoint must be whole by then.
    outputs.checkpointer.background = False
    after_epoch = AfterEpoch(cfg, trainer, state, outputs)
    # The weights' average (--model-ema) is a module: Horovod's state saves, restores and syncs it like the model.
    averaged = {"ema": trainer.ema} if trainer.ema is not None else {}
    st = elastic.state(trainer.model, trainer.optimizer, sampler, epoch=1, batch=0, steps=0, claimed=False,
                       run={}, resets=0, redone=0, **averaged)
    hooks = ElasticHooks(st, after_epoch, sampler, cfg.horovod.commit_every, data.spec.batch_size)

    def take_roles() -> None:
        # Rank 0 of the current workers writes; after a reset that may be another process than before. The rate
        # follows the number of workers.
        rank, size, _ = elastic.world()
        logging.getLogger().setLevel(logging.INFO if rank == 0 else logging.WARNING)
        outputs.checkpointer.enabled = rank == 0
        outputs.reporter.set_enabled(rank == 0)
        trainer.rescale(batching(cfg, size), show_progress=cfg.logging.progress and rank == 0)

    def on_reset() -> None:
        hooks.count_reset()
        take_roles()
        log.info("workers changed: now %d; continuing from epoch %d, step %d (the last commit)", elastic.world()[1],
                 st.epoch, st.batch)

    st.register_reset_callbacks([on_reset])

    @elastic.run
    def run_loop(st: "elastic.TorchState") -> None:
        if st.run:
            state.load(st.run)  # rank 0's, as of the last commit (Horovod synced the state before this call)
        if st.claimed:
            take_roles()  # again: a worker that joined the running job has seen no reset to call it
        else:
            # --init-from on rank 0, before the output directory is claimed (as in a fixed run): a file that does
            # not fit leaves nothing behind. A resumed run then replaces these weights with its checkpoint's.
            load_initial_weights(cfg, trainer.model)
            resume_from = hvd_utils.decide_on_root(
                lambda: outputs.run_dir.acquire(cfg.checkpoint.resume, cfg.run.overwrite, local_mlflow(cfg),
                                                find_checkpoint=checkpoint_to_resume),
                "output_dir")
            if resume_from:
                resume(resume_from, trainer, state, outputs.fits)
                if state.partial:  # Horovod's ElasticSampler deals whole epochs: the one it was taken within
                    log.info("resumed within epoch %d: an elastic run starts it over (the %d step(s) of it done "
                             "stay in the weights)", state.partial["epoch"], state.partial["steps"])
                    state.restart_epoch()
                st.epoch, st.steps = state.epoch + 1, state.step
                sampler.set_epoch(st.epoch)
            elif cfg.model.init_from:  # rank 0's weights to the others (the commit keeps them)
                hvd_utils.broadcast_state(trainer.model, trainer.optimizer, root_rank=0)
                if trainer.ema is not None:
                    trainer.ema.restart(trainer.model)
            st.claimed = True
            take_roles()  # only now: rank 0's reporter writes into the directory it has claimed
            # A full disk stops every worker with one line, as in a fixed run (every worker is in this loop).
            write_config_everywhere(outputs.run_dir, cfg)
            log_setup(cfg, rt, data.info, trainer, st.epoch - 1)
            if cfg.checkpoint.every_steps or cfg.checkpoint.every_minutes:
                log.info("--elastic writes checkpoints at epoch ends only: within an epoch its commits (every "
                         "--horovod.commit_every steps) carry the steps across a reset, and a restart of the whole "
                         "job starts the epoch over; --checkpoint.every_steps/every_minutes are for fixed jobs")
            st.commit()
        attach_profiler(trainer, cfg, rt, outputs.run_dir)  # once the directory is claimed (by this or another)
        # Validation shards follow the current set of workers (and tar shards' training plan too).
        rank, size, _ = elastic.world()
        if streamed:
            check_world(data.train_set, size, data.spec)  # fewer workers: still a full batch each
        now = build_loaders(data.train_set, data.val_set, data.spec, rank, size)
        if streamed:
            hooks.sampler = now[0]
        outputs.run_dir.keep_from_now()
        fit_epochs(trainer, now[0] if streamed else train_loader, now[1], hooks, first_epoch=st.epoch)

    # The lock is held by the process that claimed the directory, while it lives; stopped before training started,
    # it leaves no directory it made (RunDir.lock_held).
    with outputs.run_dir.lock_held():
        try:
            run_loop(st)
            close_profiler(trainer)
        finally:
            outputs.reporter.close()
    rank, size, local_size = elastic.world()
    state.set_elastic({"resets": st.resets, "steps_redone": st.redone, "commit_every": cfg.horovod.commit_every,
                       "steps": st.steps})
    return write_summary(cfg, dataclasses.replace(rt, rank=rank, size=size, local_size=local_size), trainer, state,
                         outputs.reporter)
