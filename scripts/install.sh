#!/usr/bin/env bash
# One-command setup for hvd-train. Called by `make setup` (and so by `make demo` / `make test`) and by the Docker images.
#
#   scripts/install.sh [--gpu | --cpu] [--venv DIR] [--no-apt]
#
# 1. checks the prerequisites (Python >= 3.9 with venv, a C++ compiler, make);
# 2. installs OpenMPI with apt when mpirun or its headers are missing (as root), else says the exact command to run;
# 3. creates the virtual environment (.venv in the checkout by default) and installs requirements.txt, pinned;
# 4. builds Horovod 0.28.1 against that torch (scripts/build_horovod.py, cached outside the checkout) and installs it;
# 5. installs this checkout in editable mode (the `hvd-train` console script);
# 6. checks `horovodrun --check-build` lists PyTorch, MPI and Gloo.
# Every step is skipped when already done, so running it again takes seconds.
#
# Environment: HVD_GPU=1|0 (same as --gpu/--cpu; default: NCCL when nvidia-smi sees a GPU), HVD_VENV, PYTHON,
# HVD_CACHE_DIR (where built Horovod wheels are kept; default ~/.cache/hvd-train), TMPDIR (where pip unpacks),
# HVD_INSTALL_NEEDS_GB (free disk the first install asks for: the venv plus pip's downloads; default 10).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${HVD_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
GPU=${HVD_GPU:-auto}
APT=1

step() { printf '\n==> %s\n' "$*"; }
die() { printf '\ninstall.sh: error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --gpu) GPU=1 ;;
        --cpu) GPU=0 ;;
        --venv) [ $# -ge 2 ] || die "--venv needs a directory"; VENV=$2; shift ;;
        --no-apt) APT=0 ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option '$1' (try --help)" ;;
    esac
    shift
done
case "$GPU" in
    auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then GPU=1; else GPU=0; fi ;;
    1|0) ;;
    *) die "HVD_GPU must be 1, 0 or auto, not '$GPU'" ;;
esac

step "Checking prerequisites"
command -v "$PYTHON" >/dev/null 2>&1 || die "no '$PYTHON' on PATH: install Python 3.9 or newer (Debian: apt-get install python3 python3-venv python3-dev), or set PYTHON=/path/to/python3"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 9))' \
    || die "$("$PYTHON" --version 2>&1) is too old: hvd-train needs Python 3.9 or newer (set PYTHON=/path/to/python3)"
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null \
    || die "$PYTHON cannot create virtual environments: install its venv module (Debian: apt-get install python3-venv)"
command -v g++ >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1 \
    || die "no C++ compiler: Horovod is compiled from source (Debian: apt-get install g++ make)"
command -v make >/dev/null 2>&1 || die "no 'make': Horovod is compiled from source (Debian: apt-get install make)"
echo "python: $("$PYTHON" --version 2>&1), compiler: $( (g++ --version || c++ --version) 2>/dev/null | head -n1), GPU build: $([ "$GPU" = 1 ] && echo yes || echo no)"

