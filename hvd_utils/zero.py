"""ZeRO stage 1 over Horovod (--shard-optimizer): each rank keeps the optimizer state of a 1/N slice of the weights.

A step: backward() accumulates each parameter group's gradients into one flat buffer, in buckets padded to a
multiple of the ranks; as soon as a bucket's gradients are complete its reducescatter starts, so each rank receives
the average of its own part of every bucket while backward() goes on. The optimizer steps those parts, views of
the weights themselves, with state for them alone; an allgather a bucket then gives every rank every updated part.
The bytes on the wire are those of an allreduce (a reducescatter and an allgather are its two halves); the state
per rank is 1/N. Measured cost: docs/memory.md.

The flat layout (FlatGroup, Bucket): one padded buffer for a parameter group's weights and one for its gradients,
in buckets dealt in equal parts over the ranks, and the conversions between that layout, each parameter's own
shape, and the slices the ranks own.

Only element-wise optimizers can step a slice as they would the whole tensor (SGD, Adam, AdamW, Lion, ...): one
whose update looks at a tensor as a whole (LAMB's and LARS's trust ratios, Adafactor's factored moments) cannot,
and the config refuses it (hvd_train/config/schema.py: SHARDABLE). The state comes out of state_dict() in the
ordinary unsharded form (gathered from every rank: a collective) and goes into load_state_dict() in that form, so
checkpoints move between sharded and unsharded runs and across world sizes.
"""
import collections
import math
import os
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import horovod.torch as hvd
import torch

from hvd_utils.comm import broadcast_state_dict, gather_to
from hvd_utils.wrapped import WrappedOptimizer

GATHERS_IN_FLIGHT = 4  # allgathers of buckets under way at once: their outputs are what the step holds extra


class GatheredState(dict):
    """A sharded optimizer's state dict: gathered into tensors of its own, which no training step touches, so a
    checkpoint writer need not copy them before writing in the background (hvd_train/run/checkpoint.py)."""
    written_as_is = True


