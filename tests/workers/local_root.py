"""hvd_utils.run_on_local_root with a slow "download": only local rank 0 runs it, the others wait for it.

    local_root.py OUT_DIR [--fail]

The download appends a line to OUT_DIR/downloads.txt after 1.5 s; every rank then records whether it saw the
finished file. With --fail the download raises, and every rank must stop with that error, not hang.
"""
import json
import os
import sys
import time

import hvd_utils


def main(out_dir, fail):
    rt = hvd_utils.init()
    target = os.path.join(out_dir, "downloads.txt")

    def download():
        time.sleep(1.5)
        if fail:
            raise OSError("the mirror is unreachable")
        with open(target, "a") as f:
            f.write(f"rank {rt.rank}\n")

    try:
        hvd_utils.run_on_local_root(download, "downloading test data")
        outcome = {"saw_file": os.path.exists(target)}
    except Exception as e:
        outcome = {"error": str(e)}
    with open(os.path.join(out_dir, f"rank{rt.rank}.json"), "w") as f:
        json.dump(outcome, f)
    hvd_utils.shutdown()
    sys.exit(1 if "error" in outcome else 0)


if __name__ == "__main__":
    main(sys.argv[1], "--fail" in sys.argv)