step "Checking OpenMPI and ssh"
# Horovod's MPI controller needs the MPI headers and wrappers at build time and mpirun at run time; ranks on other
# hosts are started over ssh (sshd also serves the two-host test, tests/test_multihost.py).
ssh_cmd="apt-get install -y --no-install-recommends openssh-client openssh-server"
can_apt=0
if [ "$APT" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then can_apt=1; fi
if command -v ssh >/dev/null 2>&1 && [ -x /usr/sbin/sshd ]; then
    echo "found ssh and sshd"
elif [ "$can_apt" = 1 ]; then
    echo "installing ssh: $ssh_cmd"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive $ssh_cmd
else
    echo "note: no ssh client or server: single-host runs work; multi-host runs need them (sudo $ssh_cmd)"
fi
if command -v mpirun >/dev/null 2>&1 && command -v mpicxx >/dev/null 2>&1; then
    echo "found $(mpirun --version 2>/dev/null | head -n1)"
else
    apt_cmd="apt-get install -y --no-install-recommends openmpi-bin libopenmpi-dev"
    if [ "$can_apt" = 1 ]; then
        echo "installing OpenMPI: $apt_cmd"
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive $apt_cmd
    else
        die "OpenMPI is missing (mpirun or mpicxx not found). Install it and run this again:
    sudo apt-get update && sudo $apt_cmd
(other systems: install OpenMPI with its development headers, e.g. 'module load openmpi' on a cluster)"
    fi
fi

reqs_stamp="$VENV/.requirements.sha256"
reqs_want=$(sha256sum "$ROOT/requirements.txt" | cut -d' ' -f1)
reqs_done=0
if [ -f "$reqs_stamp" ] && [ "$(cat "$reqs_stamp")" = "$reqs_want" ]; then reqs_done=1; fi

if [ "$reqs_done" = 0 ]; then
    step "Checking disk space"
    # torch's PyPI wheel brings its CUDA libraries: the venv takes about 6 GiB and pip unpacks about 3 GiB more in
    # TMPDIR on the way. Running out half-way leaves a broken venv and a pip error far from the cause.
    need=${HVD_INSTALL_NEEDS_GB:-10}
    [[ "$need" =~ ^[0-9]+$ ]] || die "HVD_INSTALL_NEEDS_GB must be a whole number of GiB, not '$need'"
    where=$VENV
    while [ ! -d "$where" ]; do where=$(dirname "$where"); done
    tmp=${TMPDIR:-/tmp}
    free_gib() { df -Pk "$1" | awk 'NR == 2 { printf "%d", $4 / 1048576 }'; }
    if [ "$(stat -c %d "$where")" = "$(stat -c %d "$tmp")" ]; then
        free=$(free_gib "$where")
        [ "$free" -ge "$need" ] || die "not enough disk space: installing needs about $need GiB on the disk of $where and $tmp, and $free GiB are free.
Free some space there, or put the environment on a larger disk: scripts/install.sh --venv /big/disk/venv (with TMPDIR=/big/disk/tmp for pip's downloads)."
        echo "$free GiB free (about $need GiB needed)"
    else
        free=$(free_gib "$where"); tmp_free=$(free_gib "$tmp"); tmp_need=$(( need * 3 / 10 ))
        [ "$free" -ge $(( need - tmp_need )) ] || die "not enough disk space for the environment: it needs about $(( need - tmp_need )) GiB in $where, and $free GiB are free.
Free some space there, or put it on a larger disk: scripts/install.sh --venv /big/disk/venv"
        [ "$tmp_free" -ge "$tmp_need" ] || die "not enough disk space for pip's downloads: they need about $tmp_need GiB in $tmp, and $tmp_free GiB are free.
Free some space there, or point TMPDIR at a larger disk: TMPDIR=/big/disk/tmp scripts/install.sh"
        echo "$free GiB free in $where, $tmp_free GiB in $tmp (about $need GiB needed in all)"
    fi
fi

step "Creating the virtual environment in $VENV"
if [ -x "$VENV/bin/python" ]; then
    echo "exists"
else
    "$PYTHON" -m venv "$VENV" || die "could not create $VENV"
fi
VPY="$VENV/bin/python"
# The venv's bin first on PATH: the Horovod build finds cmake there and horovodrun finds the venv's python.
export PATH="$VENV/bin:$PATH"

step "Installing pinned requirements (requirements.txt)"
if [ "$reqs_done" = 1 ]; then
    echo "up to date"
else
    "$VPY" -m pip install -q --upgrade pip
    # torch is pinned to the PyPI build; a local find-links folder with another build would not match the pin.
    "$VPY" -m pip install -r "$ROOT/requirements.txt" || die "pip could not install requirements.txt (see the pip error above)"
    echo "$reqs_want" >"$reqs_stamp"
fi

step "Building and installing Horovod"
build_args=(--python "$VPY")
[ "$GPU" = 1 ] && build_args+=(--gpu)
"$VPY" "$ROOT/scripts/build_horovod.py" "${build_args[@]}"

step "Installing hvd-train (editable)"
# Keyed by setup.cfg: the editable install maps the modules listed there, so a new module needs a reinstall.
stamp="$VENV/.editable.sha256"
want=$(sha256sum "$ROOT/setup.cfg" | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VPY" -m pip show -q hvd-train >/dev/null 2>&1; then
    echo "installed"
else
    # setuptools is chatty about editable installs; show its output only when it fails.
    out=$("$VPY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" 2>&1) || die "pip install -e failed:
$out"
    echo "$want" >"$stamp"
    echo "installed the hvd-train console script"
fi

step "Checking the Horovod build (horovodrun --check-build)"
report=$("$VENV/bin/horovodrun" --check-build 2>&1) || die "horovodrun --check-build failed:
$report"
echo "$report"
for want in PyTorch MPI Gloo; do
    grep -qE "\[X\] $want\b" <<<"$report" || die "Horovod was built without $want (see the table above). Remove the cached wheel ($("$VPY" "$ROOT/scripts/build_horovod.py" --python "$VPY" --print-cache-dir)) and run this again."
done
if [ "$GPU" = 1 ]; then
    grep -qE "\[X\] NCCL\b" <<<"$report" || die "a GPU build was asked for but Horovod lacks NCCL (see the table above)"
fi

step "Done: activate with 'source $VENV/bin/activate', or use 'make demo' / 'make test'"
