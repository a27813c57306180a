"""Horovod's timeline, recorded for a chosen window of steps (`--profile`).

Horovod can switch its timeline on and off while training only when HOROVOD_TIMELINE=DYNAMIC was set before
hvd.init(); a file name there instead (horovodrun --timeline-filename) records the whole run into that file, and
then the app leaves it alone. Only the coordinator (rank 0) writes: its timeline shows every rank's part of each
collective (negotiation, then the allreduce itself), so one file covers the job.
"""
import os
from typing import Optional

import horovod.torch as hvd


def users_file() -> Optional[str]:
    """The timeline file the user set (HOROVOD_TIMELINE, horovodrun --timeline-filename), else None: Horovod then
    writes the whole run there, and the app records nothing of its own."""
    own = os.environ.get("HOROVOD_TIMELINE", "")
    return own if own not in ("", "DYNAMIC") else None


def enable_dynamic() -> None:
    """Before hvd.init(): let the timeline be started later, unless the user set a file of their own."""
    if users_file() is None:
        os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"


def start(path: str) -> None:
    """Every rank calls it; rank 0 opens `path` and records from Horovod's next cycle on."""
    hvd.start_timeline(path, mark_cycles=True)


def stop() -> None:
    """Every rank calls it; on rank 0 it returns once the file is complete (Horovod's writer thread closes it)."""
    hvd.stop_timeline()
