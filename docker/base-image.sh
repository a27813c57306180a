#!/usr/bin/env bash
# Makes a Python base image from Debian packages, for machines that cannot pull from a registry (air-gapped sites,
# this project's test machines): debootstrap a minimal Debian with Python, its venv module and headers, then
# `docker import` it. The result stands in for python:3.11-slim-bookworm (same Debian, same Python 3.11).
#
#   docker/base-image.sh [TAG]          default TAG: hvd-train-base:bookworm
#
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), DOCKER (the docker command).
# Needs root (debootstrap) and the debootstrap package. An image that already exists is kept: delete it to remake it.
set -euo pipefail

TAG=${1:-hvd-train-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DOCKER=${DOCKER:-docker}
die() { printf 'base-image.sh: error: %s\n' "$*" >&2; exit 1; }

if "$DOCKER" image inspect "$TAG" >/dev/null 2>&1; then
    echo "$TAG exists"
    exit 0
fi
[ "$(id -u)" = 0 ] || die "debootstrap needs root: run it with sudo"
command -v debootstrap >/dev/null 2>&1 || die "debootstrap is missing: apt-get install debootstrap"
root=$(mktemp -d "${TMPDIR:-/tmp}/hvd-base.XXXXXX")
trap 'rm -rf "$root"' EXIT
echo "debootstrap bookworm from $MIRROR into $root"
debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates bookworm "$root" "$MIRROR" \
    >"$root.log" 2>&1 || { tail -n 20 "$root.log" >&2; rm -f "$root.log"; die "debootstrap failed (see above)"; }
rm -f "$root.log"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | "$DOCKER" import --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' - "$TAG" >/dev/null
echo "made $TAG ($("$DOCKER" image inspect --format '{{.Size}}' "$TAG" | awk '{ printf "%.0f MB", $1 / 1e6 }'))"
