"""The CUDA toolkit of a GPU build, and the GPU architectures it compiles for.

A complete toolkit is used where there is one (CUDA_HOME or HOROVOD_CUDA_HOME, else /usr/local/cuda or the nvcc on
PATH); otherwise the same toolchain comes from PyPI as wheels of torch's CUDA version, installed into the cache.
"""
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from buildutil import cache_root, die, log, run

# GPU generations compiled for by default: Volta to Hopper, and Blackwell, kept where the toolkit's nvcc still
# builds for them (CUDA 13 dropped Volta; CUDA 12.8 added Blackwell). Each gets native code; the newest also PTX,
# which the driver compiles for GPUs newer than all of these. HOROVOD_BUILD_CUDA_CC_LIST overrides the list.
GPU_GENERATIONS = {70: "Volta (V100)", 75: "Turing (T4)", 80: "Ampere (A100)", 86: "Ampere (A10, RTX 30)",
                   89: "Ada (L4, L40, RTX 40)", 90: "Hopper (H100, H200)", 100: "Blackwell (B200)",
                   120: "Blackwell (RTX 50, RTX PRO)"}
# The PyPI wheels that make up a toolkit, pinned to torch's CUDA release (major.minor).
# cuobjdump lets the tests see which architectures the built library holds.
TOOLKIT_WHEELS = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-cuda-cccl", "nvidia-cuda-runtime", "nvidia-nvvm",
                  "nvidia-cuda-cuobjdump")


@dataclass(frozen=True)
class Toolkit:
    root: Path          # CUDA_HOME for the build: bin/nvcc, include/cuda_runtime.h, lib64 or lib with libcudart
    version: str        # nvcc's release, e.g. "13.2"
    source: str         # "system" or "pypi", for the log and the cache key


def toolkit_missing(root):
    """What a build needs that `root` lacks (empty when it is a complete toolkit)."""
    root = Path(root)
    missing = [rel for rel in ("bin/nvcc", "include/cuda_runtime.h") if not (root / rel).is_file()]
    if not any((root / d / "libcudart.so").exists() or (root / d / "libcudart_static.a").exists()
               for d in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib")):
        missing.append("lib64/libcudart.so")
    return missing


def nvcc_release(nvcc):
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+\.\d+)", out)
    if not found:
        die(f"{nvcc} --version did not say its release:\n{out}")
    return found.group(1)


def same_major(a, b):
    return a.split(".")[0] == b.split(".")[0]


