"""PowerSGD's arithmetic (hvd_utils/powersgd.py) on CPU tensors, with ranks as threads that average through a
barrier: what Horovod's allreduce does between processes."""
import threading

import torch

from hvd_utils.powersgd import LowRank, Plan, orthonormalize_, plain_mean, worth_compressing


class Ranks:
    """`size` ranks in threads; mean_for(r) is rank r's averaging collective."""

    def __init__(self, size):
        self.size, self.barrier, self.slots = size, threading.Barrier(size), {}

    def mean_for(self, rank):
        def mean(named):
            self.slots[rank] = [t.clone() for _, t in named]
            self.barrier.wait()
            out = [torch.stack([self.slots[k][j] for k in range(self.size)]).mean(0) for j in range(len(named))]
            self.barrier.wait()
            return out
        return mean

    def run(self, work):
        """work(rank, mean) on every rank at once; returns their results in rank order."""
        results = [None] * self.size
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, work(r, self.mean_for(r))))
                   for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


def grads_of(seed, shapes):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen) for s in shapes]


SHAPES = [(6, 4), (3, 2, 2), (5,)]  # a matrix, a conv-like tensor (3 x 4), a bias


def test_full_rank_gives_the_plain_mean():
    plan = Plan(SHAPES, rank=4, min_compression=0)  # compressed even where it saves nothing
    assert sorted(plan.compressed) == [0, 1] and plan.plain == [2]
    grads = [grads_of(r, SHAPES) for r in range(2)]
    mean = [torch.stack([grads[0][i], grads[1][i]]).mean(0) for i in range(len(SHAPES))]
    out = Ranks(2).run(lambda r, m: LowRank(plan, "cpu").reduce(grads[r], m))
    for rank_out in out:
        for got, want in zip(rank_out, mean):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(out[0][2], mean[2])  # the bias went through the plain average, untouched


def test_every_rank_gets_the_same_average_and_keeps_its_own_residual():
    plan = Plan([(16, 12)], rank=1, min_compression=2)
    grads = [grads_of(r, [(16, 12)]) for r in range(2)]

    def work(r, mean):
        low = LowRank(plan, "cpu")
        approx = low.reduce(grads[r], mean)[0]
        return approx, low.residuals[0]

    (a0, e0), (a1, e1) = Ranks(2).run(work)
    assert torch.equal(a0, a1)  # one average for all
    # Error feedback: each rank keeps exactly what the low-rank average left out of its own gradient.
    torch.testing.assert_close(a0 + e0, grads[0][0])
    torch.testing.assert_close(a1 + e1, grads[1][0])
    assert not torch.allclose(e0, e1)


def test_error_feedback_carries_what_was_left_out_into_later_steps():
    """With the same gradients every step, the steps' low-rank averages add up to the true mean's sum less the
    ranks' mean residual, which stays bounded: over many steps the average of the updates tends to the mean."""
    plan = Plan([(10, 8)], rank=1, min_compression=2)
    grads = [grads_of(10 + r, [(10, 8)]) for r in range(2)]
    true = (grads[0][0] + grads[1][0]) / 2
    steps = 200

    def work(r, mean):
        low, total = LowRank(plan, "cpu"), torch.zeros(10, 8)
        for _ in range(steps):
            total += low.reduce(grads[r], mean)[0]
        return total, low.residuals[0]

    (t0, e0), (_, e1) = Ranks(2).run(work)
    torch.testing.assert_close(t0, steps * true - (e0 + e1) / 2, rtol=1e-3, atol=1e-3)
    one_step = Ranks(2).run(lambda r, m: LowRank(plan, "cpu").reduce(grads[r], m)[0])[0]
    assert (t0 / steps - true).norm() < 0.05 * (one_step - true).norm()  # rank 1 alone misses most of it


def test_what_is_compressed():
    assert not worth_compressing((1000,), 1, 2)  # 1-d: always plain
    assert worth_compressing((64, 64), 4, 2)  # 4096 elements, factors 512
    assert not worth_compressing((4, 4), 4, 2)  # factors as large as the tensor
    plan = Plan([(64, 64), (64,)], rank=4, min_compression=2)
    assert plan.sent_elements == 128 * 4 + 64 and plan.full_elements == 4096 + 64
    assert round(plan.ratio, 2) == round(4160 / 576, 2)


