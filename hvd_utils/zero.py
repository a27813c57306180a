"""ZeRO stage 1 over Horovod (--shard-optimizer): each rank keeps the optimizer state of a 1/N slice of the weights.

A step: every parameter group's gradients are flattened into one vector (padded to a multiple of the ranks) and
averaged with one grouped reducescatter, so each rank receives the average of its own slice only; the optimizer
steps that slice (a flat copy of the weights it owns), holding state for it alone; one grouped allgather then
gives every rank every updated slice, written back into the model. The bytes on the wire are those of an allreduce
(a reducescatter and an allgather are its two halves); the state per rank is 1/N.

Only element-wise optimizers can step a slice as they would the whole tensor (SGD, Adam, AdamW, Lion, ...): one
whose update looks at a tensor as a whole (LAMB's and LARS's trust ratios, Adafactor's factored moments) cannot,
and the config refuses it (hvd_train/config/fields.py: SHARDABLE). The state comes out of state_dict() in the
ordinary unsharded form (gathered from every rank: a collective) and goes into load_state_dict() in that form, so
checkpoints move between sharded and unsharded runs and across world sizes. Measured cost: docs/memory.md.
"""
import contextlib
import math

import horovod.torch as hvd
import torch


class _Group:
    """One parameter group laid out flat: its parameters back to back, padded to `size` slices of `length`, and the
    slice this rank owns (a leaf tensor the optimizer steps)."""

    def __init__(self, params, rank, size):
        self.params, self.rank, self.size = params, rank, size
        self.numel = sum(p.numel() for p in params)
        self.length = max(1, math.ceil(self.numel / size))
        first = params[0]
        self.slice = torch.zeros(self.length, dtype=first.dtype, device=first.device)
        # The gradients live in one padded buffer that backward() accumulates into (each parameter's .grad a view
        # of it): the reducescatter sends it as it is, with no copy made each step.
        self.grads = torch.zeros(self.size * self.length, dtype=first.dtype, device=first.device)
        self.refresh()

    def attach_grads(self):
        """Every parameter's .grad a view of the zeroed buffer."""
        self.grads.zero_()
        for p, view in zip(self.params, self.unflatten(self.grads)):
            p.grad = view

    def spans(self):
        """(parameter, first element in it, first element in the slice, count) for each parameter overlapping
        the owned slice."""
        lo, hi, offset = self.rank * self.length, (self.rank + 1) * self.length, 0
        for p in self.params:
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b:
                yield p, a - offset, a - lo, b - a
            offset += p.numel()

    @torch.no_grad()
    def refresh(self):
        """The slice from the weights (they may have changed outside a step: a broadcast, a checkpoint loaded)."""
        for p, start, at, count in self.spans():
            self.slice[at:at + count].copy_(p.reshape(-1)[start:start + count])

    def flat(self, tensors):
        """`tensors` (one per parameter, None for none) as one padded vector of size x length."""
        parts = [t.reshape(-1) if t is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                 for p, t in zip(self.params, tensors)]
        pad = self.size * self.length - self.numel
        if pad:
            parts.append(torch.zeros(pad, dtype=parts[0].dtype, device=parts[0].device))
        return torch.cat(parts)

    def gathered_grads(self):
        """The gradients as one padded vector: the buffer itself, unless a .grad was replaced (or never attached)."""
        if all(p.grad is not None and p.grad.data_ptr() == view.data_ptr()
               for p, view in zip(self.params, self.unflatten(self.grads))):
            return self.grads
        return self.flat([p.grad for p in self.params])

    def unflatten(self, flat):
        """A padded vector back into one tensor per parameter, shaped like it."""
        out, offset = [], 0
        for p in self.params:
            out.append(flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out

    def own(self, flat):
        return flat[self.rank * self.length:(self.rank + 1) * self.length]


class ShardedOptimizer:
    """`optimizer` (built over the model's parameters, not stepped yet) turned into ZeRO-1: its parameter groups
    now hold this rank's slices, so its state covers 1/N of the weights. Used like hvd.DistributedOptimizer:
    zero_grad(), backward(), then step() (or synchronize(), look at the averaged slice gradients, then step() inside
    skip_synchronize())."""

    def __init__(self, optimizer, compression=hvd.Compression.none, prescale=1.0, postscale=1.0):
        self.optimizer, self.compression = optimizer, compression
        self.prescale, self.postscale = prescale, postscale
        self.params = [list(g["params"]) for g in optimizer.param_groups]
        for params in self.params:
            dtypes = {(p.dtype, p.device) for p in params}
            if len(dtypes) > 1:
                raise ValueError(f"--shard-optimizer: a parameter group mixes dtypes or devices "
                                 f"({sorted(map(str, dtypes))}); give each its own group")
        self.groups, self.synced = [], False
        self.loaded = None     # the unsharded state load_state_dict() took, until broadcast_from() sends it
        self.committed = None  # elastic: the last commit's unsharded state (hvd_utils/elastic.py)
        self.layout()

    # The optimizer's face: the schedule sets param_groups' rates, the scaler unscales their gradients.
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def layout(self):
        """Slices for the current world size; the state of earlier slices is dropped (load_state_dict brings it)."""
        self.world = (hvd.rank(), hvd.size())
        self.groups = [_Group(params, *self.world) for params in self.params if params]
        live = iter(self.groups)
        for group, params in zip(self.optimizer.param_groups, self.params):
            group["params"] = [next(live).slice] if params else []
        self.optimizer.state.clear()

    def zero_grad(self, set_to_none=True):
        self.synced = False
        for g in self.groups:
            g.attach_grads()
            g.slice.grad = None

    def synchronize(self):
        """Horovod: average the gradients, each rank receiving its own slice (one grouped reducescatter)."""
        self.follow_workers()
        flats, ctxs = [], []
        for g in self.groups:
            g.refresh()
            sent, ctx = self.compression.compress(g.gathered_grads())
            flats.append(sent)
            ctxs.append(ctx)
        with torch.profiler.record_function("horovod_synchronize"):
            reduced = hvd.grouped_reducescatter(flats, name="zero.grads", op=hvd.Average,
                                                prescale_factor=self.prescale, postscale_factor=self.postscale)
        for g, r, ctx in zip(self.groups, reduced, ctxs):
            g.slice.grad = self.compression.decompress(r, ctx).to(g.slice.dtype)
        self.synced = True

    def follow_workers(self):
        """Elastic: slices for the workers there are now. After a reset every survivor holds the same last commit
        (hvd_utils/elastic.py), restored: it is dealt again."""
        if self.world != (hvd.rank(), hvd.size()):
            if self.committed is None:
                raise RuntimeError("--shard-optimizer: the ranks changed without the optimizer state being reloaded")
            self.load_state_dict(self.committed)
            self.loaded = None

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    def step(self, closure=None):
        if not self.synced:
            self.synchronize()
        self.synced = False
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.gather_weights()
        return loss

    @torch.no_grad()
    def gather_weights(self):
        """Horovod: every rank's updated slice to every rank (one grouped allgather), written into the model."""
        gathered = hvd.grouped_allgather([g.slice for g in self.groups], name="zero.weights")
        for g, flat in zip(self.groups, gathered):
            for p, value in zip(g.params, g.unflatten(flat)):
                p.copy_(value)

    def agree_on_overflow(self, scaler):
        """--amp fp16: the scaler found infinities in this rank's slices only; every rank must skip the step, or
        none. (The scaler keeps its finding per optimizer; summed over the ranks here.)"""
        found = scaler._per_optimizer_states[id(self)]["found_inf_per_device"]
        for device, flag in found.items():
            found[device] = hvd.allreduce(flag, op=hvd.Sum, name=f"zero.found_inf.{device}")

    def clip_grad_norm_(self, max_norm):
        """Clip the averaged gradients to a global norm of max_norm: squares summed over this rank's slices, then
        over the ranks (padding adds zeros). Returns the norm before clipping."""
        local = sum((g.slice.grad.float().pow(2).sum() for g in self.groups if g.slice.grad is not None),
                    torch.zeros((), device=self.groups[0].slice.device))
        total = hvd.allreduce(local, op=hvd.Sum, name="zero.grad_norm").sqrt()
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in self.groups:
            if g.slice.grad is not None:
                g.slice.grad.mul_(factor.to(g.slice.grad.dtype))
        return total

    # ----------------------------------------------------------------------------------------------------------------
    # The state in its unsharded form: what the wrapped optimizer's own state_dict() would hold over the whole model.

    def state_dict(self):
        """Gathered from every rank (a collective: every rank calls it). Per-element state (momentum, moments) comes
        back shaped like its parameter; per-step values (Adam's step) are repeated for each parameter, as torch
        keeps them."""
        self.follow_workers()
        inner = self.optimizer.state_dict()
        keys = []  # (group, key) of every per-element tensor, gathered in one call
        for i, g in enumerate(self.groups):
            for key, value in self.optimizer.state.get(g.slice, {}).items():
                if _per_element(key, value, g.slice.shape):
                    keys.append((i, key))
        gathered = hvd.grouped_allgather([self.optimizer.state[self.groups[i].slice][k] for i, k in keys],
                                         name="zero.state") if keys else []
        full = {(i, k): flat for (i, k), flat in zip(keys, gathered)}
        state, param_groups, index = {}, [], 0
        live = iter(enumerate(self.groups))
        for group, params in zip(inner["param_groups"], self.params):
            ids = list(range(index, index + len(params)))
            param_groups.append({**group, "params": ids})
            index += len(params)
            if not params:
                continue
            i, g = next(live)
            own = self.optimizer.state.get(g.slice, {})
            per_param = [dict() for _ in params]
            for key, value in own.items():
                if (i, key) in full:
                    for d, t in zip(per_param, g.unflatten(full[(i, key)])):
                        d[key] = t.clone()
                else:
                    for d in per_param:
                        d[key] = value.clone() if torch.is_tensor(value) else value
            state.update({pid: d for pid, d in zip(ids, per_param) if d})
        return {"state": state, "param_groups": param_groups}

    def load_state_dict(self, state_dict):
        """The unsharded form (a checkpoint's, sharded or not when written): this rank keeps its slices of it, laid
        out for the current world size; kept whole too until broadcast_from() has sent it."""
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
                    flat = g.flat([e[key].to(g.slice.device) if key in e else None for e in entries])
                    own[key] = g.own(flat).to(g.slice.dtype).clone()
                else:
                    value = holders[0][0]
                    own[key] = value.to(g.slice.device).clone() if torch.is_tensor(value) else value
            if own:
                self.optimizer.state[g.slice] = own
        self.loaded = state_dict

    def broadcast_from(self, root_rank=0):
        """Horovod: every rank takes the unsharded state root_rank loaded (a checkpoint) and keeps its slices of it.
        Nothing was loaded at a fresh start: no rank has any state yet, and nothing is sent."""
        is_root = hvd.rank() == root_rank
        full = self.loaded if is_root else None
        has = hvd.broadcast_object(full is not None, root_rank=root_rank, name="zero.has_state")
        if not has:
            return  # a fresh start: no state anywhere yet
        full = broadcast_state_dict(full, root_rank, "zero.state")
        self.loaded = None
        self.load_state_dict(full)
        self.loaded = None


def _per_element(key, value, shape):
    """State held per element of its parameter (momentum, moments), as against per step (Adam's step count)."""
    return key != "step" and torch.is_tensor(value) and value.shape == shape


def broadcast_state_dict(state_dict, root_rank, name):
    """root_rank's nested dict of tensors and plain values to every rank: the structure as one object, each tensor
    with hvd.broadcast (no pickling of large tensors)."""
    tensors = []

    def strip(value):
        if torch.is_tensor(value):
            tensors.append(value)
            return ("__tensor__", len(tensors) - 1, tuple(value.shape), str(value.dtype).replace("torch.", ""))
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(v) for v in value)
        return value

    skeleton = hvd.broadcast_object(strip(state_dict) if hvd.rank() == root_rank else None, root_rank=root_rank,
                                    name=f"{name}.skeleton")
    received = {}

    def fill(value):
        if isinstance(value, tuple) and len(value) == 4 and value[0] == "__tensor__":
            _, i, shape, dtype = value
            # On the CPU: a checkpoint's tensors, wherever rank 0 read them to, travel through MPI or Gloo.
            t = tensors[i].cpu() if hvd.rank() == root_rank else torch.empty(shape, dtype=getattr(torch, dtype))
            received[i] = hvd.broadcast(t.contiguous(), root_rank, name=f"{name}.{i}")
            return received[i]
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(v) for v in value)
        return value

    return fill(skeleton)
