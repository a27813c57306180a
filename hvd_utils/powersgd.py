"""PowerSGD over Horovod (--powersgd-rank): gradients averaged as low-rank factors with error feedback.

For jobs a slow link holds up (docs/speed.md). The arithmetic (Vogels, Karimireddy and Jaggi, NeurIPS 2019; Plan,
LowRank), over any averaging collective: each compressed gradient, viewed as a matrix M (n x m: its first dimension
by the rest), plus what this rank left out of its earlier gradients (error feedback), is averaged as P Q^T: P = M Q
averaged over the ranks (one fused allreduce of every layer's P, with the uncompressed tensors beside it),
orthonormalized, Q = M^T P averaged (one fused allreduce). Each rank keeps M - P Q^T for its next step; Q is carried
to the next step (warm start: one power iteration a step refines the same subspace). With a full rank, P spans M's
columns and P Q^T is the plain mean. The bytes a step sends: (n + m) x rank per compressed tensor instead of n x m.

PowerSGDOptimizer is used like hvd.DistributedOptimizer: zero_grad(), backward() (as many passes as
--batches-per-allreduce: their gradients accumulate in .grad and are compressed once), then step(), or
synchronize(), look at the averaged gradients (clip them), then step() inside skip_synchronize(). For the first
start_step steps the gradients are averaged as they are, in one fused allreduce. Under --amp fp16 the scaler's
unscale comes before the compression (an inf must not reach the residuals or Q, which last): the ranks agree
whether any found one, and a step with one changes nothing on any rank.

Its state (the step count, Q, every rank's residuals) travels in the optimizer's state dict under "powersgd", so
epoch and step checkpoints hold it and a resume on as many ranks goes on bitwise; on another number of ranks the
residuals, each a rank's own, start again from zero (said in one line).
"""
import math
from typing import Any, Callable, Mapping, Optional, Sequence, Union, cast

import horovod.torch as hvd
import torch

from hvd_utils.comm import gather_to, scatter_from
from hvd_utils.wrapped import WrappedOptimizer

SEED = 0x5EED  # Q's first values: the same on every rank, from a generator of its own (no rank's RNG stream moves)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """How a gradient of `shape` is viewed as a matrix: its first dimension by the product of the others."""
    return shape[0], math.prod(shape[1:])


def worth_compressing(shape: Sequence[int], rank: int, min_compression: float) -> bool:
    """A tensor of 2 or more dimensions whose rank-`rank` factors would take at most 1/min_compression of its
    elements (DDP's rule); 1-d and small tensors go through the plain average."""
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    return n * m > min_compression * (n + m) * min(rank, n, m)


def orthonormalize_(p: torch.Tensor) -> torch.Tensor:
    """p's columns made orthonormal in place: a QR's Q (as DDP's hook above rank 2). One pass of Gram-Schmidt is
    far from orthonormal where M's rank is below R or its singular values spread out (P Q^T then overshot M 2.5x);
    QR also gives a zero or tiny P orthonormal columns, so Q never gets stuck at zero."""
    return p.copy_(torch.linalg.qr(p).Q)


class Plan:
    """Which of a list of tensor shapes are compressed (by index, with their matrix shapes and the rank each gets:
    at most the matrix's smaller side), which are averaged as they are, and the elements each way sends."""

    def __init__(self, shapes: Sequence[Sequence[int]], rank: int, min_compression: float) -> None:
        self.rank, self.min_compression = rank, min_compression
        self.compressed = {i: (*matrix_shape(s), min(rank, *matrix_shape(s))) for i, s in enumerate(shapes)
                           if worth_compressing(s, rank, min_compression)}
        self.plain = [i for i in range(len(shapes)) if i not in self.compressed]
        self.full_elements = sum(math.prod(s) for s in shapes)
        self.plain_elements = sum(math.prod(shapes[i]) for i in self.plain)
        self.factor_elements = sum((n + m) * r for n, m, r in self.compressed.values())

    @property
    def sent_elements(self) -> int:
        return self.plain_elements + self.factor_elements

    @property
    def ratio(self) -> float:
        """Elements a plain average sends per element PowerSGD sends."""
        return self.full_elements / max(1, self.sent_elements)

    def key(self) -> list[Union[int, list[tuple[int, int, int, int]]]]:
        """What a saved state must match to be carried on: the rank and each compressed tensor's matrix."""
        return [self.rank, sorted((i, n, m, r) for i, (n, m, r) in self.compressed.items())]


