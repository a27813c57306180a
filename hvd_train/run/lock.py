"""One job per output directory: rank 0 holds <output dir>/.hvd-train.lock while its run lives.

The lock is made with O_CREAT | O_EXCL, which lets one creator win on a local file system and on NFS (v3 and
later, Linux clients), and holds the holder's host, pid, process start time and a random token. A thread touches
it every HEARTBEAT_S seconds. A lock left by a job that is gone is taken over, with a warning:
- on the same host, when its pid no longer runs that process (the start time tells a reused pid apart);
- from another host, which cannot look at the holder's processes, when it has not been touched for STALE_S seconds
  (file times come from the file server on NFS, so this holds as long as the hosts' clocks agree within minutes).
Taking over a dead job's lock is best effort: two jobs that find the same stale lock at the same instant may both
start. A job that holds the lock is never displaced.
"""
import json
import logging
import os
import secrets
import socket
import threading
import time

import psutil

from hvd_train.errors import CheckpointError

log = logging.getLogger("hvd_train")

NAME = ".hvd-train.lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0


class RunLock:
    def __init__(self, root):
        self.root, self.path = root, os.path.join(root, NAME)
        self.token, self._stop = None, threading.Event()

    def acquire(self):
        """Take the lock, or raise CheckpointError naming the job that holds it and what to do."""
        os.makedirs(self.root, exist_ok=True)
        me = psutil.Process()
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "started": me.create_time(),
                "token": secrets.token_hex(8)}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.read()
                if holder is not None and (holder.get("host"), holder.get("pid")) == (mine["host"], mine["pid"]):
                    os.remove(self.path)  # this process's own, from a run before in it (hvd_train.train() twice)
                    continue
                reason = self.gone(holder)
                if reason is None:
                    raise CheckpointError(self.held_message(holder)) from None
                log.warning("--output-dir %s: taking over the lock of a job that is gone (%s)", self.root, reason)
                if self.read() == holder:  # still that job's lock, not one a third job has just taken
                    try:
                        os.remove(self.path)
                    except FileNotFoundError:
                        pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
            self.token = mine["token"]
            threading.Thread(target=self._heartbeat, name="hvd-train-lock", daemon=True).start()
            return
        raise CheckpointError(f"--output-dir {self.root}: another job took it over at the same moment ({self.path}); "
                              f"choose another --output-dir")

    def read(self):
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):  # gone meanwhile, or written halfway by a job that died
            return None

    def gone(self, holder):
        """Why the holder is gone, or None while it may be alive."""
        age = time.time() - os.path.getmtime(self.path) if os.path.exists(self.path) else STALE_S + 1
        if holder is None or holder.get("host") != socket.gethostname():
            return f"its lock was not touched for {age:.0f} s" if age > STALE_S else None
        try:
            process = psutil.Process(holder["pid"])
            # A zombie has ended: only its parent has not reaped it (a killed launcher's rank, in a container
            # whose first process reaps nothing).
            alive = (abs(process.create_time() - holder["started"]) < 1.0
                     and process.status() != psutil.STATUS_ZOMBIE)
        except (psutil.NoSuchProcess, KeyError, TypeError):
            alive = False
        return None if alive else f"pid {holder.get('pid')} on {holder['host']} no longer runs"

    def held_message(self, holder):
        if holder is None:
            who = f"a job whose lock file cannot be read ({self.path})"
        else:
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
            who = f"the job whose rank 0 runs on {holder.get('host')} as pid {holder.get('pid')}, started {started}"
        return (f"--output-dir {self.root} is in use by {who}; wait for it to end, or choose another --output-dir. "
                f"If that job is gone, the next run takes its lock over (at once on the same host; from another, "
                f"{STALE_S / 60:.0f} minutes after its last sign of life), or delete {self.path}")

    def _heartbeat(self):
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def release(self):
        """Remove the lock if this process holds it (a job that took it over since keeps its own)."""
        if self.token is None:
            return
        self._stop.set()
        holder = self.read()
        if holder is not None and holder.get("token") == self.token:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        self.token = None
