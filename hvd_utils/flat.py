"""Parameters laid out flat for the sharded optimizer (hvd_utils/zero.py): one padded buffer for a parameter group's
weights and one for its gradients, in buckets dealt in equal parts over the ranks, and the conversions between
that layout, each parameter's own shape, and the slices the ranks own."""
import math

import torch


class Bucket:
    """Parameters lo..hi-1 of a group, at `start` in the padded buffer, dealt in `size` parts of `part` elements;
    this rank's part sits at `at` in its slice."""

    def __init__(self, lo, hi, start, part, at):
        self.lo, self.hi, self.start, self.part, self.at = lo, hi, start, part, at


class FlatGroup:
    """One parameter group laid out flat: its parameters in order, in buckets of about `bucket` elements (whole
    parameters), each padded to a multiple of the `size` ranks and dealt in equal parts. The weights themselves
    live in one padded buffer (each parameter's .data a view of it), so this rank's part of every bucket is a view
    the optimizer steps in place: no copy of the weights is kept. Its slice is those parts back to back. Buckets let
    the reducescatter of the last layers' gradients start while backward() computes the first ones, and bound the
    collectives' buffers."""

    def __init__(self, params, rank, size, bucket):
        self.params, self.rank, self.size = params, rank, size
        self.buckets, self.offsets = [], []  # offsets: each parameter's in the padded buffer
        lo, count, start, at = 0, 0, 0, 0
        for i, p in enumerate(params + [None]):
            if p is None or (count and count + p.numel() > bucket):
                part = max(1, math.ceil(count / size))
                self.buckets.append(Bucket(lo, i, start, part, at))
                lo, start, at, count = i, start + size * part, at + part, 0
            if p is not None:
                self.offsets.append(start + count)
                count += p.numel()
        self.total, self.length = start, at
        self.bucket_of = [b for b in self.buckets for _ in range(b.lo, b.hi)]
        first = params[0]
        self.values = torch.zeros(self.total, dtype=first.dtype, device=first.device)
        self.bind()
        self.parts = [self.values[b.start + rank * b.part:b.start + (rank + 1) * b.part] for b in self.buckets]
        # The gradients live in one padded buffer that backward() accumulates into (each parameter's .grad a view
        # of it): a bucket's reducescatter sends its part as it is, with no copy made each step.
        self.grads = torch.zeros(self.total, dtype=first.dtype, device=first.device)

    @torch.no_grad()
    def bind(self):
        """Every parameter's .data a view of the weights' buffer, with the values it holds now. Again whenever a
        parameter was given other storage since (model.to(), load_state_dict(assign=True))."""
        for i, p in enumerate(self.params):
            view = self.view(self.values, i)
            if p.data.data_ptr() != view.data_ptr():
                view.copy_(p.data)
                p.data = view

    def joined(self, tensors):
        """One tensor per part, as one slice."""
        return torch.cat(list(tensors))

    def split(self, slice_):
        """A slice as one view per part."""
        return [slice_[b.at:b.at + b.part] for b in self.buckets]

    def attach_grads(self):
        """Every parameter's .grad a view of the zeroed buffer."""
        self.grads.zero_()
        for p, view in zip(self.params, self.unflatten(self.grads)):
            p.grad = view

    def bucket_grads(self, b):
        """Bucket b's padded gradients: its part of the buffer (a .grad replaced since zero_grad() copied in)."""
        for i in range(b.lo, b.hi):
            p, view = self.params[i], self.view(self.grads, i)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
        return self.grads[b.start:b.start + self.size * b.part]

    @torch.no_grad()
    def write(self, b, gathered):
        """Bucket b's padded values, gathered from every rank, into the weights' buffer (one copy)."""
        self.values[b.start:b.start + self.size * b.part].copy_(gathered)

    def view(self, flat, i):
        p = self.params[i]
        return flat[self.offsets[i]:self.offsets[i] + p.numel()].view(p.shape)

    def flat(self, tensors):
        """`tensors` (one per parameter, None for zeros) as one padded buffer."""
        first = next((t for t in tensors if t is not None), self.params[0])
        out = torch.zeros(self.total, dtype=first.dtype, device=self.values.device)
        for i, t in enumerate(tensors):
            if t is not None:
                self.view(out, i).copy_(t)
        return out

    def unflatten(self, flat):
        """A padded buffer back into one tensor per parameter, shaped like it (views)."""
        return [self.view(flat, i) for i in range(len(self.params))]

    def own(self, flat):
        """This rank's slice of a padded buffer."""
        return torch.cat([flat[b.start + self.rank * b.part:b.start + (self.rank + 1) * b.part] for b in self.buckets])

    def from_gathered(self, gathered):
        """Every rank's slice, back to back in rank order (an allgather's result), as one padded buffer."""
        by_rank = gathered.view(self.size, self.length)
        out = torch.empty(self.total, dtype=gathered.dtype, device=gathered.device)
        for b in self.buckets:
            out[b.start:b.start + self.size * b.part].view(self.size, b.part).copy_(by_rank[:, b.at:b.at + b.part])
        return out