class LowRank:
    """One rank's PowerSGD state over a fixed list of tensors: Q per compressed tensor (the same on every rank) and
    this rank's residuals (its own). reduce() averages one list of gradients."""

    residuals: Optional[dict[int, torch.Tensor]]

    def __init__(self, plan: Plan, device: torch.device) -> None:
        self.plan = plan
        gen = torch.Generator().manual_seed(SEED)
        self.q = {i: torch.randn(m, r, generator=gen).to(device) for i, (n, m, r) in sorted(plan.compressed.items())}
        self.residuals = None  # {i: n x m}, made at the first compressed step

    def reduce(self, grads: Sequence[torch.Tensor],
               mean: Callable[[list[tuple[str, torch.Tensor]]], list[torch.Tensor]],
               into: Optional[Sequence[torch.Tensor]] = None) -> list[torch.Tensor]:
        """The average over the ranks of `grads` (one per planned tensor, any dtype), compressed where planned.
        mean(list of (name, flat tensor)) -> their averages over the ranks, run together (every rank calls it
        the same way). Returns tensors shaped and typed like `grads`: new ones, or `into`'s (a list like grads,
        which may be grads itself), written in place: P Q^T straight into a float32 gradient saves a copy of
        every compressed gradient a step."""
        plan, out = self.plan, [None] * len(grads)
        if not plan.compressed:  # nothing worth compressing (a small model, a high rank): the plain average
            return plain_mean(grads, mean, into)
        if self.residuals is None:
            self.residuals = {i: torch.zeros(n, m, device=grads[i].device) for i, (n, m, _) in plan.compressed.items()}
        order = sorted(plan.compressed)
        for i in order:  # Q orthonormal first (the same on every rank): P keeps M's scale, not its square's
            orthonormalize_(self.q[i])
        # M made in the residual's own buffer (residual + gradient; M - P Q^T below is the next residual): a fresh
        # tensor of every compressed gradient's size a step cost more than the three products together.
        ms = {i: self.residuals[i].add_(grads[i].detach().reshape(self.residuals[i].shape)) for i in order}
        ps = [ms[i] @ self.q[i] for i in order]
        sent = [("powersgd.p", _flat(ps))]
        if plan.plain:
            sent.append(("powersgd.plain", _flat([grads[i].detach().float() for i in plan.plain])))
        averaged = mean(sent)
        ps = [orthonormalize_(p) for p in _unflat(averaged[0], ps)]
        local_qs = [ms[i].T @ p for i, p in zip(order, ps)]  # M^T P: this rank's, averaged next
        if plan.plain:
            for i, g in zip(plan.plain, _unflat(averaged[1], [grads[i] for i in plan.plain])):
                out[i] = _put(g, grads[i], into and into[i])
        qs = mean([("powersgd.q", _flat(local_qs))])[0]
        for i, p, q in zip(order, ps, _unflat(qs, local_qs)):
            self.q[i] = q.clone()  # warm start: the next step's power iteration begins from it
            target: Optional[torch.Tensor] = into and into[i]
            if target is not None and target.dtype == torch.float32 and target.is_contiguous():
                approx = torch.matmul(p, q.T, out=target.view(ms[i].shape))  # ms[i] is no view of grads[i]
                out[i] = target
            else:
                approx = p @ q.T
                out[i] = _put(approx.reshape(grads[i].shape), grads[i], target)
            self.residuals[i] = ms[i].sub_(approx)  # error feedback: what the average left out of this rank's own
        return out


def plain_mean(grads: Sequence[torch.Tensor], mean: Callable[[list[tuple[str, torch.Tensor]]], list[torch.Tensor]],
               into: Optional[Sequence[torch.Tensor]] = None) -> list[torch.Tensor]:
    """The uncompressed average of `grads` (before the start step): one fused collective. Written into `into`'s
    tensors where given (as LowRank.reduce)."""
    averaged = mean([("powersgd.all", _flat([g.detach() for g in grads]))])[0]
    return [_put(a, g, into and into[i]) for i, (a, g) in enumerate(zip(_unflat(averaged, grads), grads))]


def _put(value: torch.Tensor, like: torch.Tensor, target: Optional[torch.Tensor]) -> torch.Tensor:
    """`value` typed like `like`: copied into `target` where there is one, else a new tensor."""
    return value.to(like.dtype) if target is None else target.copy_(value.view(target.shape))


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in tensors]) if tensors else torch.zeros(0)


