"""The optimizer under Horovod: wrapping it, the synchronize-then-step pattern, and the ranks kept in agreement.

distributed_optimizer picks the wrapper: Horovod's DistributedOptimizer, ZeRO-1's ShardedOptimizer
(hvd_utils/zero.py) or PowerSGDOptimizer (hvd_utils/powersgd.py). apply_gradients lets the unscale and the clipping
see the averaged gradients before the step; broadcast_state makes every rank start from rank 0's state; BatchNorm
buffers are averaged over the ranks, or kept per rank in checkpoints (buffers_by_rank).

Horovod's collectives take only contiguous tensors, and the weights of a channels-last model (--channels-last), with
their gradients and optimizer state, are not: the helpers here hand Horovod those in the default layout and put
the results back in the tensors' own.
"""
import contextlib
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar, Union

import horovod.torch as hvd
import torch
from horovod.torch.optimizer import _DistributedAdasumOptimizer

from hvd_utils.comm import wire_format
from hvd_utils.powersgd import PowerSGDOptimizer
from hvd_utils.zero import ShardedOptimizer

_T = TypeVar("_T")


def checkpoint_state(optimizer: Union[torch.optim.Optimizer, ShardedOptimizer, PowerSGDOptimizer],
                     root_rank: int = 0) -> Optional[dict[str, Any]]:
    """The optimizer's state for a checkpoint that root_rank writes (a collective): a sharded optimizer's is gathered
    to that rank alone, so the others never hold the whole of it (None there); PowerSGD's holds every rank's
    residuals, gathered likewise; any other optimizer's state_dict()."""
    if isinstance(optimizer, (ShardedOptimizer, PowerSGDOptimizer)):
        return optimizer.state_dict(root_rank=root_rank)
    return optimizer.state_dict()


def lr_scale(world_size: int, batches_per_allreduce: int = 1, use_adasum: bool = False) -> int:
    """The learning-rate multiplier. Linear scaling rule (Goyal et al. 2017): the rate grows with the global
    batch, ranks x batches per allreduce. Adasum adapts to the number of ranks by itself, so only the local
    accumulation counts there (as in Horovod's own examples on the CPU)."""
    return batches_per_allreduce * (1 if use_adasum else world_size)


@dataclass(frozen=True)
class PowerSGD:
    """Low-rank averaging with error feedback after backward() (hvd_utils/powersgd.py)."""
    rank: int                    # the factors' rank
    start_step: Optional[int]    # plain averaging before this step; None: after 10% of the run
    min_compression: float       # a gradient whose factors would not be this many times smaller is sent whole


@dataclass(frozen=True)
class WireOptions:
    """How the gradients are averaged across ranks: everything distributed_optimizer needs besides the optimizer
    and the model, made once from the horovod settings (hvd_train/training.py wire_options)."""
    batches_per_allreduce: int = 1          # backward passes accumulated locally per averaging
    fp16_allreduce: bool = False            # sent as float16 (Horovod's compressor)
    bf16_allreduce: bool = False            # sent as bfloat16
    use_adasum: bool = False                # Adasum instead of the average
    gradient_predivide_factor: float = 1.0  # divided before the sum by this, the rest after
    elastic: bool = False                   # an elastic job: wrapped even while it has one worker
    shard: bool = False                     # ZeRO-1 (hvd_utils/zero.py)
    powersgd: Optional[PowerSGD] = None     # low-rank averaging (hvd_utils/powersgd.py)


def distributed_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                          wire: WireOptions = WireOptions()
                          ) -> Union[torch.optim.Optimizer, ShardedOptimizer, PowerSGDOptimizer]:
    """Horovod: average gradients across ranks with ring-allreduce during backward(), as `wire` says. wire.shard:
    ZeRO-1 instead (hvd_utils/zero.py): a reducescatter of the gradients after backward(), each rank stepping a 1/N
    slice of the weights with its slice of the optimizer state, an allgather of the weights. wire.powersgd:
    low-rank averaging with error feedback after backward() (hvd_utils/powersgd.py).

    The wrapper is a new optimizer over the same parameters; state loaded into the old one is not carried over,
    so load checkpoints into the returned optimizer. One process that stays one (not elastic) has nothing to
    average: its optimizer comes back unwrapped, and its steps skip a round trip through Horovod's background
    thread (bench/NOTES.md).
    """
    if hvd.size() == 1 and not wire.elastic:
        return optimizer
    # a Compressor class, or _SentContiguous below
    compression: Any = wire_format(wire.fp16_allreduce, wire.bf16_allreduce)
    if wire.shard:  # (the config refuses Adasum with it: Adasum combines whole updates, not averaged slices)
        return ShardedOptimizer(optimizer, compression, prescale=1.0 / wire.gradient_predivide_factor,
                                postscale=wire.gradient_predivide_factor,
                                backward_passes_per_step=wire.batches_per_allreduce)
    if wire.powersgd:  # (the config refuses Adasum, --shard-optimizer and --elastic with it)
        low = wire.powersgd
        # --batches-per-allreduce: the passes accumulate in .grad, compressed once at the step
        return PowerSGDOptimizer(optimizer, low.rank, low.start_step, low.min_compression, compression)
    if _has_strided_weights(model):
        compression = _SentContiguous(compression)
    return hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression,
        backward_passes_per_step=wire.batches_per_allreduce,
        op=hvd.Adasum if wire.use_adasum else hvd.Average,
        gradient_predivide_factor=wire.gradient_predivide_factor)


