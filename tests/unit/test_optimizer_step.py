"""One optimizer step: weight decay groups, optimizers by name, gradient accumulation, clipping, bf16 autocast."""
import pytest
import torch

from hvd_train import trainer
from hvd_train.training import build_optimizer, param_groups
from hvd_train.config import HorovodConfig, OptimConfig
from hvd_train.models import build_model

from conftest import trainer_for


def test_biases_and_norm_layers_get_no_weight_decay_unless_asked():
    model = build_model("resnet18", 3, 10, 32)
    groups = param_groups(model, 5e-4)
    decayed, free = groups[0]["params"], groups[1]["params"]
    assert all(p.ndim > 1 for p in decayed) and all(p.ndim == 1 for p in free) and free
    assert groups[1]["weight_decay"] == 0.0
    assert len(param_groups(model, 5e-4, decay_norm_and_bias=True)) == 1


@pytest.mark.parametrize("name,cls", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam),
                                      ("adamw", torch.optim.AdamW)])
def test_optimizers_by_name(name, cls):
    model = build_model("small_cnn", 1, 10, 8)
    optimizer = build_optimizer(model, OptimConfig(optimizer=name, weight_decay=1e-4), lr=0.1)
    assert isinstance(optimizer, cls) and optimizer.param_groups[0]["lr"] == 0.1


def test_gradient_accumulation_splits_the_batch_without_changing_the_gradient():
    torch.manual_seed(0)
    images, labels = torch.randn(12, 1, 8, 8), torch.randint(0, 10, (12,))
    results = []
    for accumulate in (1, 3, 5):  # 5 does not divide 12: the chunks are weighted by size
        torch.manual_seed(1)
        model = build_model("small_cnn", 1, 10, 8).eval()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        stepper = trainer_for(model, optimizer, horovod=HorovodConfig(batches_per_allreduce=accumulate))
        sums = trainer.train_step(stepper, (images, labels))
        assert int(sums["count"]) == 12
        results.append([p.detach().clone() for p in model.parameters()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_clipping_bounds_the_update():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    stepper = trainer_for(model, optimizer, optim=OptimConfig(clip_grad=0.01))
    trainer.train_step(stepper, (100 * torch.randn(8, 4), torch.zeros(8).long()))
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert moved.norm() == pytest.approx(0.01, rel=1e-4)


def test_bf16_autocast_runs_the_forward_in_bfloat16_on_the_cpu():
    model = torch.nn.Linear(4, 2)
    with trainer.autocast(torch.device("cpu"), "bf16"):
        assert model(torch.randn(3, 4)).dtype == torch.bfloat16
    with trainer.autocast(torch.device("cpu"), "off"):
        assert model(torch.randn(3, 4)).dtype == torch.float32
