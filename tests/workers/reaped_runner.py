"""Runs `exit 3` through horovodrun --gloo's rank runner (safe_shell_exec.execute) N times while another thread polls
every child process, as horovodrun's host discovery does with each Process.start() of an elastic job; prints the exit
statuses it got, as JSON."""
import json
import multiprocessing
import sys
import threading

from horovod.runner.common.util import safe_shell_exec

if __name__ == "__main__":  # the runner is started with multiprocessing's spawn, which imports this file again
    done = threading.Event()

    def poll_children():
        while not done.is_set():
            multiprocessing.active_children()  # waitpid(WNOHANG) on every child, the runner's included

    threading.Thread(target=poll_children, daemon=True).start()
    codes = [safe_shell_exec.execute("exit 3") for _ in range(int(sys.argv[1]))]
    done.set()
    print(json.dumps(codes))
