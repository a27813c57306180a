"""Paces the training steps of every Python process whose PYTHONPATH holds this folder: for a job a test cannot start
through a worker script of its own (the shipped SLURM batch script), yet must still find running when it signals.

With HVD_TEST_STEP_PAUSE_S set, each training step of hvd_train.trainer sleeps that long first. The pause changes
nothing the step computes; it only gives every step a least duration whatever the machine's speed.
"""
import importlib.abc
import os
import sys
import time

PAUSE = float(os.environ.get("HVD_TEST_STEP_PAUSE_S") or 0)


class _PaceEngine(importlib.abc.MetaPathFinder):
    """Wraps hvd_train.trainer.train_step once that module is loaded."""

    def find_spec(self, name, path, target=None):
        if name != "hvd_train.trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            real = module.train_step

            def paced(*args, **kwargs):
                time.sleep(PAUSE)
                return real(*args, **kwargs)

            module.train_step = paced

        spec.loader.exec_module = exec_module
        return spec


if PAUSE > 0:
    import importlib.util

    sys.meta_path.insert(0, _PaceEngine())