def test_orthonormal_columns_and_the_plain_mean_before_the_start():
    p = orthonormalize_(torch.randn(20, 3, generator=torch.Generator().manual_seed(1)))
    torch.testing.assert_close(p.T @ p, torch.eye(3), rtol=1e-5, atol=1e-5)
    grads = [grads_of(r, SHAPES) for r in range(2)]
    out = Ranks(2).run(lambda r, m: plain_mean(grads[r], m))
    for i in range(len(SHAPES)):
        assert torch.equal(out[0][i], (grads[0][i] + grads[1][i]) / 2)


def test_a_low_rank_gradient_is_averaged_exactly_and_a_zero_step_does_not_stick():
    # After a step whose gradients were all zero (a layer no rank's batch reached), Q = M^T P is zero; the next
    # step must still average (Q orthonormalized first), and a gradient of rank 1 < R exactly (P spans M).
    plan = Plan([(64, 48)], rank=4, min_compression=2)
    gen = torch.Generator().manual_seed(3)
    direction = torch.randn(64, 1, generator=gen) @ torch.randn(1, 48, generator=gen)
    grads = [[direction * (r + 1)] for r in range(2)]

    def work(r, mean):
        low = LowRank(plan, "cpu")
        first = low.reduce([torch.zeros(64, 48)], mean)[0]
        return first, low.reduce(grads[r], mean)[0]

    for first, second in Ranks(2).run(work):
        assert torch.equal(first, torch.zeros(64, 48))
        torch.testing.assert_close(second, direction * 1.5, rtol=1e-4, atol=1e-4)


def test_nothing_worth_compressing_is_the_plain_mean_with_no_residuals():
    plan = Plan([(5,), (3, 2)], rank=4, min_compression=2)
    assert not plan.compressed
    grads = [grads_of(r, [(5,), (3, 2)]) for r in range(2)]
    lows = [LowRank(plan, "cpu") for _ in range(2)]
    out = Ranks(2).run(lambda r, m: lows[r].reduce(grads[r], m))
    assert torch.equal(out[0][1], (grads[0][1] + grads[1][1]) / 2) and lows[0].residuals is None


def test_written_into_the_gradients_it_is_what_it_returns_and_leaves_the_same_state():
    # PowerSGDOptimizer has reduce() write the averages into the .grad tensors it reads: P Q^T goes straight into a
    # float32 gradient, a bfloat16 one (and the plain tensors) take a copy. Two steps, for the warm start and the
    # residuals the first one left.
    shapes = [(6, 4), (3, 2, 2), (5,), (8, 6)]
    plan = Plan(shapes, rank=2, min_compression=0)

    def steps(rank, mean, in_place):
        low = LowRank(plan, "cpu")
        results = []
        for step in range(2):
            grads = grads_of(10 * rank + step, shapes)
            grads[3] = grads[3].to(torch.bfloat16)
            out = low.reduce(grads, mean, into=grads if in_place else None)
            if in_place:
                assert all(o is g for o, g in zip(out, grads))
            results.append([o.clone() for o in out])
        return results, low.q, low.residuals

    for (new, q, residuals), (written, q2, residuals2) in zip(Ranks(2).run(lambda r, m: steps(r, m, False)),
                                                              Ranks(2).run(lambda r, m: steps(r, m, True))):
        for a, b in zip(sum(new, []), sum(written, [])):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert all(torch.equal(q[i], q2[i]) and torch.equal(residuals[i], residuals2[i]) for i in q)
    full = Ranks(2).run(lambda r, m: plain_mean(grads_of(r, shapes), m))
    into = [grads_of(r, shapes) for r in range(2)]
    Ranks(2).run(lambda r, m: plain_mean(into[r], m, into=into[r]))
    assert all(torch.equal(a, b) for a, b in zip(full[0], into[0]))
