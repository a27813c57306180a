"""Decisions every rank takes at the same training step, without a step waiting for them: a stop asked for by a
signal that reached some ranks, a save that rank 0's clock says is due."""
import horovod.torch as hvd
import torch


class StepVote:
    """Each step, every rank sends its flags (0 or 1 each) in an asynchronous allreduce and reads the sums sent
    one step earlier: long done by then, so no step waits for the vote, and every rank reads the same sums at the
    same step. Alone, the flags are the answer at once."""

    def __init__(self, name, flags):
        self.name, self.flags, self.pending = name, flags, None

    def exchange(self, raised):
        """`raised`: this rank's flags now (a list of `flags` 0/1 values). Returns the flags summed over every rank
        as they were raised one call earlier (zeros at the first call); alone, `raised` itself."""
        if hvd.size() == 1:
            return list(raised)
        agreed = self.drain() or [0] * self.flags
        self.pending = hvd.allreduce_async(torch.tensor(raised, dtype=torch.float64), op=hvd.Sum, name=self.name)
        return agreed

    def drain(self):
        """The sums of the vote in flight (None if there is none), waited for: the loop has stopped voting."""
        if self.pending is None:
            return None
        handle, self.pending = self.pending, None
        return [int(v) for v in hvd.synchronize(handle).tolist()]
