"""The learning rate: the linear scaling rule, warmup, cosine, step and exponential decay, set every step."""
import pytest
import torch

from hvd_train import trainer
from hvd_train.config import OptimConfig
from hvd_train.trainer import LRSchedule, lr_factor
from hvd_utils import lr_scale


@pytest.mark.parametrize("world,accumulate,adasum,expected", [(1, 1, False, 1), (8, 1, False, 8), (32, 2, False, 64),
                                                              (8, 2, True, 2)])
def test_learning_rate_scales_linearly_with_the_global_batch(world, accumulate, adasum, expected):
    assert lr_scale(world, accumulate, adasum) == expected


def lr(step, schedule, **kw):  # 10 steps per epoch, 10 epochs
    return lr_factor(step / 10, epochs=10, schedule=schedule, **kw)


def test_cosine_falls_from_the_peak_to_zero_and_constant_stays():
    assert lr(0, "cosine") == 1.0 and lr(50, "cosine") == pytest.approx(0.5) and lr(100, "cosine") == 0.0
    factors = [lr(s, "cosine") for s in range(101)]
    assert factors == sorted(factors, reverse=True)
    assert {lr(s, "constant") for s in (0, 50, 100)} == {1.0}


def test_warmup_climbs_linearly_from_the_unscaled_rate_then_hands_over():
    kw = dict(warmup_epochs=2, warmup_start=0.25)
    assert lr(0, "constant", **kw) == 0.25 and lr(10, "constant", **kw) == pytest.approx(0.625)
    assert lr(20, "constant", **kw) == 1.0
    assert lr(20, "cosine", **kw) == 1.0 and lr(60, "cosine", **kw) == pytest.approx(0.5)


def test_step_divides_at_milestones_and_exponential_decays_per_epoch():
    kw = dict(milestones=(3, 6), gamma=0.1)
    assert [lr(s, "step", **kw) for s in (29, 30, 59, 60)] == pytest.approx([1, 0.1, 0.1, 0.01])
    assert lr(25, "exponential", gamma=0.5) == pytest.approx(0.5 ** 2.5)


def test_scheduler_changes_the_rate_every_step():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.4)
    schedule, hooks = LRSchedule(OptimConfig(epochs=1, lr=0.4, lr_schedule="cosine"), lr_scale=1), trainer.Hooks()
    rates = []
    for step in range(4):
        schedule.apply(optimizer, hooks.position(1, step, 4))
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
    assert rates == pytest.approx([0.4, 0.4 * (0.5 + 0.5 * 2 ** -0.5), 0.2, 0.4 * (0.5 - 0.5 * 2 ** -0.5)])
