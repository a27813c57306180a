"""`make lint`'s checks of the floor plan: import-linter's contracts (setup.cfg [importlinter]) and mypy on the
typed modules (setup.cfg [mypy]).

    python scripts/check_layers.py            # both; exit 1 when a contract is broken or mypy finds an error
    python scripts/check_layers.py --mypy     # mypy alone (while annotating)
    python scripts/check_layers.py --imports  # import-linter alone

Both tools read packages as Python finds them installed, where data/, models/ and hostfiles/ are the subpackages
hvd_train.data, hvd_train.models and hvd_train.hostfiles (setup.cfg's package_dir). A checkout keeps them beside the
package, so this copies the product's sources into that layout in a folder of its own under build/ first (a
fraction of a second), runs the tools there and removes it; their messages name the files of the checkout.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = Path()  # the folder of this run's layout (assemble())
BESIDE = ("data", "models", "hostfiles")
BIN = Path(sys.executable).parent


def assemble():
    """build/layers-*/{hvd_train,hvd_utils} as the wheel installs them, a folder for each run (two lints at once
    do not share one); returns the folder."""
    global LAYOUT
    (ROOT / "build").mkdir(exist_ok=True)
    LAYOUT = Path(tempfile.mkdtemp(prefix="layers-", dir=ROOT / "build"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("hvd_train", "hvd_utils"):
        shutil.copytree(ROOT / package, LAYOUT / package, ignore=ignore)
    for folder in BESIDE:
        shutil.copytree(ROOT / folder, LAYOUT / "hvd_train" / folder, ignore=ignore)
    return LAYOUT


def in_checkout(text):
    """The tools' output with the layout's paths as the checkout's."""
    prefix = re.escape(str(LAYOUT) + os.sep)
    for folder in BESIDE:
        text = re.sub(prefix + "hvd_train/" + folder + "/", folder + "/", text)
        text = re.sub(r"(?<![\w/])hvd_train/" + folder + "/", folder + "/", text)
    return re.sub(prefix, "", text)


def run(command):
    env = {**os.environ, "PYTHONPATH": str(LAYOUT)}
    result = subprocess.run(command, cwd=LAYOUT, env=env, capture_output=True, text=True)
    sys.stdout.write(in_checkout(result.stdout))
    sys.stderr.write(in_checkout(result.stderr))
    return result.returncode


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mypy", action="store_true", help="run mypy alone")
    parser.add_argument("--imports", action="store_true", help="run import-linter alone")
    args = parser.parse_args(argv)
    assemble()
    try:
        failed = 0
        if not args.mypy:
            failed |= run([str(BIN / "lint-imports"), "--config", str(ROOT / "setup.cfg"), "--no-cache",
                           "--no-logo"]) != 0
        if not args.imports:
            failed |= run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "setup.cfg"),
                           "--cache-dir", str(LAYOUT / ".mypy_cache")]) != 0
    finally:
        shutil.rmtree(LAYOUT, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
