"""A rank that takes 8 s to stop after SIGTERM, as the save of a large model may, then exits 3. Run under
horovodrun --gloo by tests/launch/test_honest_runs.py, which signals horovodrun and expects each rank's own exit,
not a kill. Argument: the folder where each rank marks that it is ready and that it stopped."""
import os
import signal
import sys
import time
from pathlib import Path

out, rank = Path(sys.argv[1]), os.environ["HOROVOD_RANK"]
signalled = []
signal.signal(signal.SIGTERM, lambda signum, frame: signalled.append(signum))
(out / f"ready-{rank}").touch()
while not signalled:
    time.sleep(0.1)
time.sleep(8)  # the save: longer than stock Horovod's 5 s of grace
(out / f"stopped-{rank}").touch()
sys.exit(3)