def _has_strided_weights(model: torch.nn.Module) -> bool:
    return any(not p.is_contiguous() for p in model.parameters())


class _SentContiguous:
    """A Horovod compression around another: the gradient goes out as a contiguous copy (through `inner`) and the
    averaged result comes back in the gradient's own layout (channels-last), so the optimizer steps with weights,
    gradients and state laid out alike (torch's multi-tensor step falls back to a slow loop otherwise)."""

    def __init__(self, inner: type[hvd.compression.Compressor]) -> None:
        self.inner = inner

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, Optional[torch.Tensor]]]:
        sent, ctx = self.inner.compress(tensor.contiguous())
        return sent, (ctx, None if tensor.is_contiguous() else tensor)

    def decompress(self, tensor: torch.Tensor, ctx: tuple[Any, Optional[torch.Tensor]]) -> torch.Tensor:
        inner_ctx, original = ctx
        result = self.inner.decompress(tensor, inner_ctx)
        return result if original is None else torch.empty_like(original).copy_(result)


def _is_adasum(optimizer: object) -> bool:
    # hvd.DistributedOptimizer builds a new class from the wrapped optimizer's class and copies in the methods of
    # its Adasum variant, so isinstance cannot tell; the methods can (not `step`, which torch re-wraps).
    return type(optimizer).__dict__.get("skip_synchronize") is _DistributedAdasumOptimizer.__dict__["skip_synchronize"]


def apply_gradients(optimizer: Union[torch.optim.Optimizer, ShardedOptimizer, PowerSGDOptimizer],
                    step: Callable[[], _T], before_step: Optional[Callable[[], object]] = None) -> _T:
    """Horovod: wait for the averaged gradients, let before_step() see them (unscale, clip), then step() without
    a second allreduce. Works for a plain torch optimizer too (one process, or before wrapping).

    Adasum's optimizer steps locally and then combines the parameter updates, so there are no combined gradients
    to look at: before_step() sees this rank's own.
    """
    if not hasattr(optimizer, "synchronize") or _is_adasum(optimizer):
        if before_step is not None:
            before_step()
        return step()
    # Named in --profile traces: the time this rank waits for the averaged gradients.
    with torch.profiler.record_function("horovod_synchronize"):
        optimizer.synchronize()
    if before_step is not None:
        before_step()
    with optimizer.skip_synchronize():
        return step()


def unscale_gradients(scaler: torch.amp.GradScaler,
                      optimizer: Union[torch.optim.Optimizer, ShardedOptimizer, PowerSGDOptimizer]) -> None:
    """--amp fp16: the gradients divided by the loss scale, and every rank agreeing whether any was infinite (a
    sharded optimizer's ranks each see a slice). PowerSGD's optimizer unscaled them before compressing."""
    if isinstance(optimizer, PowerSGDOptimizer) and optimizer.scaler is not None:
        return
    scaler.unscale_(optimizer)
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.agree_on_overflow(scaler)


def clip_gradients(model: torch.nn.Module, optimizer: Union[torch.optim.Optimizer, ShardedOptimizer, PowerSGDOptimizer],
                   max_norm: float) -> torch.Tensor:
    """The averaged gradients clipped to a global norm of max_norm (a sharded optimizer's: over every rank's
    slices)."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def optimizer_state_bytes(optimizer: Union[torch.optim.Optimizer, ShardedOptimizer, PowerSGDOptimizer]) -> int:
    """Bytes of optimizer state this rank holds (momentum, moments; a sharded optimizer's slices only)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v))


def broadcast_state(model: torch.nn.Module,
                    optimizer: Optional[Union[torch.optim.Optimizer, ShardedOptimizer, PowerSGDOptimizer]] = None,
                    root_rank: int = 0) -> None:
    """Horovod: copy optimizer state (where there is an optimizer), parameters and buffers from root_rank, so all
    ranks start identical: at the start, and after rank 0 alone loaded a checkpoint.

    The optimizer state goes first, where rank 0 has any (a checkpoint's): on a rank with empty state, Horovod
    initialises it with one zero-gradient step, which moves parameters under weight decay; broadcasting the
    parameters afterwards undoes that.
    """
    if hvd.size() == 1:  # nobody to copy to (and a CPU-only Horovod build cannot even look at CUDA tensors)
        return
    with default_layout(model, optimizer):  # Horovod takes channels-last weights in the default layout only
        if isinstance(optimizer, (ShardedOptimizer, PowerSGDOptimizer)):
            optimizer.broadcast_from(root_rank)
        elif optimizer is not None and hvd.broadcast_object(bool(optimizer.state), root_rank, "optimizer_has_state"):
            # Only state that exists: on an empty optimizer Horovod first takes a zero-gradient step to create it,
            # which counts one step too many (Adam's bias correction) and starts SGD's momentum at weight decay x w.
            hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)
        hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)