class ShardedOptimizer(WrappedOptimizer):
    """`optimizer` (built over the model's parameters, not stepped yet) turned into ZeRO-1: its parameter groups
    now hold this rank's slices, so its state covers 1/N of the weights. Used like hvd.DistributedOptimizer:
    zero_grad(), backward(), then step() (or synchronize(), look at the averaged slice gradients, then step() inside
    skip_synchronize())."""

    groups: list["FlatGroup"]
    handles: dict[tuple[int, int], tuple[int, Any]]  # (group, id(bucket)): its reducescatter's handle and context
    where: dict[torch.nn.Parameter, tuple[int, "Bucket"]]
    passes_seen: dict[torch.nn.Parameter, int]
    ready: dict[tuple[int, int], int]
    loaded: Optional[Mapping[str, Any]]
    committed: Optional[Mapping[str, Any]]

    def __init__(self, optimizer: torch.optim.Optimizer,
                 compression: type[hvd.compression.Compressor] = hvd.Compression.none, prescale: float = 1.0,
                 postscale: float = 1.0, backward_passes_per_step: int = 1, bucket_mb: Optional[float] = None) -> None:
        self.optimizer, self.compression = optimizer, compression
        self.prescale, self.postscale, self.passes = prescale, postscale, backward_passes_per_step
        # Horovod's fusion buffer (the app sets it before init): a bucket that fits is staged without allocating.
        bucket_bytes = (bucket_mb * 2**20 if bucket_mb else int(os.environ.get("HOROVOD_FUSION_THRESHOLD", 64 << 20)))
        self.params = [list(g["params"]) for g in optimizer.param_groups]
        itemsize = max((p.element_size() for ps in self.params for p in ps), default=4)
        self.bucket = max(1, bucket_bytes // itemsize)
        for params in self.params:
            dtypes = {(p.dtype, p.device) for p in params}
            if len(dtypes) > 1:
                raise ValueError(f"--shard-optimizer: a parameter group mixes dtypes or devices "
                                 f"({sorted(map(str, dtypes))}); give each its own group")
        self.groups, self.synced, self.handles = [], False, {}
        self.where, self.passes_seen, self.ready = {}, {}, {}
        self.loaded = None     # the unsharded state load_state_dict() took, until broadcast_from() sends it
        self.committed = None  # elastic: the last commit's unsharded state (hvd_utils/elastic.py)
        self.layout()
        for params in self.params:
            for p in params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def layout(self) -> None:
        """Slices for the current world size; the state of earlier slices is dropped (load_state_dict brings it)."""
        self.drain()
        self.world = (hvd.rank(), hvd.size())
        self.groups = [FlatGroup(params, *self.world, self.bucket) for params in self.params if params]
        self.where = {p: (gi, g.bucket_of[i]) for gi, g in enumerate(self.groups) for i, p in enumerate(g.params)}
        live = iter(self.groups)
        for group, params in zip(self.optimizer.param_groups, self.params):
            group["params"] = list(next(live).parts) if params else []
        self.optimizer.state.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.drain()
        self.synced = False
        for g in self.groups:
            g.attach_grads()
            for part in g.parts:
                part.grad = None

    def drain(self) -> None:
        """Wait for reducescatters still under way (a step given up after backward): Horovod's queue stays whole."""
        for handle, _ in self.handles.values():
            hvd.synchronize(handle)
        self.handles, self.passes_seen, self.ready = {}, {}, {}

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        """After backward() accumulated p's gradient: once the step's last pass has, and the rest of p's bucket
        too, that bucket's reducescatter starts (Horovod works on it while backward() goes on)."""
        seen = self.passes_seen[p] = self.passes_seen.get(p, 0) + 1
        if seen != self.passes or p not in self.where:
            return
        gi, b = self.where[p]
        key = (gi, id(b))
        self.ready[key] = self.ready.get(key, 0) + 1
        if self.ready[key] == b.hi - b.lo:
            self._launch(gi, b)

    def _launch(self, gi: int, b: "Bucket") -> None:
        if (gi, id(b)) in self.handles:
            return
        sent, ctx = self.compression.compress(self.groups[gi].bucket_grads(b))
        handle = hvd.reducescatter_async(sent, name=f"zero.grads.{gi}.{b.lo}", op=hvd.Average,
                                         prescale_factor=self.prescale, postscale_factor=self.postscale)
        self.handles[(gi, id(b))] = (handle, ctx)

    def synchronize(self) -> None:
        """Horovod: average the gradients, each rank receiving its own part of every bucket (the reducescatters
        backward() started, and those of buckets it did not finish)."""
        self.follow_workers()
        for gi, g in enumerate(self.groups):  # buckets whose gradients backward() did not all reach (unused)
            for b in g.buckets:
                self._launch(gi, b)
        with torch.profiler.record_function("horovod_synchronize"):
            for gi, g in enumerate(self.groups):
                g.bind()
                for b, part in zip(g.buckets, g.parts):
                    handle, ctx = self.handles.pop((gi, id(b)))
                    part.grad = self.compression.decompress(hvd.synchronize(handle), ctx).to(part.dtype)
        self.passes_seen, self.ready, self.synced = {}, {}, True

    def follow_workers(self) -> None:
        """Elastic: slices for the workers there are now. After a reset every survivor holds the same last commit
        (hvd_utils/elastic.py), restored: it is dealt again."""
        if self.world != (hvd.rank(), hvd.size()):
            if self.committed is None:
                raise RuntimeError("--shard-optimizer: the ranks changed without the optimizer state being reloaded")
            self.deal(self.committed)

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = super().step(closure)
        self.gather_weights()
        return loss

    @torch.no_grad()
    def gather_weights(self) -> None:
        """Horovod: every rank's updated part of each bucket to every rank (an allgather a bucket, a few under way
        at once, so their buffers stay small), written into the model."""
        pending: collections.deque[tuple[FlatGroup, Bucket, int]] = collections.deque()
        for gi, g in enumerate(self.groups):
            for b, part in zip(g.buckets, g.parts):
                pending.append((g, b, hvd.allgather_async(part, name=f"zero.weights.{gi}.{b.lo}")))
                if len(pending) >= GATHERS_IN_FLIGHT:
                    g0, b0, handle = pending.popleft()
                    g0.write(b0, hvd.synchronize(handle))
        for g, b, handle in pending:
            g.write(b, hvd.synchronize(handle))

    def agree_on_overflow(self, scaler: torch.amp.GradScaler) -> None:
        """--amp fp16: the scaler found infinities in this rank's slices only; every rank must skip the step, or
        none. (The scaler keeps its finding per optimizer; summed over the ranks here.)"""
        found = scaler._per_optimizer_states[id(self)]["found_inf_per_device"]
        for device, flag in found.items():
            found[device] = hvd.allreduce(flag, op=hvd.Sum, name=f"zero.found_inf.{device}")

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the averaged gradients to a global norm of max_norm: squares summed over this rank's slices, then
        over the ranks (padding adds zeros). Returns the norm before clipping."""
        parts = [part for g in self.groups for part in g.parts if part.grad is not None]
        local = sum((part.grad.float().pow(2).sum() for part in parts),
                    torch.zeros((), device=self.groups[0].values.device))
        total = hvd.allreduce(local, op=hvd.Sum, name="zero.grad_norm").sqrt()
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for part in parts:
            part.grad.mul_(factor.to(part.grad.dtype))
        return total

    # ----------------------------------------------------------------------------------------------------------------
    # The state in its unsharded form: what the wrapped optimizer's own state_dict() would hold over the whole model.

    def state_dict(self, root_rank: Optional[int] = None) -> Optional[GatheredState]:
        """Gathered from every rank (a collective: every rank calls it). Per-element state (momentum, moments) comes
        back shaped like its parameter; per-step values (Adam's step) are repeated for each parameter, as torch
        keeps them. root_rank: gathered to that rank alone, which returns it; the others return None and never
        hold more than their slices (a checkpoint, which one rank writes)."""
        self.follow_workers()
        inner = self.optimizer.state_dict()
        keys = []  # (group, key) of every per-element tensor, gathered in one call
        own = [self.state_of(g) for g in self.groups]
        for i, g in enumerate(self.groups):
            for key, values in own[i].items():
                if all(_per_element(key, v, part.shape) for v, part in zip(values, g.parts)):
                    keys.append((i, key))
        # One key at a time, each gathered buffer dropped once laid out: the whole state is held once, not twice.
        full = {}
        for n, (i, k) in enumerate(keys):
            part = self.groups[i].joined(own[i][k])
            if root_rank is None:
                full[(i, k)] = self.groups[i].from_gathered(hvd.allgather(part, name=f"zero.state.{n}"))
            else:
                gathered = gather_to(root_rank, part, f"zero.state.{n}")
                if hvd.rank() == root_rank:
                    full[(i, k)] = self.groups[i].from_gathered(gathered)
            del part
        if root_rank is not None and hvd.rank() != root_rank:
            return None
        state, param_groups, index = {}, [], 0
        live = iter(enumerate(self.groups))
        for group, params in zip(inner["param_groups"], self.params):
            ids = list(range(index, index + len(params)))
            param_groups.append({**group, "params": ids})
            index += len(params)
            if not params:
                continue
            i, g = next(live)
            per_param: list[dict[str, Any]] = [dict() for _ in params]
            for key, values in own[i].items():
                value = values[0]
                if (i, key) in full:  # views of a buffer made for this state dict alone: no copy needed
                    for d, t in zip(per_param, g.unflatten(full[(i, key)])):
                        d[key] = t
                else:
                    for d in per_param:
                        d[key] = value.clone() if torch.is_tensor(value) else value
            state.update({pid: d for pid, d in zip(ids, per_param) if d})
        return GatheredState(state=state, param_groups=param_groups)

    def state_of(self, g: "FlatGroup") -> dict[str, list[Any]]:
        """Group g's state: {key: [its value for each part]}; {} before the first step."""
        states = [self.optimizer.state.get(part, {}) for part in g.parts]
        return {key: [s[key] for s in states] for key in states[0]} if states and states[0] else {}

    def deal(self, state_dict: Mapping[str, Any]) -> None:
        """The unsharded form (a checkpoint's or a commit's, sharded or not when written): this rank keeps its
        slices of it, laid out for the current world size."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.params) or any(len(s["params"]) != len(p) for s, p in zip(groups, self.params)):
            raise ValueError("loaded state dict has a different number of parameter groups or parameters than "
                             "the optimizer")
        self.layout()
        for group, saved in zip(self.optimizer.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        live = iter(self.groups)
        for saved, params in zip(groups, self.params):
            if not params:
                continue
            g = next(live)
            entries = [state_dict["state"].get(pid, state_dict["state"].get(str(pid))) or {} for pid in saved["params"]]
            own = {}
            for key in dict.fromkeys(k for e in entries for k in e):
                holders = [(e[key], p) for e, p in zip(entries, g.params) if key in e]
                if all(_per_element(key, value, p.shape) for value, p in holders):
                    # Parameters the saved optimizer had no state for (never given a gradient) start from zeros.
                    flat = g.flat([e[key].to(g.values.device) if key in e else None for e in entries])
                    own[key] = g.split(g.own(flat).to(g.values.dtype))
                else:
                    value = holders[0][0]
                    own[key] = [value.to(g.values.device) if torch.is_tensor(value) else value] * len(g.parts)
            for k, part in enumerate(g.parts):
                if own:
                    self.optimizer.state[part] = {key: v[k].clone() if torch.is_tensor(v[k]) else v[k]
                                                  for key, v in own.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """The unsharded form (a checkpoint's, sharded or not when written): this rank keeps its slices of it (deal),
        and the whole of it until broadcast_from() has sent it."""
        self.deal(state_dict)
        self.loaded = state_dict

    def broadcast_from(self, root_rank: int = 0) -> None:
        """Horovod: every rank takes the unsharded state root_rank loaded (a checkpoint) and keeps its slices of it.
        Nothing was loaded at a fresh start: no rank has any state yet, and nothing is sent."""
        is_root = hvd.rank() == root_rank
        full = self.loaded if is_root else None
        has = hvd.broadcast_object(full is not None, root_rank=root_rank, name="zero.has_state")
        if not has:
            return  # a fresh start: no state anywhere yet
        full = broadcast_state_dict(full, root_rank, "zero.state")
        self.loaded = None
        self.deal(full)


def _per_element(key: str, value: Any, shape: torch.Size) -> bool:
    """State held per element of its parameter (momentum, moments), as against per step (Adam's step count)."""
    return key != "step" and torch.is_tensor(value) and value.shape == shape


class Bucket:
    """Parameters lo..hi-1 of a group, at `start` in the padded buffer, dealt in `size` parts of `part` elements;
    this rank's part sits at `at` in its slice."""

    def __init__(self, lo: int, hi: int, start: int, part: int, at: int) -> None:
        self.lo, self.hi, self.start, self.part, self.at = lo, hi, start, part, at


class FlatGroup:
    """One parameter group laid out flat: its parameters in order, in buckets of about `bucket` elements (whole
    parameters), each padded to a multiple of the `size` ranks and dealt in equal parts. The weights themselves
    live in one padded buffer (each parameter's .data a view of it), so this rank's part of every bucket is a view
    the optimizer steps in place: no copy of the weights is kept. Its slice is those parts back to back. Buckets let
    the reducescatter of the last layers' gradients start while backward() computes the first ones, and bound the
    collectives' buffers."""

    def __init__(self, params: list[torch.nn.Parameter], rank: int, size: int, bucket: float) -> None:
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
    def bind(self) -> None:
        """Every parameter's .data a view of the weights' buffer, with the values it holds now. Again whenever a
        parameter was given other storage since (model.to(), load_state_dict(assign=True))."""
        for i, p in enumerate(self.params):
            view = self.view(self.values, i)
            if p.data.data_ptr() != view.data_ptr():
                view.copy_(p.data)
                p.data = view

    def joined(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        """One tensor per part, as one slice."""
        return torch.cat(list(tensors))

    def split(self, slice_: torch.Tensor) -> list[torch.Tensor]:
        """A slice as one view per part."""
        return [slice_[b.at:b.at + b.part] for b in self.buckets]

    def attach_grads(self) -> None:
        """Every parameter's .grad a view of the zeroed buffer."""
        self.grads.zero_()
        for p, view in zip(self.params, self.unflatten(self.grads)):
            p.grad = view

    def bucket_grads(self, b: Bucket) -> torch.Tensor:
        """Bucket b's padded gradients: its part of the buffer (a .grad replaced since zero_grad() copied in)."""
        for i in range(b.lo, b.hi):
            p, view = self.params[i], self.view(self.grads, i)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
        return self.grads[b.start:b.start + self.size * b.part]

    @torch.no_grad()
    def write(self, b: Bucket, gathered: torch.Tensor) -> None:
        """Bucket b's padded values, gathered from every rank, into the weights' buffer (one copy)."""
        self.values[b.start:b.start + self.size * b.part].copy_(gathered)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return flat[self.offsets[i]:self.offsets[i] + p.numel()].view(p.shape)

    def flat(self, tensors: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
        """`tensors` (one per parameter, None for zeros) as one padded buffer."""
        first = next((t for t in tensors if t is not None), self.params[0])
        out = torch.zeros(self.total, dtype=first.dtype, device=self.values.device)
        for i, t in enumerate(tensors):
            if t is not None:
                self.view(out, i).copy_(t)
        return out

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A padded buffer back into one tensor per parameter, shaped like it (views)."""
        return [self.view(flat, i) for i in range(len(self.params))]

    def own(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a padded buffer."""
        return torch.cat([flat[b.start + self.rank * b.part:b.start + (self.rank + 1) * b.part] for b in self.buckets])

    def from_gathered(self, gathered: torch.Tensor) -> torch.Tensor:
        """Every rank's slice, back to back in rank order (an allgather's result), as one padded buffer."""
        by_rank = gathered.view(self.size, self.length)
        out = torch.empty(self.total, dtype=gathered.dtype, device=gathered.device)
        for b in self.buckets:
            out[b.start:b.start + self.size * b.part].view(self.size, b.part).copy_(by_rank[:, b.at:b.at + b.part])
        return out
