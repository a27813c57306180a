"""Horovod: which samples each rank reads."""
import horovod.torch as hvd
from torch.utils.data import IterableDataset
from torch.utils.data.distributed import DistributedSampler

from hvd_utils import elastic as elastic_mode


def shard_sampler(dataset, seed, elastic=False):
    """Horovod: each rank reads its own 1/size of `dataset`, reshuffled every epoch (call set_epoch) with the shared
    seed, so the ranks' shards never overlap: DistributedSampler(num_replicas=hvd.size(), rank=hvd.rank()).

    elastic: Horovod's ElasticSampler, which deals the samples an epoch has not yet processed among the workers of
    the moment, after every reset too. None for a data set that cannot be indexed, one read as a stream (tar
    shards, an IterableDataset): it deals its shards to the ranks itself."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    if elastic:
        return elastic_mode.sampler(dataset, seed)
    return DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=seed)
