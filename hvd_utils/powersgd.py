"""PowerSGD's arithmetic (Vogels, Karimireddy and Jaggi, NeurIPS 2019): low-rank gradient averaging with error
feedback, over any averaging collective. hvd_utils/powersgd_optimizer.py runs it over Horovod's.

Each compressed gradient, viewed as a matrix M (n x m: its first dimension by the rest), plus what this rank left
out of its earlier gradients (error feedback), is averaged as P Q^T: P = M Q averaged over the ranks (one fused
allreduce of every layer's P, with the uncompressed tensors beside it), orthonormalized, Q = M^T P averaged (one
fused allreduce). Each rank keeps M - P Q^T for its next step; Q is carried to the next step (warm start: one power
iteration a step refines the same subspace). With a full rank, P spans M's columns and P Q^T is the plain mean.

The bytes a step sends: (n + m) x rank per compressed tensor instead of n x m.
"""
import math

import torch

SEED = 0x5EED  # Q's first values: the same on every rank, from a generator of its own (no rank's RNG stream moves)


def matrix_shape(shape):
    """How a gradient of `shape` is viewed as a matrix: its first dimension by the product of the others."""
    return shape[0], math.prod(shape[1:])


def worth_compressing(shape, rank, min_compression):
    """A tensor of 2 or more dimensions whose rank-`rank` factors would take at most 1/min_compression of its
    elements (DDP's rule); 1-d and small tensors go through the plain average."""
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    return n * m > min_compression * (n + m) * min(rank, n, m)


def orthonormalize_(p):
    """p's columns made orthonormal in place: a QR's Q (as DDP's hook above rank 2). One pass of Gram-Schmidt is
    far from orthonormal where M's rank is below R or its singular values spread out (P Q^T then overshot M 2.5x);
    QR also gives a zero or tiny P orthonormal columns, so Q never gets stuck at zero."""
    return p.copy_(torch.linalg.qr(p).Q)


class Plan:
    """Which of a list of tensor shapes are compressed (by index, with their matrix shapes and the rank each gets:
    at most the matrix's smaller side), which are averaged as they are, and the elements each way sends."""

    def __init__(self, shapes, rank, min_compression):
        self.rank, self.min_compression = rank, min_compression
        self.compressed = {i: (*matrix_shape(s), min(rank, *matrix_shape(s))) for i, s in enumerate(shapes)
                           if worth_compressing(s, rank, min_compression)}
        self.plain = [i for i in range(len(shapes)) if i not in self.compressed]
        self.full_elements = sum(math.prod(s) for s in shapes)
        self.plain_elements = sum(math.prod(shapes[i]) for i in self.plain)
        self.factor_elements = sum((n + m) * r for n, m, r in self.compressed.values())

    @property
    def sent_elements(self):
        return self.plain_elements + self.factor_elements

    @property
    def ratio(self):
        """Elements a plain average sends per element PowerSGD sends."""
        return self.full_elements / max(1, self.sent_elements)

    def key(self):
        """What a saved state must match to be carried on: the rank and each compressed tensor's matrix."""
        return [self.rank, sorted((i, n, m, r) for i, (n, m, r) in self.compressed.items())]


class LowRank:
    """One rank's PowerSGD state over a fixed list of tensors: Q per compressed tensor (the same on every rank) and
    this rank's residuals (its own). reduce() averages one list of gradients."""

    def __init__(self, plan, device):
        self.plan = plan
        gen = torch.Generator().manual_seed(SEED)
        self.q = {i: torch.randn(m, r, generator=gen).to(device) for i, (n, m, r) in sorted(plan.compressed.items())}
        self.residuals = None  # {i: n x m}, made at the first compressed step

    def reduce(self, grads, mean, into=None):
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
            target = into and into[i]
            if target is not None and target.dtype == torch.float32 and target.is_contiguous():
                approx = torch.matmul(p, q.T, out=target.view(ms[i].shape))  # ms[i] is no view of grads[i]
                out[i] = target
            else:
                approx = p @ q.T
                out[i] = _put(approx.reshape(grads[i].shape), grads[i], target)
            self.residuals[i] = ms[i].sub_(approx)  # error feedback: what the average left out of this rank's own
        return out


def plain_mean(grads, mean, into=None):
    """The uncompressed average of `grads` (before the start step): one fused collective. Written into `into`'s
    tensors where given (as LowRank.reduce)."""
    averaged = mean([("powersgd.all", _flat([g.detach() for g in grads]))])[0]
    return [_put(a, g, into and into[i]) for i, (a, g) in enumerate(zip(_unflat(averaged, grads), grads))]


def _put(value, like, target):
    """`value` typed like `like`: copied into `target` where there is one, else a new tensor."""
    return value.to(like.dtype) if target is None else target.copy_(value.view(target.shape))


def _flat(tensors):
    return torch.cat([t.reshape(-1).float() for t in tensors]) if tensors else torch.zeros(0)


def _unflat(flat, like):
    out, at = [], 0
    for t in like:
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out
