"""The base of the app's optimizer wrappers (ZeRO-1's ShardedOptimizer, PowerSGDOptimizer): WrappedOptimizer.

It shows what the wrapped optimizer holds, as Horovod's DistributedOptimizer does: the schedule sets param_groups'
rates, the scaler unscales their gradients, the memory report reads the state.
"""
import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

if TYPE_CHECKING:
    import torch


class WrappedOptimizer:
    """An optimizer around `self.optimizer` whose step() synchronizes first unless synchronize() already ran."""

    optimizer: "torch.optim.Optimizer"
    synced: bool
    synchronize: Callable[[], None]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> "dict[torch.Tensor, dict[str, Any]]":
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        yield

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """synchronize() unless it already ran (the caller looked at the averaged gradients), then the wrapped
        optimizer's step. A subclass sets self.synced in synchronize() and clears it in zero_grad()."""
        if not self.synced:
            self.synchronize()
        self.synced = False
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
