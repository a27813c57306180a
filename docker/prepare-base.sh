#!/usr/bin/env bash
# The images' system layer, run as root by `docker build` on any Debian or Ubuntu base: the installer's
# prerequisites, the user that trains, sshd for mpirun across containers, and OpenMPI's settings for containers.
set -euo pipefail

pkgs=(g++ make patch openmpi-bin libopenmpi-dev openssh-server openssh-client curl ca-certificates)
# python:*-slim brings Python with its headers; a CUDA or plain Debian/Ubuntu base gets the distribution's Python.
# Without the headers Horovod's build would fail after minutes of compiling.
if ! command -v python3 >/dev/null 2>&1 || ! python3 - <<'PY'
import os, sys, sysconfig
import ensurepip, venv  # noqa: F401  (the installer makes a venv)
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))
PY
then
    pkgs+=(python3 python3-venv python3-dev)
fi
apt-get update
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${pkgs[@]}"
rm -rf /var/lib/apt/lists/*

# uid 1000 trains (Ubuntu bases ship a user 'ubuntu' with that uid: it gives way).
taken=$(getent passwd 1000 | cut -d: -f1 || true)
if [ -n "$taken" ] && [ "$taken" != hvd ]; then userdel --remove "$taken" 2>/dev/null || userdel "$taken"; fi
useradd --create-home --shell /bin/bash --uid 1000 hvd
mkdir -p /run/sshd /home/hvd/.ssh /opt/hvd-train
chown -R hvd:hvd /home/hvd/.ssh /opt/hvd-train
chmod 700 /home/hvd/.ssh

# sshd on 12345 with the user's keys, mounted at /home/hvd/.ssh at run time (no key is ever in the image). Host keys
# are made afresh when a container starts (start-sshd.sh), so none can be pinned in the image: the client accepts a
# host it meets for the first time (accept-new) into this container's own known_hosts, and refuses one whose key
# then changes. Host-key checking stays on, and ssh's warnings are shown.
printf 'Port 12345\nPasswordAuthentication no\nPermitRootLogin no\nAuthorizedKeysFile /home/hvd/.ssh/authorized_keys\n' \
    >/etc/ssh/sshd_config.d/hvd-train.conf
mkdir -p /home/hvd/.cache/hvd-train
chown -R hvd:hvd /home/hvd/.cache
printf 'Host *\n    Port 12345\n    StrictHostKeyChecking accept-new\n    UserKnownHostsFile ~/.cache/hvd-train/known_hosts\n' \
    >/etc/ssh/ssh_config.d/hvd-train.conf

# OpenMPI in a container: its shared-memory transport copies between ranks with process_vm_readv (CMA), which
# Docker's default seccomp profile and capabilities refuse; every rank then prints "Read -1, expected ..., errno = 1"
# and falls back. Copy-in/copy-out through the shared segment instead. In the system-wide file, not the
# environment, so ranks that mpirun starts over ssh get it too.
conf=$(find /etc/openmpi /usr/local/etc /usr/lib -maxdepth 3 -name openmpi-mca-params.conf 2>/dev/null | head -n1)
conf=${conf:-/etc/openmpi/openmpi-mca-params.conf}
mkdir -p "$(dirname "$conf")"
printf '\n# hvd-train image (docker/prepare-base.sh)\nbtl_vader_single_copy_mechanism = none\n' >>"$conf"
