"""The collectives the ranks run besides the optimizer's averaging: metric sums, shared decisions, gathered objects.

Metrics are exact across ranks: sums and counts reduced once (allreduce_sums, in float64), never a mean of per-rank
means. Files: rank 0 decides (reads a checkpoint, checks a directory) and every rank receives the outcome, or rank
0's error (decide_on_root). StepVote: decisions every rank takes at the same training step without a step waiting
for them (a stop asked for by a signal that reached some ranks, a save that rank 0's clock says is due).

Also here: the allreduce as training runs it, for the communication benchmark (allreduce_average,
bench/allreduce.py); the gather and scatter Horovod lacks, for the sharded optimizer's and PowerSGD's checkpoint
state (gather_to, scatter_from); and what gradients travel as (wire_format): float32 as computed, fp16 (Horovod's
own compressor) or bfloat16. bfloat16 keeps float32's 8 exponent bits and drops mantissa bits: half the bytes, like
fp16, but a gradient beyond fp16's 65504 stays finite instead of becoming inf. Horovod 0.28.1 has no bfloat16 in its
core; scripts/horovod/patches/0022-bfloat16.patch adds it to MPI, Gloo and NCCL, summing in float32 and rounding
each result once, so the only precision lost is bfloat16's rounding of what is sent and of the sum.

Alone (hvd.size() == 1) each function returns its local answer without Horovod: a collective would only wait for
Horovod's next cycle, which is 100 ms in a process started alone (hvd_utils/runtime.py).
"""
import hashlib
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar, Union, cast

import horovod.torch as hvd
import torch

_T = TypeVar("_T")


def allreduce_average(tensors: Sequence[torch.Tensor], name: str, fp16: bool = False,
                      bf16: bool = False) -> list[torch.Tensor]:
    """Average `tensors` across ranks the way DistributedOptimizer does for one step's gradients: every allreduce is
    queued at once (Horovod fuses the ones that are ready in the same cycle, up to the fusion threshold), then
    waited for. fp16/bf16 send half-size copies (hvd_utils.comm). Returns the averaged tensors."""
    compression = wire_format(fp16, bf16)
    pending = []
    for i, tensor in enumerate(tensors):
        sent, ctx = compression.compress(tensor)
        # Fixed names: as in training, each step's tensors repeat the last step's, so Horovod's response cache
        # skips most of the negotiation.
        pending.append((hvd.allreduce_async_(sent, op=hvd.Average, name=f"{name}.{i}"), ctx))
    return [compression.decompress(hvd.synchronize(handle), ctx) for handle, ctx in pending]


def gather_to(root_rank: int, tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Every rank's `tensor`, back to back in rank order, on root_rank alone (an alltoall in which every rank sends
    all of it there and nothing elsewhere: Horovod has no gather); the other ranks get an empty tensor."""
    splits = torch.zeros(hvd.size(), dtype=torch.int32)
    splits[root_rank] = tensor.numel()
    out = hvd.alltoall(tensor, splits=splits, name=name)
    return out[0] if isinstance(out, tuple) else out


def scatter_from(root_rank: int, tensors: Optional[Sequence[torch.Tensor]], name: str,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """root_rank's `tensors` (one per rank, all of one length) dealt out: rank k gets tensors[k] (an alltoall in
    which only root_rank sends); the other ranks pass None."""
    splits = torch.zeros(hvd.size(), dtype=torch.int32)
    if hvd.rank() == root_rank:
        sent = torch.cat([t.reshape(-1).cpu() for t in cast("Sequence[torch.Tensor]", tensors)])
        splits[:] = cast("Sequence[torch.Tensor]", tensors)[0].numel()
    else:
        sent = torch.zeros(0, dtype=dtype)
    out = hvd.alltoall(sent, splits=splits, name=name)
    return out[0] if isinstance(out, tuple) else out


def allreduce_sums(sums: Mapping[str, Union[torch.Tensor, float]],
                   name: str = "metric_sums") -> dict[str, Union[float, torch.Tensor]]:
    """Sum a dict of tensors over all ranks with one allreduce.

    Each value may have any shape (a scalar, per-class counts, a confusion matrix), the same on every rank. Keys
    are sorted so every rank packs the same values in the same order; float64 keeps large sample counts exact.
    Returns plain floats for scalars and float64 CPU tensors of their own shapes for the others.
    """
    keys = sorted(sums)
    values = [torch.as_tensor(sums[k], dtype=torch.float64).detach().cpu() for k in keys]
    if values and hvd.size() > 1:  # alone: no wait for Horovod's next cycle (100 ms when alone, hvd_utils/runtime.py)
        packed = hvd.allreduce(torch.cat([v.reshape(-1) for v in values]), op=hvd.Sum, name=name)
        values = [part.reshape(v.shape) for part, v in zip(packed.split([v.numel() for v in values]), values)]
    return summed(dict(zip(keys, values)))


def summed(sums: Mapping[str, Union[torch.Tensor, float]]) -> dict[str, Union[float, torch.Tensor]]:
    """Sums as allreduce_sums returns them: plain floats for scalars, float64 CPU tensors of their own shapes for
    the others."""
    values = {k: torch.as_tensor(v, dtype=torch.float64).detach().cpu() for k, v in sums.items()}
    return {k: float(v) if v.dim() == 0 else v for k, v in values.items()}


def params_fingerprint(model: torch.nn.Module) -> int:
    """The first 8 bytes of a SHA-256 over every parameter and buffer, as an int: equal only for bitwise-equal
    weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little", signed=True)