@contextlib.contextmanager
def default_layout(model: torch.nn.Module,
                   optimizer: Optional[Union[torch.optim.Optimizer, ShardedOptimizer, PowerSGDOptimizer]] = None
                   ) -> Iterator[None]:
    """For Horovod's broadcasts: a channels-last model's weights, and the optimizer's state, in the default layout
    inside the block; after it the weights are channels-last again and the state follows its parameter's layout.
    The state is also laid out like its parameters before the block, as one loaded from a checkpoint of a run with
    the other layout may not be."""
    channels_last = any(p.dim() == 4 and not p.is_contiguous() and p.is_contiguous(memory_format=torch.channels_last)
                        for p in model.parameters())
    if channels_last:
        model.to(memory_format=torch.contiguous_format)  # the same Parameter objects: the optimizer still holds them
    _match_parameter_layout(optimizer)
    try:
        yield
    finally:
        if channels_last:
            model.to(memory_format=torch.channels_last)
            _match_parameter_layout(optimizer)


def _match_parameter_layout(
        optimizer: Optional[Union[torch.optim.Optimizer, ShardedOptimizer, PowerSGDOptimizer]]) -> None:
    """Give every state tensor shaped like its parameter (momentum, Adam's moments) the parameter's strides."""
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == p.shape and value.stride() != p.stride():
                    state[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)


def sync_batch_norm(model: torch.nn.Module) -> torch.nn.Module:
    """Horovod: replace every BatchNorm with hvd.SyncBatchNorm, whose statistics cover all ranks' samples."""
    for name, child in model.named_children():
        if isinstance(child, torch.nn.modules.batchnorm._BatchNorm):
            sync = hvd.SyncBatchNorm(child.num_features, eps=child.eps, momentum=child.momentum,
                                     affine=child.affine, track_running_stats=child.track_running_stats)
            sync.load_state_dict(child.state_dict())
            setattr(model, name, sync)
        else:
            sync_batch_norm(child)
    return model


def average_buffers(model: torch.nn.Module) -> None:
    """Horovod: average floating-point buffers (BatchNorm running statistics) over the ranks.

    Each rank updates its running statistics from its own samples, so without this the ranks, and the validation
    and checkpoints they produce, would disagree. hvd.SyncBatchNorm models agree already; this costs one small
    allreduce per epoch: every buffer is queued at once, so Horovod fuses them (one by one, a ResNet-50's 106
    buffers waited for 106 cycles).
    """
    if hvd.size() == 1:
        return
    handles = [hvd.allreduce_async_(buf, op=hvd.Average, name=f"buffer.{name}")
               for name, buf in model.named_buffers() if buf.is_floating_point()]
    for handle in handles:
        hvd.synchronize(handle)


def buffers_by_rank(module: torch.nn.Module, name: str) -> list[dict[str, torch.Tensor]]:
    """Each rank's floating-point buffers that differ from rank 0's, in rank order, on every rank: [{}, {name: CPU
    tensor}, ...]; [] where every rank holds rank 0's. A collective.

    Between two average_buffers calls each rank's BatchNorm statistics are its own, updated from its own samples; a
    checkpoint taken then keeps these beside rank 0's (which the model's state holds) so that a resumed run goes on
    from each rank's own, as a run that never stopped does. Only digests travel where they agree (no BatchNorm,
    SyncBatchNorm, or just after an average)."""
    if hvd.size() == 1:
        return []
    own = {n: b.detach() for n, b in module.named_buffers() if b.is_floating_point()}
    digests = hvd.allgather_object({n: _digest(b) for n, b in own.items()}, name=f"{name}.digests")
    if all(d == digests[0] for d in digests):
        return []
    mine = {n: b.cpu().clone() for n, b in own.items() if digests[hvd.rank()][n] != digests[0][n]}
    return hvd.allgather_object(mine, name=f"{name}.buffers")


def restore_buffers_by_rank(module: torch.nn.Module, by_rank: Optional[Sequence[Mapping[str, torch.Tensor]]]) -> bool:
    """After the broadcast of rank 0's state: this rank's own buffers from buffers_by_rank's list where as many ranks
    run as wrote it; on another number of ranks every rank takes the writers' average (rank 0's included), the
    statistics average_buffers would have given them. Returns whether it was the average."""
    if not by_rank:
        return False
    buffers = dict(module.named_buffers())
    if len(by_rank) == hvd.size():
        for n, value in by_rank[hvd.rank()].items():
            buffers[n].copy_(value)
        return False
    for n in {n for entry in by_rank for n in entry}:
        # Rank 0's own (every rank holds it now) where a writer's agreed with it.
        values = [entry[n].double() if n in entry else buffers[n].detach().double().cpu() for entry in by_rank]
        buffers[n].copy_(torch.stack(values).mean(0))
    return True


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha1(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
