"""train_hvd.py under attack on its watchdog's UDP ports, then with a frozen rank.

    watchdog_attack.py ATTACK_STEP STOP_STEP -- TRAIN_HVD_ARGS...

At its ATTACK_STEP-th step, rank 0 sends forged and malformed datagrams, from a socket of its own as any local user
could, to both ranks' watchdog ports: the old JSON format with a non-integer progress, random bytes, beats of the
right size claiming rank 1 far ahead or rank 0 behind with a made-up MAC, an empty and an oversized datagram. It
writes how many it sent to $HVD_TEST_SENT. At STOP_STEP rank 1 SIGSTOPs itself: the watchdog must still be alive to
name it. Everything else is the real application.
"""
import os
import signal
import socket
import sys

from hvd_train import trainer
from hvd_train.guards import watchdog
import hvd_utils
import train_hvd


def forged():
    mac = bytes(watchdog.MAC_BYTES)
    return [b'{"t": "0000", "r": 1, "p": "x"}', os.urandom(watchdog.BEAT.size + watchdog.MAC_BYTES),
            watchdog.BEAT.pack(1, 10**9, 1, 1) + mac, watchdog.BEAT.pack(0, 0, 2**63, 2**31) + mac, b"", b"x" * 600]


def attack():
    ports = [watchdog._active.me.port] + [p.member.port for p in watchdog._active.peers.values()]
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sent = 0
    for port in ports:
        for datagram in forged():
            sock.sendto(datagram, ("127.0.0.1", port))
            sent += 1
    with open(os.environ["HVD_TEST_SENT"], "w") as f:
        f.write(str(sent))


def main():
    attack_step, stop_step = int(sys.argv[1]), int(sys.argv[2])
    sys.argv = [sys.argv[0]] + sys.argv[sys.argv.index("--") + 1:]
    real_step, calls = trainer.train_step, {"n": 0}

    def step(*args, **kwargs):
        calls["n"] += 1
        if hvd_utils.launcher_rank() == 0 and calls["n"] == attack_step:
            attack()
        if hvd_utils.launcher_rank() == 1 and calls["n"] == stop_step:
            os.kill(os.getpid(), signal.SIGSTOP)
        return real_step(*args, **kwargs)

    trainer.train_step = step
    train_hvd.cli()


if __name__ == "__main__":
    main()
