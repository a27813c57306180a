"""PowerSGD over Horovod (--powersgd-rank): the optimizer's gradients averaged as low-rank factors with error
feedback (hvd_utils/powersgd.py's arithmetic), for jobs a slow link holds up (docs/speed.md).

Used like hvd.DistributedOptimizer: zero_grad(), backward() (as many passes as --batches-per-allreduce: their
gradients accumulate in .grad and are compressed once), then step(), or synchronize(), look at the averaged
gradients (clip them), then step() inside skip_synchronize(). For the first start_step steps the gradients are
averaged as they are, in one fused allreduce. Under --amp fp16 the scaler's unscale comes before the compression
(an inf must not reach the residuals or Q, which last): the ranks agree whether any found one, and a step with one
changes nothing on any rank.

Its state (the step count, Q, every rank's residuals) travels in the optimizer's state dict under "powersgd", so
epoch and step checkpoints hold it and a resume on as many ranks goes on bitwise; on another number of ranks the
residuals, each a rank's own, start again from zero (said in one line).
"""

import horovod.torch as hvd
import torch

from hvd_utils.comm import gather_to, scatter_from
from hvd_utils.powersgd import LowRank, Plan, plain_mean
from hvd_utils.wrapped import WrappedOptimizer


class PowerSGDOptimizer(WrappedOptimizer):
    """`optimizer` (over the model's parameters, not stepped yet) whose gradients are averaged by PowerSGD at
    `rank` from step `start_step` (None: set later by prepare(), from the run's steps); `compression`: what P, Q
    and the uncompressed tensors travel as (Horovod's fp16, the app's bf16, or none)."""

    def __init__(self, optimizer, rank, start_step, min_compression, compression=hvd.Compression.none):
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

    def attach_scaler(self, scaler):
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None

    @property
    def compressing(self):
        return self.start_step is not None and self.steps >= self.start_step

    def zero_grad(self, set_to_none=True):
        self.synced = False
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def synchronize(self):
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

    def _mean(self, named):
        """Horovod: the average over the ranks of each (name, flat tensor), all in flight at once (fused)."""
        handles = []
        for name, tensor in named:
            sent, ctx = self.compression.compress(tensor)
            handles.append((hvd.allreduce_async(sent, op=hvd.Average, name=name), ctx))
        return [self.compression.decompress(hvd.synchronize(h), ctx).float() for h, ctx in handles]

    # ----------------------------------------------------------------------------------------------------------------
    # Checkpoints: the wrapped optimizer's state, plus the compression's.

    def state_dict(self, root_rank=None):
        """The wrapped optimizer's state dict with "powersgd": the step count, Q, and every rank's residuals in
        rank order (a collective; root_rank: gathered to that rank alone, the others' entry holding none)."""
        state = {**self.optimizer.state_dict(), "powersgd": self.compression_state(root_rank)}
        return state

    def compression_state(self, root_rank=None):
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

    def load_state_dict(self, state_dict):
        """A checkpoint's (rank 0 reads it): the wrapped optimizer takes its part, the compression state waits
        for broadcast_from(). A checkpoint of a run without PowerSGD starts the compression afresh."""
        inner = {k: v for k, v in state_dict.items() if k != "powersgd"}
        self.optimizer.load_state_dict(inner)
        self.loaded = state_dict.get("powersgd")

    def broadcast_from(self, root_rank=0):
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
        own = scatter_from(root_rank, loaded["residuals"] if hvd.rank() == root_rank else None, "powersgd.residuals")
        self.lowrank.residuals, at = {}, 0
        for i in sorted(self.plan.compressed):
            n, m, _ = self.plan.compressed[i]
            self.lowrank.residuals[i] = own[at:at + n * m].view(n, m).to(device).clone()
            at += n * m


def prepare(optimizer, scaler, run_steps, steps_done=0):
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


def describe(optimizer):
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
