"""Elastic training (horovodrun --min-np/--max-np --host-discovery-script): Horovod's state, sampler and run loop.

Workers may leave (a host dies) or join while the job runs. State committed with state.commit() survives: on a
reset every worker rolls back to the last commit, Horovod restarts its rings for the new set of workers, and the
reset callbacks adapt what depends on the world size (learning rate, validation shards).
"""
import os

import horovod.torch as hvd
from horovod.torch.elastic import ElasticSampler, TorchState

run = hvd.elastic.run  # decorator: re-enters the function after each reset, from the last committed state


def under_elastic_launcher():
    """Whether horovodrun started this process in elastic mode (with --host-discovery-script)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def sampler(dataset, seed):
    """Shards the samples not yet processed this epoch among the current workers, after every reset too; starts
    at epoch 1, as the app counts epochs."""
    sampler = ElasticSampler(dataset, shuffle=True, seed=seed)
    sampler.set_epoch(1)
    return sampler


def state(model, optimizer, train_sampler, **counters):
    """Model, optimizer, sampler position (where there is a sampler) and counters, saved on commit and restored
    and re-broadcast on reset."""
    if train_sampler is not None:
        counters["sampler"] = train_sampler
    return TorchState(model=model, optimizer=optimizer, **counters)


def world():
    """(rank, size, local size) of the current set of workers."""
    return hvd.rank(), hvd.size(), hvd.local_size()
