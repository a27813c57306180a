"""`bench/run.py --sections slowlink` on its tiny settings: two namespace hosts on a shaped link, the app's float32,
bfloat16 and PowerSGD runs and torchrun + DDP's powerSGD_hook across them, and the digits' quality pair; every row
written with a measured rate. (The figures themselves: docs/benchmarks.md, from full runs.)"""
import subprocess
import sys

import pytest

from conftest import ROOT, job_env, read_json

# Namespace hosts have fixed names: one cluster at a time (make test runs files side by side).
pytestmark = [pytest.mark.distributed, pytest.mark.extended, pytest.mark.xdist_group("cluster")]


def test_the_slow_link_section_writes_every_row(tmp_path):
    cmd = [sys.executable, "bench/run.py", "--quick", "--repeats", "1", "--sections", "slowlink",
           "--results-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [(r["figure"], r["compared"], r) for r in read_json(next(tmp_path.glob("*.json")))["rows"]]
    compared = [c for _, c, _ in rows]
    assert compared == ["app --bf16-allreduce / app float32",
                        "app --powersgd-rank 1 / torchrun DDP powerSGD_hook rank 1 (Gloo)",
                        "app --powersgd-rank 1 / app float32",
                        "best val top-1: --powersgd-rank 4 minus no compression (points)"], compared
    for figure, _, row in rows[:3]:
        assert figure.startswith("slow link (200 Mbit/s)") and row["a"]["median"] > 0 and row["b"]["median"] > 0
    assert 0 <= rows[3][2]["a"]["median"] <= 100 and 0 <= rows[3][2]["b"]["median"] <= 100
