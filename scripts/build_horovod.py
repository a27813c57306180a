"""Build Horovod 0.28.1 against the torch of the running Python, cache the wheel, install it.

Run with the virtual environment's python (scripts/install.sh does):

    .venv/bin/python scripts/build_horovod.py [--gpu] [--force]

Horovod's last release (0.28.1) predates PyTorch 2.1 and does not build against it as released. This script
downloads the sdist from PyPI and makes the few edits it needs, each explained in PATCHES below, then builds a
wheel with PyTorch, MPI and Gloo (and NCCL with --gpu). The wheel is kept in a cache outside the checkout, keyed by
Horovod, torch and Python versions, the build flags and the patches, so the next setup on this machine installs it
in seconds instead of compiling for about six minutes.
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
from pathlib import Path

HOROVOD_VERSION = "0.28.1"
STAMP_NAME = ".horovod-build-key"  # in the venv: the key of the wheel installed there


def die(msg):
    sys.exit(f"\nbuild_horovod.py: error: {msg}")


def log(msg):
    print(msg, flush=True)


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
        die(f"torch is not importable with {sys.executable} ({e}); run scripts/install.sh, which installs it first")
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cxx_standard": torch_cxx_standard(include_paths()[0]),
    }


# --------------------------------------------------------------------------------------------------------------------
# The edits to the sdist. Each is (file, old, new, why); the old text must be there exactly once, so a different
# sdist fails loudly here rather than building something half-patched.


def patches(cxx_standard):
    std = str(cxx_standard)
    return [
        ("CMakeLists.txt",
         "set(CMAKE_CXX_STANDARD 14)",
         f"set(CMAKE_CXX_STANDARD {std})",
         "torch's headers refuse C++14 (torch >= 2.1 needs C++17, >= 2.15 C++20); the standard follows the "
         "installed torch"),
        ("horovod/torch/CMakeLists.txt",
         "    set(CMAKE_CXX_STANDARD 14)",
         f"    set(CMAKE_CXX_STANDARD {std})",
         "the torch extension resets the standard to 14 for torch >= 1.5; same reason"),
        ("cmake/Modules/FindPytorch.cmake",
         'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)',
         'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)\n'
         '# hvd-train: the PyPI torch is a CUDA build even on machines without a GPU; a CPU-only Horovod build\n'
         '# (HVD_TRAIN_TORCH_CPU_ONLY=1) must not turn on CUDA because of it, or it fails where the CUDA\n'
         '# toolkit is incomplete.\n'
         'if("$ENV{HVD_TRAIN_TORCH_CPU_ONLY}" STREQUAL "1")\n'
         '    set(Pytorch_CUDA FALSE)\n'
         'endif()',
         "lets a CPU-only build ignore that the PyPI torch is a CUDA build"),
        ("horovod/torch/CMakeLists.txt",
         'execute_process(COMMAND ${PY_EXE} -c "from distutils.sysconfig import get_python_inc; '
         'print(get_python_inc())"',
         'execute_process(COMMAND ${PY_EXE} -c "import sysconfig; print(sysconfig.get_paths()[\'include\'])"',
         "distutils is gone from Python 3.12; sysconfig gives the same include directory"),
    ]


def apply_patches(src_dir, cxx_standard):
    for rel, old, new, why in patches(cxx_standard):
        path = Path(src_dir) / rel
        text = path.read_text()
        count = text.count(old)
        if count != 1:
            die(f"cannot patch {rel}: expected the text {old!r} once, found it {count} times. "
                f"This script knows Horovod {HOROVOD_VERSION}'s sources only.")
        path.write_text(text.replace(old, new))
        log(f"  patched {rel}: {why}")


def patch_fingerprint():
    """Changes whenever the patches change, so the cache never serves a wheel built with older edits."""
    return hashlib.sha256(repr(patches("N")).encode()).hexdigest()[:10]


# --------------------------------------------------------------------------------------------------------------------
# Build environment


def nccl_dirs():
    """NCCL headers and library from the nvidia-nccl pip package that comes with torch."""
    try:
        import nvidia.nccl
    except ImportError:
        die("a GPU build needs NCCL: the nvidia-nccl pip package that comes with the CUDA build of torch is missing")
    base = Path(list(nvidia.nccl.__path__)[0])
    return base / "include", base / "lib"


def cuda_home():
    return os.environ.get("HOROVOD_CUDA_HOME") or os.environ.get("CUDA_HOME") or "/usr/local/cuda"


def check_gpu_toolchain():
    """Before downloading anything: a GPU build needs a full CUDA toolkit (nvcc and the runtime headers)."""
    home = cuda_home()
    if not (Path(home, "bin", "nvcc").is_file() and Path(home, "include", "cuda_runtime.h").is_file()):
        die(f"a GPU build needs a full CUDA toolkit (bin/nvcc and include/cuda_runtime.h); {home} lacks them. "
            "Set CUDA_HOME to the toolkit (the CUDA devel images have it), or build for the CPU with --cpu.")


def build_env(gpu, cxx_standard, work_dir):
    env = dict(os.environ)
    env.update({
        "HOROVOD_WITH_PYTORCH": "1",
        "HOROVOD_WITHOUT_TENSORFLOW": "1",
        "HOROVOD_WITHOUT_MXNET": "1",
        "HOROVOD_WITH_GLOO": "1",
        "HOROVOD_WITH_MPI": "1",
        # cmake 4 (PyPI) refuses gloo's `cmake_minimum_required(VERSION 2.8...)` unless told the oldest policy to use.
        "CMAKE_POLICY_VERSION_MINIMUM": "3.5",
        "MAKEFLAGS": f"-j{os.cpu_count() or 1}",
    })
    # The venv's cmake from PyPI, found before any older system cmake.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    if gpu:
        include, lib = nccl_dirs()
        # The pip package ships only libnccl.so.2; CMake's find_library looks for libnccl.so.
        link_dir = Path(work_dir) / "nccl-lib"
        link_dir.mkdir(exist_ok=True)
        versioned = sorted(lib.glob("libnccl.so*"))
        if not versioned:
            die(f"no libnccl.so* in {lib}")
        (link_dir / "libnccl.so").symlink_to(versioned[0])
        env.update({
            "HOROVOD_GPU_OPERATIONS": "NCCL",
            "HOROVOD_NCCL_LINK": "SHARED",
            "HOROVOD_NCCL_INCLUDE": str(include),
            "HOROVOD_NCCL_LIB": str(link_dir),
        })
        env.setdefault("HOROVOD_CUDA_HOME", cuda_home())
    else:
        env["HVD_TRAIN_TORCH_CPU_ONLY"] = "1"
        env.pop("HOROVOD_GPU_OPERATIONS", None)
    return env


# --------------------------------------------------------------------------------------------------------------------
# Cache


def cache_dir():
    base = os.environ.get("HVD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvd-train")
    return Path(base) / "horovod-wheels"


def build_key(info, gpu):
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    flags = "nccl" if gpu else "cpu"
    platform = sysconfig.get_platform()
    return f"horovod{HOROVOD_VERSION}-torch{info['torch']}-{py}-{platform}-{flags}-p{patch_fingerprint()}"


def installed_key():
    stamp = Path(sys.prefix) / STAMP_NAME
    return stamp.read_text().strip() if stamp.is_file() else None


def horovod_importable():
    probe = "import horovod.torch as hvd; hvd.mpi_built(); hvd.gloo_built()"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def run(cmd, **kw):
    log("  $ " + " ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kw)


def build_wheel(gpu, info, out_dir):
    with tempfile.TemporaryDirectory(prefix="hvd-train-build-") as tmp:
        tmp = Path(tmp)
        log(f"downloading the Horovod {HOROVOD_VERSION} sdist from PyPI")
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             f"horovod=={HOROVOD_VERSION}", "-d", str(tmp)])
        sdist = tmp / f"horovod-{HOROVOD_VERSION}.tar.gz"
        if not sdist.is_file():
            die(f"pip did not download {sdist.name}; is PyPI reachable?")
        with tarfile.open(sdist) as tar:
            # The "data" filter refuses links and paths outside tmp; older Pythons lack it.
            tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        src = tmp / f"horovod-{HOROVOD_VERSION}"
        log(f"patching for torch {info['torch']} (C++{info['cxx_standard']})")
        apply_patches(src, info["cxx_standard"])
        env = build_env(gpu, info["cxx_standard"], tmp)
        log(f"compiling Horovod ({'NCCL + ' if gpu else ''}MPI + Gloo, PyTorch only); "
            f"this takes about 6 minutes on 2 cores")
        try:
            run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
                 str(src)], env=env)
        except subprocess.CalledProcessError:
            die("compiling Horovod failed (the compiler's error is above). Common causes: OpenMPI headers missing "
                "(apt-get install libopenmpi-dev), an incomplete CUDA toolkit for --gpu.")
        wheels = list((tmp / "dist").glob("horovod-*.whl"))
        if len(wheels) != 1:
            die(f"expected one Horovod wheel, found {wheels}")
        out_dir.mkdir(parents=True, exist_ok=True)
        # Copy then rename, so a build killed halfway never leaves a partial wheel in the cache.
        partial = out_dir / (wheels[0].name + ".partial")
        shutil.copy2(wheels[0], partial)
        final = out_dir / wheels[0].name
        partial.rename(final)
        (out_dir / "build-info.json").write_text(json.dumps(dict(info, gpu=gpu), indent=2))
        return final


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="build NCCL GPU operations (needs a full CUDA toolkit)")
    parser.add_argument("--force", action="store_true", help="rebuild even when a cached wheel exists")
    parser.add_argument("--python", help="ignored: the python running this script is the one built for")
    parser.add_argument("--print-cache-dir", action="store_true", help="print where wheels are cached and exit")
    args = parser.parse_args()
    if args.print_cache_dir:
        print(cache_dir())
        return

    if args.gpu:
        check_gpu_toolchain()
    info = torch_info()
    key = build_key(info, args.gpu)
    log(f"torch {info['torch']} (CUDA {info['cuda']}), needs C++{info['cxx_standard']}; build key {key}")
    if not args.force and installed_key() == key and horovod_importable():
        log("Horovod is already installed from this build")
        return

    key_dir = cache_dir() / key
    cached = sorted(key_dir.glob("horovod-*.whl"))
    if cached and not args.force:
        wheel = cached[-1]
        log(f"using the cached wheel {wheel}")
    else:
        wheel = build_wheel(args.gpu, info, key_dir)
        log(f"cached {wheel}")
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)])
    (Path(sys.prefix) / STAMP_NAME).write_text(key + "\n")
    if not horovod_importable():
        die(f"Horovod was installed from {wheel} but `import horovod.torch` fails; remove {key_dir} and run again")
    log("Horovod installed")


if __name__ == "__main__":
    main()
