"""Elastic training (horovodrun --min-np/--max-np --host-discovery-script): Horovod's state, sampler and run loop.

Workers may leave (a host dies) or join while the job runs. State committed with state.commit() survives: on a
reset every worker rolls back to the last commit, Horovod restarts its rings for the new set of workers, and the
reset callbacks adapt what depends on the world size (learning rate, validation shards). A sharded optimizer
(--shard-optimizer) is in that state too: a rank that leaves takes its slices with it, so each commit gathers the
whole state (_ShardedStateHandler).

Also here, for fixed runs too: which samples each rank reads (shard_sampler).
"""
from typing import TYPE_CHECKING, Any, Optional, Union

import horovod.torch as hvd
from horovod.torch.elastic import ElasticSampler, TorchState
from horovod.torch.elastic.state import StateHandler, get_handler_registry, set_handler_registry
from torch.utils.data import IterableDataset
from torch.utils.data.distributed import DistributedSampler

from hvd_utils.comm import broadcast_state_dict
from hvd_utils.zero import ShardedOptimizer

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset, Sampler

run = hvd.elastic.run  # decorator: re-enters the function after each reset, from the last committed state


def sampler(dataset: "Dataset", seed: int) -> ElasticSampler:
    """Shards the samples not yet processed this epoch among the current workers, after every reset too; starts
    at epoch 1, as the app counts epochs."""
    sampler = ElasticSampler(dataset, shuffle=True, seed=seed)
    sampler.set_epoch(1)
    return sampler


class _ShardedStateHandler(StateHandler):
    """A sharded optimizer (--shard-optimizer) in Horovod's elastic state. A rank that leaves takes its slices with
    it, so a commit gathers the whole state (a collective: every worker commits at the same step) and keeps it in
    host memory; a restore or a sync re-deals it over the workers there are now. Workers removed without a sync
    re-deal their own copy at the next step (ShardedOptimizer.synchronize)."""

    def __init__(self, optimizer: ShardedOptimizer) -> None:
        super().__init__(optimizer)
        self.save()

    def save(self) -> None:
        full = self.value.state_dict()
        self.value.committed = _to_cpu(full)

    def restore(self) -> None:
        self.value.deal(self.value.committed)

    def sync(self) -> None:
        full = broadcast_state_dict(self.value.committed if hvd.rank() == 0 else None, 0, "zero.elastic")
        self.value.committed = full
        self.value.deal(full)


def _to_cpu(value: Any) -> Any:
    if hasattr(value, "cpu"):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


# Horovod's TorchState picks a handler by type; a sharded optimizer is not a torch Optimizer.
if not any(kind is ShardedOptimizer for kind, _ in get_handler_registry()):
    set_handler_registry(get_handler_registry() + [(ShardedOptimizer, _ShardedStateHandler)])


def state(model: "torch.nn.Module", optimizer: "Union[torch.optim.Optimizer, ShardedOptimizer]",
          train_sampler: Optional[ElasticSampler], **counters: object) -> TorchState:
    """Model, optimizer, sampler position (where there is a sampler) and counters, saved on commit and restored
    and re-broadcast on reset."""
    if train_sampler is not None:
        counters["sampler"] = train_sampler
    return TorchState(model=model, optimizer=optimizer, **counters)


def world() -> tuple[int, int, int]:
    """(rank, size, local size) of the current set of workers."""
    return hvd.rank(), hvd.size(), hvd.local_size()


def shard_sampler(dataset: "Dataset", seed: int, elastic: bool = False) -> "Optional[Sampler[int]]":
    """Horovod: each rank reads its own 1/size of `dataset`, reshuffled every epoch (call set_epoch) with the shared
    seed, so the ranks' shards never overlap: DistributedSampler(num_replicas=hvd.size(), rank=hvd.rank()).

    elastic: Horovod's ElasticSampler, which deals the samples an epoch has not yet processed among the workers of
    the moment, after every reset too. None for a data set that cannot be indexed, one read as a stream (tar
    shards, an IterableDataset): it deals its shards to the ranks itself."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    if elastic:
        return sampler(dataset, seed)
    return DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=seed)
