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
