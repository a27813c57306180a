#!/usr/bin/env bash
# Worker entry point for multi-node mpirun: make this container's own host keys (none are baked into the image)
# and run sshd on port 12345 in the foreground. Runs as root (sshd needs it); training runs as user hvd, logged in
# with the key pair mounted at /home/hvd/.ssh (authorized_keys, id_ed25519).
set -euo pipefail
ssh-keygen -A
exec /usr/sbin/sshd -D -e
