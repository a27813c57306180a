"""Which samples each rank reads: samplers that shard a data set between ranks, and the train/validation split.

The split is deterministic: the same on every rank and in every run with the same seed. ShardSampler gives each
sample to exactly one rank (evaluation); rest_of_epoch() deals out anew what a resumed epoch had not trained.
"""
from typing import TYPE_CHECKING, Iterator

import torch
from torch.utils.data import DistributedSampler, Sampler

if TYPE_CHECKING:
    from torch.utils.data import Dataset


class ShardSampler(Sampler):
    """Every rank-th index starting at rank, in order: each sample lands on exactly one rank, none is repeated.

    Use it for evaluation. DistributedSampler pads the shards to equal length by repeating samples, which is what
    training needs (every rank must run the same number of steps) but would count those samples twice in a metric.
    """

    def __init__(self, num_samples: int, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.indices = list(range(rank, num_samples, world_size))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def rest_of_epoch(dataset: "Dataset", seed: int, epoch: int, world_was: int, samples_done: int, rank: int,
                  world_size: int) -> list[int]:
    """This rank's share, on `world_size` ranks, of the samples of `epoch` that a run on `world_was` ranks had not
    trained when each of its ranks had read `samples_done` of them (its steps times its batch).

    DistributedSampler deals the epoch's padded shuffle out in turn (rank r takes positions r, r + W, ...), so the
    samples read after k steps of batch B on every rank are exactly the shuffle's first W * k * B positions. The rest
    is dealt out the same way among the ranks there are now: on as many ranks as before, each rank's share is the
    remainder of its own shard, in order; on another number, no sample of the epoch is read twice or left out (as
    DistributedSampler, the share is padded with repeats to equal length)."""
    old = []
    for r in range(world_was):
        sampler = DistributedSampler(dataset, num_replicas=world_was, rank=r, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        old.append(list(sampler))
    rest = [old[r][j] for j in range(len(old[0])) for r in range(world_was)][world_was * samples_done:]
    if not rest:
        return []
    padded = rest + (rest * (-(-world_size // len(rest))))[:(-len(rest)) % world_size]
    return padded[rank::world_size]


def split_indices(num_samples: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Shuffle 0..num_samples-1 with a fixed seed; the first val_fraction go to validation, the rest to training."""
    if num_samples < 2:
        raise ValueError(f"cannot split {num_samples} sample(s) into training and validation sets")
    num_val = min(num_samples - 1, max(1, round(num_samples * val_fraction)))
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[num_val:]), sorted(order[:num_val])
