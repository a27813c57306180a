"""A wheel built from the checkout installs and runs where the checkout cannot be seen.

The fresh environment gets the wheel and nothing of the checkout: torch, Horovod and the other requirements come
from the project's venv through a path entry (not a site directory, so the venv's editable install of hvd-train is
not active there), and everything runs from another directory.
"""
import json
import os
import subprocess
import sys
import sysconfig
import zipfile

from conftest import ROOT


def run(cmd, cwd, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_a_wheel_installs_into_a_fresh_environment_and_trains_from_another_directory(tmp_path):
    dist, fresh, elsewhere = tmp_path / "dist", tmp_path / "fresh", tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The build backend of the project's venv: no download (the isolated build would fetch setuptools).
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", dist, ROOT],
        cwd=tmp_path)
    [wheel] = list(dist.glob("hvd_train-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("train_hvd.py", "hvd_train/modes/benchmark.py", "hvd_train/trainer.py", "hvd_utils/runtime.py",
                   "hvd_train/models/small_cnn.py", "hvd_train/data/catalog.py", "hvd_train/tools/doctor.py",
                   "hvd_train/hostfiles/validate.py"):
        assert module in names, f"{module} is missing from {wheel.name}"
    # Nothing under the names users give their own folders (data/, models/): installed, those would shadow theirs.
    outside = ("tests", "bench", "scripts", "engine.py", "config.py", "data", "models", "hostfiles")
    assert not [n for n in names if n.split("/")[0] in outside]

    run([sys._base_executable, "-m", "venv", "--without-pip", fresh], cwd=tmp_path)
    fresh_python = fresh / "bin" / "python"
    site = run([fresh_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               cwd=elsewhere).stdout.strip()
    (fresh / site / "requirements-from-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([sys.executable, "-m", "pip", "--python", fresh_python, "install", "--no-deps", "--no-index", wheel],
        cwd=tmp_path)

    where = json.loads(run([fresh_python, "-c", "import json, sys, hvd_train, train_hvd; print(json.dumps("
                            "[hvd_train.__file__, train_hvd.__file__, sys.path]))"], cwd=elsewhere).stdout)
    assert all(path.startswith(str(fresh)) for path in where[:2]), where[:2]
    assert not [p for p in where[2] if p.startswith(str(ROOT)) and ".venv" not in p], "the checkout is on sys.path"

    hvd_train = fresh / "bin" / "hvd-train"
    assert "--batch-size" in run([hvd_train, "--help"], cwd=elsewhere).stdout
    assert "a job would start" in run([hvd_train, "doctor", "-H", "localhost:1", "--gloo"], cwd=elsewhere).stdout
    run([hvd_train, "--epochs", "1", "--output-dir", "out", "--logging.tensorboard", "false"], cwd=elsewhere)
    summary = json.loads((elsewhere / "out" / "summary.json").read_text())
    assert len(summary["history"]) == 1 and summary["params_in_sync"]
    assert (elsewhere / "out" / "checkpoints" / "last.pt").is_file()
