"""What the app's optimizer wrappers (ZeRO-1's ShardedOptimizer, PowerSGDOptimizer) show of the optimizer they
wrap, as Horovod's DistributedOptimizer does: the schedule sets param_groups' rates, the scaler unscales their
gradients, the memory report reads the state."""
import contextlib


class WrappedOptimizer:
    """An optimizer around `self.optimizer` whose step() synchronizes first unless synchronize() already ran."""

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    def step(self, closure=None):
        """synchronize() unless it already ran (the caller looked at the averaged gradients), then the wrapped
        optimizer's step. A subclass sets self.synced in synchronize() and clears it in zero_grad()."""
        if not self.synced:
            self.synchronize()
        self.synced = False
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
