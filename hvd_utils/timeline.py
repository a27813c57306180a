"""Horovod's timeline, recorded for a chosen window of steps (`--profile`).

Horovod can switch its timeline on and off while training only when HOROVOD_TIMELINE=DYNAMIC was set before
hvd.init(); a file name there instead (horovodrun --timeline-filename) records the whole run into that file, and
then the app leaves it alone. Only the coordinator (rank 0) writes: its timeline shows every rank's part of each
collective (negotiation, then the allreduce itself), so one file covers the job.
"""
import os

import horovod.torch as hvd


def enable_dynamic():
    """Before hvd.init(): let the timeline be started later. Returns the user's own timeline file, if they set one
    (then the app records nothing of its own: Horovod is already writing the whole run there)."""
    own = os.environ.get("HOROVOD_TIMELINE", "")
    if own and own != "DYNAMIC":
        return own
    os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"
    return None


def start(path):
    """Every rank calls it; rank 0 opens `path` and records from Horovod's next cycle on."""
    hvd.start_timeline(path, mark_cycles=True)


def stop():
    """Every rank calls it; on rank 0 it returns once the file is complete (Horovod's writer thread closes it)."""
    hvd.stop_timeline()
