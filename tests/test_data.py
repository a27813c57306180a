import pytest
import torch
from torch.utils.data import TensorDataset

from data import DATASETS, build_datasets, build_loaders
from data.digits import load_digits_dataset
from data.samplers import ShardSampler
from data.split import split_indices


def test_digits_are_the_1797_bundled_8x8_images_scaled_to_unit_range():
    images, labels = load_digits_dataset().tensors
    assert images.shape == (1797, 1, 8, 8) and labels.shape == (1797,)
    assert images.min() >= 0.0 and images.max() <= 1.0
    assert set(labels.tolist()) == set(range(10))


def test_split_is_deterministic_disjoint_and_complete():
    train, val = split_indices(1797, 0.2, seed=0)
    assert (train, val) == split_indices(1797, 0.2, seed=0)
    assert set(train).isdisjoint(val) and sorted(train + val) == list(range(1797))
    assert len(val) == round(1797 * 0.2)
    assert split_indices(1797, 0.2, seed=1)[1] != val


@pytest.mark.parametrize("n,fraction", [(2, 0.01), (2, 0.99), (10, 0.5)])
def test_split_keeps_at_least_one_sample_on_each_side(n, fraction):
    train, val = split_indices(n, fraction, seed=0)
    assert train and val


def test_split_refuses_a_single_sample():
    with pytest.raises(ValueError, match="cannot split 1 sample"):
        split_indices(1, 0.2, seed=0)


@pytest.mark.parametrize("n,world", [(7, 2), (359, 2), (3, 4), (8, 8), (0, 2)])
def test_shard_sampler_gives_every_sample_to_exactly_one_rank(n, world):
    seen = [i for rank in range(world) for i in ShardSampler(n, rank, world)]
    assert sorted(seen) == list(range(n))


def test_shard_sampler_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank 2"):
        ShardSampler(10, 2, 2)


def test_training_shards_are_disjoint_and_reshuffled_each_epoch():
    dataset = TensorDataset(torch.arange(100).float().unsqueeze(1), torch.zeros(100, dtype=torch.long))
    shards = []
    for rank in range(2):
        loader, _, sampler = build_loaders(dataset, dataset, 10, rank, 2, seed=3)
        sampler.set_epoch(1)
        epoch1 = torch.cat([x for x, _ in loader]).flatten().tolist()
        sampler.set_epoch(2)
        epoch2 = torch.cat([x for x, _ in loader]).flatten().tolist()
        assert epoch1 != epoch2
        shards.append(epoch1)
    assert set(shards[0]).isdisjoint(shards[1]) and len(shards[0]) == len(shards[1]) == 50


def test_build_datasets_reports_shapes_and_rejects_unknown_names():
    train, val, info = build_datasets("digits", 0.2, 0)
    assert (info.in_channels, info.num_classes, info.image_size) == DATASETS["digits"][1:]
    assert len(train) == info.num_train == 1438 and len(val) == info.num_val == 359
    with pytest.raises(ValueError, match="unknown data set 'imagenet'"):
        build_datasets("imagenet", 0.2, 0)