def fingerprints_by_rank(model: torch.nn.Module) -> list[int]:
    """The parameter fingerprint of every rank, gathered on all of them (rank order)."""
    if hvd.size() == 1:
        return [params_fingerprint(model)]
    mine = torch.tensor([params_fingerprint(model)], dtype=torch.int64)
    return hvd.allgather(mine, name="params_fingerprint").tolist()


def sum_across_ranks(value: Union[torch.Tensor, float], name: str) -> float:
    """A scalar summed over all ranks, as a Python number (one small allreduce and a host sync)."""
    tensor = torch.as_tensor(value, dtype=torch.float64).detach().cpu().reshape(1)
    if hvd.size() == 1:
        return tensor.item()
    return hvd.allreduce(tensor, op=hvd.Sum, name=name).item()


def gather_floats(values: Sequence[float], name: str) -> list[list[float]]:
    """Every rank's list of floats (all the same length), gathered on all ranks, in rank order."""
    if hvd.size() == 1:
        return [[float(v) for v in values]]
    mine = torch.tensor([list(values)], dtype=torch.float64)
    return hvd.allgather(mine, name=name).tolist()


def gather_objects(obj: _T, name: str) -> list[_T]:
    """Every rank's picklable `obj`, gathered on all ranks, in rank order."""
    if hvd.size() == 1:
        return [obj]
    return hvd.allgather_object(obj, name=name)


def decide_on_root(fn: Callable[[], _T], name: str) -> _T:
    """fn() on rank 0, its result on every rank (file checks on a shared or a rank-0-only file system alike).

    An error on rank 0 is raised on every rank instead of leaving the others waiting in a broadcast that never
    comes."""
    if hvd.size() == 1:  # nobody to tell (and no wait for Horovod's cycle)
        return fn()
    result, error = None, None
    if hvd.rank() == 0:
        try:
            result = fn()
        except (RuntimeError, ValueError) as e:  # the app's errors about files and settings are ValueErrors
            error = e
    error, result = hvd.broadcast_object((error, result), root_rank=0, name=name)
    if error is not None:
        raise error
    return result


def broadcast_module(module: torch.nn.Module, root_rank: int = 0) -> None:
    """Rank 0's state of a module that is not the trained model (the weights' average, --model-ema) to every rank."""
    if hvd.size() > 1:
        hvd.broadcast_parameters(module.state_dict(), root_rank=root_rank)


def broadcast_state_dict(state_dict: Optional[Mapping[str, Any]], root_rank: int, name: str) -> dict[str, Any]:
    """root_rank's nested dict of tensors and plain values to every rank: the structure as one object, each tensor
    with hvd.broadcast (no pickling of large tensors)."""
    tensors = []

    def strip(value: Any) -> Any:
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

    def fill(value: Any) -> Any:
        if isinstance(value, tuple) and len(value) == 4 and value[0] == "__tensor__":
            _, i, shape, dtype = value
            # On the CPU: a checkpoint's tensors, wherever rank 0 read them to, travel through MPI or Gloo.
            t = tensors[i].cpu() if hvd.rank() == root_rank else torch.empty(shape, dtype=getattr(torch, dtype))
            return hvd.broadcast(t.contiguous(), root_rank, name=f"{name}.{i}")
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(v) for v in value)
        return value

    return fill(skeleton)


class StepVote:
    """Each step, every rank sends its flags (0 or 1 each) in an asynchronous allreduce and reads the sums sent
    one step earlier: long done by then, so no step waits for the vote, and every rank reads the same sums at the
    same step. Alone, the flags are the answer at once."""

    def __init__(self, name: str, flags: int) -> None:
        self.name, self.flags, self.pending = name, flags, None

    def exchange(self, raised: Sequence[int]) -> list[int]:
        """`raised`: this rank's flags now (a list of `flags` 0/1 values). Returns the flags summed over every rank
        as they were raised one call earlier (zeros at the first call); alone, `raised` itself."""
        if hvd.size() == 1:
            return list(raised)
        agreed = self.drain() or [0] * self.flags
        self.pending = hvd.allreduce_async(torch.tensor(raised, dtype=torch.float64), op=hvd.Sum, name=self.name)
        return agreed

    def drain(self) -> Optional[list[int]]:
        """The sums of the vote in flight (None if there is none), waited for: the loop has stopped voting."""
        if self.pending is None:
            return None
        handle, self.pending = self.pending, None
        return [int(v) for v in hvd.synchronize(handle).tolist()]


class BF16Compressor(hvd.compression.Compressor):
    """Floating-point tensors travel as bfloat16 and come back in their own type; others travel as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.dtype]]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.bfloat16:
            return tensor.to(torch.bfloat16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Optional[torch.dtype]) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


def wire_format(fp16: bool = False, bf16: bool = False) -> type[hvd.compression.Compressor]:
    """The Horovod compression for the gradients: fp16, bf16 or none (the config refuses both at once)."""
    if bf16:
        return BF16Compressor
    return hvd.Compression.fp16 if fp16 else hvd.Compression.none
