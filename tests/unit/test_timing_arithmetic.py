"""The step-time accounting's arithmetic (hvd_train/timing.py): which rank is slowest and why, the straggler and
communication-bound lines, the run's totals; and the clock's marks on one process. Real launches that slow one
rank on purpose are in tests/launch/test_step_timing.py."""
import time

import pytest
import torch

from hvd_train import timing


def rank(r, host="node-a", steps=10, **phases):
    return {"rank": r, "host": host, **{p: phases.get(p, 0.0) for p in timing.PHASES}, "steps": steps}


def test_the_rank_that_waits_least_in_the_allreduce_is_the_slowest_and_its_phase_is_named():
    # Rank 2's loader is slow: it waits least for the others, who all wait for it.
    ranks = [rank(0, compute=0.10, allreduce_wait=0.15, data=0.01), rank(1, compute=0.10, allreduce_wait=0.15,
                                                                         data=0.01),
             rank(2, "node-c", compute=0.10, allreduce_wait=0.01, data=0.16)]
    acc = timing.account(ranks)
    assert acc["slowest"] == {"rank": 2, "host": "node-c", "phase": "data"}
    line = timing.straggler(acc, 20)
    assert line.startswith("straggler: rank 2 (host node-c)")
    assert "data (0.160 s against 0.010 s on the other ranks)" in line
    assert "--workers" in line and "--data.decode gpu" in line
    assert timing.comm_bound(acc) is None


def test_a_slow_device_is_named_with_its_advice():
    ranks = [rank(0, compute=0.10, allreduce_wait=0.10), rank(1, compute=0.20, allreduce_wait=0.0)]
    acc = timing.account(ranks)
    assert acc["slowest"]["phase"] == "compute"
    assert "throttled" in timing.straggler(acc, 20)


def test_no_rank_above_the_threshold_is_named_none():
    ranks = [rank(0, compute=0.10, allreduce_wait=0.02), rank(1, compute=0.11, allreduce_wait=0.01)]
    acc = timing.account(ranks)
    assert timing.straggler(acc, 20) is None
    assert timing.straggler(acc, 1) is not None  # the threshold is what decides
    assert timing.straggler(timing.account([rank(0, compute=1.0)]), 20) is None  # one rank: nobody to compare


def test_every_rank_waiting_most_for_the_allreduce_is_communication_bound():
    ranks = [rank(0, compute=0.05, allreduce_wait=0.40), rank(1, compute=0.06, allreduce_wait=0.39)]
    acc = timing.account(ranks)
    assert timing.straggler(acc, 20) is None
    line = timing.comm_bound(acc)
    assert line.startswith("communication-bound") and "--bf16-allreduce" in line and "--batches-per-allreduce" in line
    ranks[1]["compute"] = 0.5  # one rank computing more than it waits: not every rank is waiting
    assert timing.comm_bound(timing.account(ranks)) is None


def test_the_split_and_the_trackers_figures():
    ranks = [rank(0, data=0.1, compute=0.6, allreduce_wait=0.3), rank(1, data=0.1, compute=0.6, allreduce_wait=0.3)]
    assert timing.split_line(ranks) == "data 10% compute 60% comm 30% other 0%"
    figures = timing.figures(timing.account(ranks))
    assert figures["time_compute"] == pytest.approx(0.6) and figures["time_slowest_busy"] == pytest.approx(0.7)
    assert all(isinstance(v, (int, float)) for v in figures.values())


def test_the_runs_account_weights_each_epoch_by_its_steps():
    e1 = timing.account([rank(0, steps=10, compute=0.1), rank(1, steps=10, compute=0.1)])
    e2 = timing.account([rank(0, steps=30, compute=0.2), rank(1, steps=30, compute=0.5, data=0.1)])
    run = timing.over_run([e1, e2])
    assert run["ranks"][0]["compute"] == pytest.approx((10 * 0.1 + 30 * 0.2) / 40)
    assert run["ranks"][1]["steps"] == 40 and run["slowest"]["rank"] == 1
    assert timing.over_run([]) is None


def test_the_clock_gives_each_interval_to_the_phase_it_ends():
    clock = timing.StepClock(torch.device("cpu"))
    for _ in range(3):
        time.sleep(0.02)
        clock.mark(timing.DATA)
        clock.mark(timing.COMPUTE)
        clock.mark(timing.WAIT)
        clock.mark(timing.OPTIMIZER)
        clock.step_done()
    seconds = clock.totals()
    assert clock.steps == 3 and seconds[timing.DATA] >= 0.06
    assert seconds[timing.DATA] > seconds[timing.COMPUTE]
    clock.begin()
    assert clock.steps == 0 and sum(clock.totals()) == 0


def test_a_switched_off_clock_counts_nothing():
    clock = timing.StepClock(torch.device("cpu"), enabled=False)
    time.sleep(0.01)
    clock.mark(timing.DATA)
    clock.step_done()
    assert clock.steps == 0 and sum(clock.totals()) == 0
