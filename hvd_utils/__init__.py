"""Everything that touches Horovod. The rest of hvd-train imports these functions, never horovod itself.

Each function also works in a single process (hvd.size() == 1), so a plain `python train_hvd.py` trains.

The modules: runtime (starting Horovod, the rank's device and facts), comm (metric sums, decisions and objects
shared by the ranks), optim (the optimizer wrapped, stepped and broadcast), zero (ZeRO-1: --shard-optimizer),
powersgd (--powersgd-rank), wrapped (the base of those two optimizers), elastic (elastic runs, and which samples
each rank reads) and timeline (Horovod's timeline for --profile).
"""
from hvd_utils import timeline
from hvd_utils.comm import (StepVote, allreduce_average, allreduce_sums, broadcast_module, decide_on_root,
                            fingerprints_by_rank, gather_floats, gather_objects, params_fingerprint, sum_across_ranks,
                            summed)
from hvd_utils.elastic import shard_sampler
from hvd_utils.optim import (PowerSGD, WireOptions, apply_gradients, average_buffers, broadcast_state,
                             buffers_by_rank, checkpoint_state, clip_gradients, distributed_optimizer, lr_scale,
                             optimizer_state_bytes, restore_buffers_by_rank, sync_batch_norm, unscale_gradients)
from hvd_utils.powersgd import describe as describe_compression
from hvd_utils.powersgd import prepare as prepare_compression
from hvd_utils.runtime import (PeerFailure, Runtime, SettingsRefused, gpu_tensors_supported, host_name, init,
                               launched_size, launcher_rank, pin_to_local_rank, rank, run_on_local_root, shutdown,
                               start, started, usable_cpus, world_size)

__all__ = ["timeline", "PowerSGD", "WireOptions", "PeerFailure", "Runtime", "SettingsRefused", "launched_size",
           "gpu_tensors_supported",
           "host_name", "init", "start", "pin_to_local_rank", "usable_cpus",
           "shard_sampler", "launcher_rank", "run_on_local_root", "shutdown", "started", "world_size",
           "lr_scale", "distributed_optimizer", "apply_gradients", "average_buffers", "broadcast_state",
           "buffers_by_rank", "restore_buffers_by_rank", "checkpoint_state",
           "clip_gradients", "unscale_gradients", "prepare_compression", "describe_compression",
           "optimizer_state_bytes",
           "sync_batch_norm", "decide_on_root", "broadcast_module", "rank", "allreduce_sums", "summed",
           "sum_across_ranks", "gather_floats", "gather_objects",
           "allreduce_average", "params_fingerprint", "fingerprints_by_rank", "StepVote"]
