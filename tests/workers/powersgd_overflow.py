"""--amp fp16 with PowerSGD on 2 ranks, through the app's own step (engine.train_step): a gradient scaler
(torch's, on the CPU) unscales before the compression; at the second step rank 1 alone has an infinite gradient.

    powersgd_overflow.py

Prints one JSON line per rank: whether the weights, Q and the residuals changed at each step, and the loss scale
after it. Every rank must skip the step with the inf (weights, Q, residuals untouched; scale halved), none only
some.
"""
import json

import torch

import hvd_utils
from hvd_train.trainer import StepOptions, Trainer, train_step


class Task:
    """A least-squares task whose gradient can be made infinite on one rank."""
    name, poison = "lsq", False

    def samples(self, batch):
        return batch[0].shape[0]

    def step(self, model, batch):
        x, y = batch
        loss = ((model(x) - y) ** 2).mean()
        if self.poison:
            loss = loss * torch.tensor(float("inf"))
        return loss, {"count": torch.tensor(float(x.shape[0])), "loss": loss.detach() * x.shape[0]}


def main():
    rt = hvd_utils.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 24)
    optimizer = hvd_utils.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                                hvd_utils.WireOptions(powersgd=hvd_utils.PowerSGD(1, 0, 2.0)))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    hvd_utils.broadcast_state(model, optimizer)
    hvd_utils.prepare_compression(optimizer, scaler, 10)
    task = Task()
    trainer = Trainer(model=model, task=task, optimizer=optimizer, schedule=None, device=torch.device("cpu"),
                      opts=StepOptions(), scaler=scaler)
    gen = torch.Generator().manual_seed(rt.rank)
    steps = []
    for poison in (False, True, False):
        task.poison = poison and rt.rank == 1
        before = (model.weight.detach().clone(), optimizer.lowrank.q[0].clone(),
                  None if optimizer.lowrank.residuals is None else optimizer.lowrank.residuals[0].clone())
        train_step(trainer, (torch.randn(8, 32, generator=gen), torch.randn(8, 24, generator=gen)))
        after = (model.weight, optimizer.lowrank.q[0], optimizer.lowrank.residuals[0])
        steps.append({"weights": not torch.equal(before[0], after[0]), "q": not torch.equal(before[1], after[1]),
                      "residuals": before[2] is None or not torch.equal(before[2], after[2]),
                      "scale": scaler.get_scale(), "finite": bool(torch.isfinite(after[2]).all())})
    print(json.dumps({"rank": rt.rank, "steps": steps}), flush=True)


if __name__ == "__main__":
    main()
