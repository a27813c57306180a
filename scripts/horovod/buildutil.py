"""What the Horovod build's modules share: its messages, its commands, and where it caches."""
import os
import subprocess
import sys
from pathlib import Path


def die(msg):
    sys.exit(f"\nbuild_horovod.py: error: {msg}")


def log(msg):
    print(msg, flush=True)


def run(cmd, **kw):
    log("  $ " + " ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kw)


def cache_root():
    return Path(os.environ.get("HVD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvd-train"))