def system_toolkit(torch_cuda):
    """A complete system toolkit of torch's CUDA major version, or None; says why each candidate was passed over.

    An explicit CUDA_HOME / HOROVOD_CUDA_HOME is the user's choice: when it is incomplete or of another CUDA major
    version than torch, the build stops instead of quietly using something else.
    """
    explicit = os.environ.get("HOROVOD_CUDA_HOME") or os.environ.get("CUDA_HOME")
    if explicit:
        missing = toolkit_missing(explicit)
        if missing:
            die(f"CUDA_HOME={explicit} is not a complete CUDA toolkit: it lacks {', '.join(missing)}. Point CUDA_HOME "
                "at a full toolkit, or unset it and the build uses CUDA's compiler and headers from PyPI.")
        version = nvcc_release(Path(explicit) / "bin" / "nvcc")
        if not same_major(version, torch_cuda):
            die(f"CUDA_HOME={explicit} is CUDA {version}, but torch was built with CUDA {torch_cuda}: Horovod must "
                f"use torch's CUDA major version. Point CUDA_HOME at a CUDA {torch_cuda.split('.')[0]} toolkit, or "
                "unset it and the build uses the matching toolchain from PyPI.")
        log(f"CUDA toolkit: {explicit} (CUDA {version}), from CUDA_HOME")
        return Toolkit(Path(explicit), version, "system")
    candidates = ["/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for root in dict.fromkeys(candidates):
        if not Path(root).exists():
            continue
        missing = toolkit_missing(root)
        if missing:
            log(f"CUDA toolkit: {root} passed over, it is incomplete (no {', '.join(missing)})")
            continue
        version = nvcc_release(Path(root) / "bin" / "nvcc")
        if not same_major(version, torch_cuda):
            log(f"CUDA toolkit: {root} passed over, it is CUDA {version} and torch was built with CUDA {torch_cuda}")
            continue
        log(f"CUDA toolkit: {root} (CUDA {version}), a complete system toolkit")
        return Toolkit(Path(root), version, "system")
    return None


def pypi_toolkit_dir(torch_cuda):
    return cache_root() / "cuda-toolkits" / f"cuda-{torch_cuda}"


def pypi_toolkit(torch_cuda, offline, why):
    """CUDA's compiler, headers and runtime from PyPI's wheels of torch's CUDA release, installed into the cache.

    From CUDA 13 on, NVIDIA's wheels share one prefix (nvidia/cu13: bin, include, lib, nvvm), which is a toolkit
    root once libcudart.so, the name CMake looks for, points at the versioned library.
    """
    major = torch_cuda.split(".")[0]
    if int(major) < 13:
        die(f"torch was built with CUDA {torch_cuda} and no complete CUDA {major} toolkit was found. PyPI's CUDA "
            f"{major} wheels do not form a toolkit: install the CUDA {major} toolkit and set CUDA_HOME to it.")
    target = pypi_toolkit_dir(torch_cuda)
    root = target / "nvidia" / f"cu{major}"
    wanted = [f"{name}=={torch_cuda}.*" for name in TOOLKIT_WHEELS]
    stamp = target / ".complete"
    if not stamp.is_file() or stamp.read_text().split() != wanted:
        if offline:
            die(f"offline, and no complete CUDA {major} toolkit: set CUDA_HOME to one, or run this once with network "
                f"access so PyPI's toolchain for CUDA {torch_cuda} is cached in {target}")
        log(f"CUDA toolkit: installing CUDA {torch_cuda}'s compiler and headers from PyPI into {target}")
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial)] + wanted)
        (partial / "nvidia" / f"cu{major}" / "lib" / "libcudart.so").symlink_to(f"libcudart.so.{major}")
        (partial / ".complete").write_text(" ".join(wanted) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    missing = toolkit_missing(root)
    if missing:
        die(f"PyPI's CUDA toolchain in {target} lacks {', '.join(missing)}; remove {target} and run this again")
    version = nvcc_release(root / "bin" / "nvcc")
    log(f"CUDA toolkit: {root} (CUDA {version}), PyPI's wheels, {why}")
    return Toolkit(root, version, "pypi")


def find_toolkit(torch_cuda, offline, choice="auto"):
    """The toolkit for a GPU build: `choice` is auto (a complete system toolkit, else PyPI's), system or pypi."""
    if not torch_cuda:
        die("a GPU build needs a CUDA build of torch, and this torch is CPU-only (torch.version.cuda is None). "
            "Build for the CPU (--cpu), or install a CUDA build of torch.")
    if choice == "pypi":
        return pypi_toolkit(torch_cuda, offline, "as asked (--cuda-toolkit pypi)")
    found = system_toolkit(torch_cuda)
    if found is None and choice == "system":
        die(f"--cuda-toolkit system: no complete CUDA {torch_cuda.split('.')[0]} toolkit was found (see above); set "
            "CUDA_HOME to one, or use --cuda-toolkit auto to fall back on PyPI's")
    return found or pypi_toolkit(torch_cuda, offline, "since no complete system toolkit was found")


def nvcc_architectures(nvcc):
    """The compute capabilities this nvcc builds for, from `nvcc --list-gpu-arch` (compute_75 ... compute_121)."""
    out = subprocess.run([str(nvcc), "--list-gpu-arch"], capture_output=True, text=True).stdout
    return sorted({int(n) for n in re.findall(r"compute_(\d+)", out)})


def choose_architectures(supported, override=None):
    """The compute capabilities to build (sorted) and a note on what was left out and why."""
    if override:
        try:
            wanted = sorted({int(x.strip().replace(".", "")) for x in override.split(",") if x.strip()})
        except ValueError:
            die(f"HOROVOD_BUILD_CUDA_CC_LIST={override!r}: give compute capabilities separated by commas, "
                "e.g. 80,90")
        unsupported = [cc for cc in wanted if cc not in supported]
        if not wanted or unsupported:
            die(f"HOROVOD_BUILD_CUDA_CC_LIST={override!r}: this nvcc does not build for {unsupported or 'nothing'}; "
                f"it builds for {', '.join(map(str, supported))}")
        return wanted, "from HOROVOD_BUILD_CUDA_CC_LIST"
    chosen = [cc for cc in GPU_GENERATIONS if cc in supported]
    if not chosen:
        die(f"this nvcc builds for none of {sorted(GPU_GENERATIONS)} (it lists {supported}); set "
            "HOROVOD_BUILD_CUDA_CC_LIST")
    dropped = [f"sm_{cc} {GPU_GENERATIONS[cc]}" for cc in GPU_GENERATIONS if cc not in supported]
    note = f"not built: {', '.join(dropped)}, which this nvcc no longer or not yet supports" if dropped else ""
    return chosen, note