def _unflat(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for t in like:
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


class PowerSGDOptimizer(WrappedOptimizer):
    """`optimizer` (over the model's parameters, not stepped yet) whose gradients are averaged by PowerSGD at
    `rank` from step `start_step` (None: set later by prepare(), from the run's steps); `compression`: what P, Q
    and the uncompressed tensors travel as (Horovod's fp16, the app's bf16, or none)."""

    scaler: Optional[torch.amp.GradScaler]
    loaded: Optional[Mapping[str, Any]]
    restarted: Optional[str]

    def __init__(self, optimizer: torch.optim.Optimizer, rank: int, start_step: Optional[int], min_compression: float,
                 compression: type[hvd.compression.Compressor] = hvd.Compression.none) -> None:
        self.optimizer, self.compression, self.start_step = optimizer, compression, start_step
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.plan = Plan([p.shape for p in self.params], rank, min_compression)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.lowrank = LowRank(self.plan, device)
        self.steps = 0         # gradients averaged so far (steps an fp16 overflow skipped are not counted)
        self.scaler = None     # --amp fp16: unscaled here, before the compression (attach_scaler)
        self.synced = False
        self.loaded = None     # the compression state load_state_dict() took, until broadcast_from() deals it
        self.restarted = None  # why a resumed run's compression state started again, for the run's log

    def attach_scaler(self, scaler: Optional[torch.amp.GradScaler]) -> None:
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None

    @property
    def compressing(self) -> bool:
        return self.start_step is not None and self.steps >= self.start_step

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.synced = False
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Horovod: every rank's gradients averaged, low-rank from the start step on."""
        for p in self.params:  # a parameter this rank's batch did not reach still takes part, with zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        with torch.profiler.record_function("horovod_synchronize"):
            if self.scaler is not None and self._overflowed():
                self.synced = True
                return  # the scaler skips this step on every rank; the residuals and Q stay as they were
            grads = [p.grad for p in self.params]  # the averages are written back into them
            if self.compressing:
                self.lowrank.reduce(grads, self._mean, into=grads)
            else:
                plain_mean(grads, self._mean, into=grads)
        self.steps += 1
        self.synced = True

    def _overflowed(self):
        """--amp fp16: the gradients unscaled, and whether any rank found an inf or NaN (then every rank's scaler
        skips the step)."""
        self.scaler.unscale_(self)
        found = self.scaler._per_optimizer_states[id(self)]["found_inf_per_device"]
        flag = sum(v.float().sum() for v in found.values()) if found else torch.zeros(())
        total = hvd.allreduce(torch.as_tensor(flag, dtype=torch.float32).cpu().reshape(1), op=hvd.Sum,
                              name="powersgd.found_inf")
        for device in found:
            found[device].fill_(float(total.item() > 0))
        return total.item() > 0

    def _mean(self, named: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Horovod: the average over the ranks of each (name, flat tensor), all in flight at once (fused)."""
        handles = []
        for name, tensor in named:
            sent, ctx = self.compression.compress(tensor)
            handles.append((hvd.allreduce_async(sent, op=hvd.Average, name=name), ctx))
        return [self.compression.decompress(hvd.synchronize(h), ctx).float() for h, ctx in handles]

    # ----------------------------------------------------------------------------------------------------------------
    # Checkpoints: the wrapped optimizer's state, plus the compression's.

    def state_dict(self, root_rank: Optional[int] = None) -> dict[str, Any]:
        """The wrapped optimizer's state dict with "powersgd": the step count, Q, and every rank's residuals in
        rank order (a collective; root_rank: gathered to that rank alone, the others' entry holding none)."""
        state = {**self.optimizer.state_dict(), "powersgd": self.compression_state(root_rank)}
        return state

    def compression_state(self, root_rank: Optional[int] = None) -> dict[str, Any]:
        res = self.lowrank.residuals
        residuals = None
        if res:  # on the CPU: rank 0 holds every rank's at a checkpoint, never on its GPU
            own = torch.cat([res[i].reshape(-1) for i in sorted(res)]).cpu()
            if root_rank is None:
                residuals = list(hvd.allgather(own.unsqueeze(0), name="powersgd.residuals"))
            else:
                gathered = gather_to(root_rank, own, "powersgd.residuals")
                residuals = list(gathered.view(hvd.size(), -1)) if hvd.rank() == root_rank else None
        return {"key": self.plan.key(), "steps": self.steps, "world_size": hvd.size(),
                "q": {i: q.cpu().clone() for i, q in self.lowrank.q.items()}, "residuals": residuals}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """A checkpoint's (rank 0 reads it): the wrapped optimizer takes its part, the compression state waits
        for broadcast_from(). A checkpoint of a run without PowerSGD starts the compression afresh."""
        inner = {k: v for k, v in state_dict.items() if k != "powersgd"}
        self.optimizer.load_state_dict(inner)
        self.loaded = state_dict.get("powersgd")

    def broadcast_from(self, root_rank: int = 0) -> None:
        """Horovod: the wrapped optimizer's state from root_rank (as the app broadcasts any optimizer's), then the
        compression state it loaded: the step count and Q to every rank, each rank's residuals to that rank."""
        if hvd.broadcast_object(bool(self.optimizer.state), root_rank, "optimizer_has_state"):
            hvd.broadcast_optimizer_state(self.optimizer, root_rank=root_rank)
        loaded = self.loaded if hvd.rank() == root_rank else None
        self.loaded = None
        meta = hvd.broadcast_object(None if loaded is None else {k: v for k, v in loaded.items() if k != "residuals"},
                                    root_rank, "powersgd.state")
        if meta is None:
            return
        self.steps = meta["steps"]  # the start step counts from the run's first step, resumes or not
        if meta["key"] != self.plan.key():
            self.restarted = ("the checkpoint's PowerSGD compressed other tensors or at another rank: Q and the "
                              "residuals start again")
            return
        device = self.lowrank.q[next(iter(self.lowrank.q))].device if self.lowrank.q else torch.device("cpu")
        self.lowrank.q = {i: q.to(device) for i, q in meta["q"].items()}
        has = hvd.broadcast_object(bool(loaded and loaded.get("residuals")), root_rank, "powersgd.has_residuals")
        if not has:
            return
        if meta["world_size"] != hvd.size():
            self.restarted = (f"the checkpoint was written by {meta['world_size']} ranks and {hvd.size()} run now: "
                              f"each rank's PowerSGD residuals (its own) start again from zero; Q goes on")
            return
        own = scatter_from(root_rank,
                           cast("Mapping[str, Any]", loaded)["residuals"] if hvd.rank() == root_rank else None,
                           "powersgd.residuals")
        self.lowrank.residuals, at = {}, 0
        for i in sorted(self.plan.compressed):
            n, m, _ = self.plan.compressed[i]
            self.lowrank.residuals[i] = own[at:at + n * m].view(n, m).to(device).clone()
            at += n * m


def prepare(optimizer: Union[torch.optim.Optimizer, WrappedOptimizer], scaler: Optional[torch.amp.GradScaler],
            run_steps: int, steps_done: int = 0) -> Optional[int]:
    """Before training: the scaler attached (unscaled before the compression), the step count taken from the run
    where its checkpoint had none (a run resumed from one written without PowerSGD), and the start step, where
    left to the run, set to 10% of its optimizer steps (DDP's advice). Returns the start step (None: no
    PowerSGD)."""
    if not isinstance(optimizer, PowerSGDOptimizer):
        return None
    optimizer.attach_scaler(scaler)
    if optimizer.steps == 0:
        optimizer.steps = steps_done
    if optimizer.start_step is None:
        optimizer.start_step = run_steps // 10
    return optimizer.start_step


def describe(optimizer: Union[torch.optim.Optimizer, WrappedOptimizer]) -> Optional[dict[str, Any]]:
    """PowerSGD's plan for the start line and the epoch records: {rank, start_step, compressed, plain (tensors),
    bytes_plain and bytes_powersgd (a step's gradients on the wire, per rank), ratio, compressing (now)}; None
    without PowerSGD."""
    if not isinstance(optimizer, PowerSGDOptimizer):
        return None
    plan = optimizer.plan
    size = 2 if optimizer.compression is not hvd.Compression.none else 4  # fp16 and bf16 travel in 2 bytes
    return {"rank": plan.rank, "start_step": optimizer.start_step, "compressed": len(plan.compressed),
            "plain": len(plan.plain), "bytes_plain": plan.full_elements * size,
            "bytes_powersgd": plan.sent_elements * size, "ratio": plan.ratio, "compressing": optimizer.compressing,
            "restarted": optimizer.restarted}
