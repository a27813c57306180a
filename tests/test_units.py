"""Pure pieces: learning-rate scaling, metric averaging, the model registry."""
import pytest
import torch

import engine
from hvd_utils import scaled_lr
from models import MODELS, build_model


@pytest.mark.parametrize("base,world,expected", [(0.1, 1, 0.1), (0.1, 8, 0.8), (0.0125, 32, 0.4)])
def test_learning_rate_scales_linearly_with_the_number_of_ranks(base, world, expected):
    assert scaled_lr(base, world) == pytest.approx(expected)


def test_averages_divide_global_sums_by_the_global_count():
    totals = {"loss_sum": 6.0, "correct1": 3.0, "correct5": 7.0, "count": 7.0}
    assert engine.averages(totals) == {"loss": 6 / 7, "acc1": 300 / 7, "acc5": 100.0, "count": 7}


def test_averages_of_nothing_are_not_a_division_by_zero():
    result = engine.averages({"loss_sum": 0.0, "correct1": 0.0, "correct5": 0.0, "count": 0.0})
    assert result["count"] == 0 and result["acc1"] == 0.0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_registered_models_map_images_to_class_logits(name):
    model = build_model(name, in_channels=1, num_classes=10, image_size=8)
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 10)


def test_unknown_model_names_list_the_known_ones():
    with pytest.raises(ValueError, match="small_cnn"):
        build_model("vgg", 1, 10, 8)


def test_cosine_schedule_falls_from_the_peak_to_zero_and_constant_stays():
    assert engine.lr_factor(0, 100, "cosine") == 1.0
    assert engine.lr_factor(50, 100, "cosine") == pytest.approx(0.5)
    assert engine.lr_factor(100, 100, "cosine") == pytest.approx(0.0)
    factors = [engine.lr_factor(s, 100, "cosine") for s in range(101)]
    assert factors == sorted(factors, reverse=True)
    assert {engine.lr_factor(s, 100, "constant") for s in (0, 50, 100)} == {1.0}


def test_scheduler_steps_the_optimizer_rate_per_step():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.4)
    scheduler = engine.make_scheduler(optimizer, "cosine", total_steps=4)
    rates = []
    for _ in range(4):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.4, 0.4 * (0.5 + 0.5 * 2 ** -0.5), 0.2, 0.4 * (0.5 - 0.5 * 2 ** -0.5)])
