"""Everything that touches Horovod. The rest of hvd-train imports these functions, never horovod itself.

Each function also works in a single process (hvd.size() == 1), so a plain `python train_hvd.py` trains.
"""
from hvd_utils.metrics import allreduce_sums, fingerprints_by_rank, params_fingerprint
from hvd_utils.optim import broadcast_state, distributed_optimizer, scaled_lr
from hvd_utils.runtime import Runtime, init, launcher_rank, shutdown

__all__ = ["Runtime", "init", "launcher_rank", "shutdown", "scaled_lr", "distributed_optimizer", "broadcast_state",
           "allreduce_sums", "params_fingerprint", "fingerprints_by_rank"]
