#!/usr/bin/env bash
# Builds an hvd-train image with BuildKit (the Dockerfiles use its secret and cache mounts).
#
#   docker/build.sh cpu|gpu [--tag TAG] [--base IMAGE] [--ca-bundle FILE] [-- DOCKER_BUILD_ARGS...]
#
#   --tag        default hvd-train:cpu or hvd-train:gpu
#   --base       the base image (default $HVD_BASE_IMAGE, else python:3.11-slim-bookworm): any Debian or Ubuntu image, e.g. a site's
#                mirror, nvidia/cuda:13.0.0-devel-ubuntu24.04, or hvd-train-base:bookworm from docker/base-image.sh
#                where no registry can be reached
#   --ca-bundle  a CA bundle for pip inside the build (behind a proxy that re-signs HTTPS; default $HVD_CA_BUNDLE),
#                passed as a BuildKit secret: used while building, not stored in the image
# Environment: DOCKER (the docker command; default: the first one on PATH that can build with BuildKit).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
die() { printf 'docker/build.sh: error: %s\n' "$*" >&2; exit 2; }

[ $# -ge 1 ] || die "which image? docker/build.sh cpu|gpu (see --help)"
case "$1" in
    cpu|gpu) VARIANT=$1 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown image '$1': cpu or gpu" ;;
esac
shift
TAG=hvd-train:$VARIANT
BASE=${HVD_BASE_IMAGE:-}
CA=${HVD_CA_BUNDLE:-}
while [ $# -gt 0 ]; do
    case "$1" in
        --tag) [ $# -ge 2 ] || die "--tag needs a name"; TAG=$2; shift ;;
        --base) [ $# -ge 2 ] || die "--base needs an image"; BASE=$2; shift ;;
        --ca-bundle) [ $# -ge 2 ] || die "--ca-bundle needs a file"; CA=$2; shift ;;
        --) shift; break ;;
        *) die "unknown option '$1' (try --help)" ;;
    esac
    shift
done
if [ -n "$CA" ] && [ ! -s "$CA" ]; then
    die "--ca-bundle $CA: no such file, or it is empty (Debian keeps the system's bundle in /etc/ssl/certs/ca-certificates.crt)"
fi

# BuildKit: `docker buildx`, or a docker CLI from before 23.0, which has it built in (DOCKER_BUILDKIT=1).
builder=()
for docker in ${DOCKER:-} $(type -ap docker | awk '!seen[$0]++'); do
    if "$docker" buildx version >/dev/null 2>&1; then
        builder=("$docker" buildx build --load); break
    fi
    major=$("$docker" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1 || true)
    if [[ "$major" =~ ^[0-9]+$ ]] && [ "$major" -lt 23 ]; then
        builder=(env DOCKER_BUILDKIT=1 "$docker" build); break
    fi
done
[ ${#builder[@]} -gt 0 ] || die "no docker CLI here can build with BuildKit: install the buildx plugin (Debian/Ubuntu: apt-get install docker-buildx, or Docker's docker-buildx-plugin)"

args=(-f "$ROOT/docker/Dockerfile.$VARIANT" -t "$TAG")
[ -n "$BASE" ] && args+=(--build-arg "BASE_IMAGE=$BASE")
[ -n "$CA" ] && args+=(--secret "id=ca,src=$CA")
echo "building $TAG: ${builder[*]} ${args[*]} $* $ROOT"
start=$(date +%s)
"${builder[@]}" "${args[@]}" "$@" "$ROOT"
echo "built $TAG in $(( $(date +%s) - start )) s"
