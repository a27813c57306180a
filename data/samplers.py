"""Samplers that shard a data set between ranks."""
from torch.utils.data import Sampler


class ShardSampler(Sampler):
    """Every rank-th index starting at rank, in order: each sample lands on exactly one rank, none is repeated.

    Use it for evaluation. DistributedSampler pads the shards to equal length by repeating samples, which is what
    training needs (every rank must run the same number of steps) but would count those samples twice in a metric.
    """

    def __init__(self, num_samples, rank, world_size):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.indices = list(range(rank, num_samples, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)
