"""`--profile`: a torch.profiler trace and Horovod's timeline of the same few training steps.

Steps are counted from this process's first training step; `profile.start` are left out (caches, Horovod's first
negotiation and torch.compile's compilation happen there), the next `profile.steps` are recorded. torch.profiler
records on rank 0, or on every rank with `--profile-ranks all` (one trace each); every rank starts and stops
Horovod's timeline at the same steps, and rank 0 writes it. Both files are Chrome trace JSON: Perfetto
(https://ui.perfetto.dev) or chrome://tracing open them.
"""
import logging
import os
import warnings
from typing import TYPE_CHECKING

import torch

import hvd_utils

if TYPE_CHECKING:
    from hvd_train.config import Config
    from hvd_utils.runtime import Runtime

log = logging.getLogger("hvd_train")


class StepProfiler:
    """Counts training steps (step() after each) and records the window [start, start + steps)."""

    def __init__(self, cfg: "Config", rt: "Runtime", directory: str) -> None:
        self.start, self.steps, self.directory = cfg.profile.start, cfg.profile.steps, directory
        self.count, self.is_main = 0, rt.is_main
        self.all_ranks = cfg.profile.ranks == "all"
        self.trace = os.path.join(directory, f"rank{rt.rank}.trace.json") if self.all_ranks or rt.is_main else None
        # One process runs no Horovod collective (the app skips Horovod at size 1): no timeline to record.
        self.timeline = os.path.join(directory, "horovod_timeline.json") if rt.size > 1 else None
        self.users_timeline = hvd_utils.timeline.users_file()
        self.torch_profiler = None
        if self.trace is not None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if rt.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            else:
                # Kineto (the profiler's backend in CUDA builds of torch) otherwise prints a line at every start
                # and stop, and an error for the GPU it looks for and a CPU run does not have.
                os.environ.setdefault("KINETO_LOG_LEVEL", "6")
            # One warm-up step before the window where there is one (torch.profiler's advice), none otherwise; one
            # window only (repeat=1), or the profiler would start over and trace the rest of training.
            warmup = 1 if self.start > 0 else 0
            with warnings.catch_warnings():  # --profile-start 0 asks for no warm-up: torch's warning says it again
                warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
                schedule = torch.profiler.schedule(wait=self.start - warmup, warmup=warmup, active=self.steps,
                                                   repeat=1)
            self.torch_profiler = torch.profiler.profile(activities=activities, schedule=schedule,
                                                         on_trace_ready=self._export)
            self.torch_profiler.start()
        if self.start == 0:
            self._timeline(True)

    def step(self) -> None:
        """After every training step, on every rank."""
        self.count += 1
        if self.torch_profiler is not None and self.count <= self.start + self.steps:
            self.torch_profiler.step()
        if self.count == self.start:
            self._timeline(True)
        elif self.count == self.start + self.steps:
            self._timeline(False)
            self._report()

    def close(self) -> None:
        """At the end of training: a window cut short is written as far as it got, and said so."""
        if self.count >= self.start + self.steps:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.stop()  # writes the trace when steps were recorded
        if self.count > self.start:
            self._timeline(False)
            self._report()
            log.warning("--profile: training ended after %d step(s), so the profile holds %d of the %d steps asked "
                        "for", self.count, self.count - self.start, self.steps)
        else:
            log.warning("--profile: training ended after %d step(s), before the profiled ones (--profile-start %d): "
                        "nothing was recorded; lower --profile-start", self.count, self.start)

    def _timeline(self, on: bool) -> None:
        if self.timeline is None or self.users_timeline:
            return
        if on:
            os.makedirs(self.directory, exist_ok=True)
            hvd_utils.timeline.start(self.timeline)
        else:
            hvd_utils.timeline.stop()

    def _export(self, prof):
        os.makedirs(self.directory, exist_ok=True)
        partial = self.trace + ".partial"
        prof.export_chrome_trace(partial)
        os.replace(partial, self.trace)  # a trace is there whole or not at all

    def _report(self) -> None:
        if not self.is_main:
            return
        first, last = self.start + 1, min(self.count, self.start + self.steps)
        traces = os.path.join(self.directory, "rank*.trace.json") if self.all_ranks else self.trace
        if self.users_timeline:
            timeline = f"{self.users_timeline} (your HOROVOD_TIMELINE: the whole run)"
        elif self.timeline:
            timeline = f"{self.timeline} (rank 0's view of every rank's collectives)"
        else:
            timeline = "none (one process runs no Horovod collectives)"
        log.info("profile of training steps %d-%d; open the files in https://ui.perfetto.dev or chrome://tracing:\n"
                 "  torch.profiler: %s\n  Horovod timeline: %s", first, last, traces, timeline)
