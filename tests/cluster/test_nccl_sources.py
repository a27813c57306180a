"""The NCCL build's own sources compile after the patch series, on any machine (no GPU needed): the cheap part of
`make test-builds` that make test runs.

Horovod's CMake configures the real NCCL build here (the build script's environment, the toolkit and NCCL it would
use, one GPU architecture), which also proves the patched CMake takes that configuration. Then the sources only a GPU
build compiles, the torch extension's GPU code and every patched source with a GPU-only part are compiled, with the
flags CMake gave the torch extension (one translation unit, -fsyntax-only, as its unity build would), and the CUDA
kernels with nvcc for real. A pass is remembered under the hvd-train cache, keyed by the patches, the build scripts,
the compilers and the headers, so a run with nothing changed takes seconds.
"""
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "horovod"
sys.path.insert(0, str(SCRIPTS))
import build_horovod  # noqa: E402
import patching  # noqa: E402
import toolkit  # noqa: E402

pytestmark = pytest.mark.timeout(1200)

# Compiled only in a GPU build (Horovod's CMakeLists.txt: add_cuda(), HAVE_NCCL, HAVE_NCCL AND HAVE_MPI), and the
# torch extension's sources with GPU-only parts (#if HAVE_GPU).
GPU_SOURCES = ("horovod/common/ops/cuda_operations.cc", "horovod/common/ops/gpu_operations.cc",
               "horovod/common/ops/mpi_gpu_operations.cc", "horovod/common/ops/nccl_operations.cc",
               "horovod/common/ops/adasum_gpu_operations.cc", "horovod/torch/ready_event.cc",
               "horovod/torch/cuda_util.cc", "horovod/torch/mpi_ops_v2.cc", "horovod/torch/adapter_v2.cc")
GPU_ONLY_PART = re.compile(rb"#\s*if.*\bHAVE_(GPU|CUDA|NCCL)\b")
KERNELS = "horovod/common/ops/cuda/cuda_kernels.cu"


def patched_sources():
    """The .cc files the series edits."""
    return {rel for path in patching.series_paths() for rel in patching.read_patch(path).files
            if rel.endswith(".cc")}


def fingerprint(info, kit, nccl_include):
    """What a pass depends on: the sources (patches, header), the build scripts and this check, the compilers, and
    the torch, CUDA, NCCL and MPI headers compiled against."""
    def output(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True).stdout
    parts = [patching.patch_fingerprint(), info["torch"], str(info["cxx_standard"]), build_horovod.mpi_identity(),
             output(os.environ.get("CXX") or "c++", "--version"), str(kit),
             output(str(kit.root / "bin" / "nvcc"), "--version")]
    files = [*sorted(SCRIPTS.glob("*.py")), Path(__file__), nccl_include / "nccl.h",
             kit.root / "include" / "cuda_runtime_api.h"]
    digest = hashlib.sha256("\0".join(parts).encode())
    for path in files:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def errors(output, limit=30):
    """The errors in a compiler's or CMake's output, each with the two lines after it (the code, the caret), its
    warnings left out; else its last lines."""
    lines = output.splitlines()
    at = [i for i, line in enumerate(lines) if re.search(r"\berror\b|Error", line)]
    wanted = [lines[j] for j in sorted({j for i in at for j in range(i, min(i + 3, len(lines)))})]
    return "\n".join(wanted[:limit] if wanted else lines[-limit:])


def configure(src, work, info, kit, arch):
    """Horovod's CMake, as setup.py runs it, for the NCCL build; returns CMake's compile commands."""
    plan = build_horovod.BuildPlan(gpu=True, mpi=True, toolkit=kit, archs=(arch,))
    env = build_horovod.build_env(plan, work, info["cxx_standard"])
    build = work / "build"
    build.mkdir()
    cmake = shutil.which("cmake", path=build_horovod.build_path())
    proc = subprocess.run([cmake, str(src), "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
                           f"-DPYTHON_EXECUTABLE:FILEPATH={sys.executable}",
                           f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY_RELEASE={build / 'lib'}"],
                          cwd=build, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        pytest.fail(f"CMake refused the NCCL build's configuration:\n{errors(proc.stdout + proc.stderr)}", False)
    return json.loads((build / "compile_commands.json").read_text())


def compile_extension(src, work, commands, sources):
    """The sources, as one unit, with the torch extension's flags (its unity files share them); checks each is one
    the NCCL build compiles."""
    units = [entry for entry in commands if "/pytorch.dir/" in entry["file"]]
    compiled = "".join(Path(entry["file"]).read_text() for entry in units)  # `#include "horovod/..."` lines
    missing = [rel for rel in sources if f'"{rel}"' not in compiled]
    assert units and not missing, f"the NCCL build no longer compiles {missing}: update GPU_SOURCES"
    unit = work / "nccl_sources.cc"
    unit.write_text("".join(f'#include "{src / rel}"\n' for rel in sources))
    args = shlex.split(units[0]["command"])
    for flag in ("-o", "-c"):  # the unity file's object and source
        at = args.index(flag)
        del args[at:at + 2]
    return subprocess.run(args + ["-fsyntax-only", str(unit)], cwd=units[0]["directory"], capture_output=True,
                          text=True, timeout=900)


def compile_kernels(work, commands):
    entry = next(e for e in commands if e["file"].endswith(KERNELS) and "/horovod_cuda_kernels.dir/" in e["command"])
    args = shlex.split(entry["command"])
    args[args.index("-o") + 1] = str(work / "cuda_kernels.o")
    return subprocess.run(args, cwd=entry["directory"], capture_output=True, text=True, timeout=900)


def test_the_nccl_builds_sources_compile_after_the_patches(tmp_path):
    started = time.monotonic()
    info = build_horovod.torch_info()
    # The toolkit a GPU build would take (scripts/install.sh --test-tools installs PyPI's where there is none).
    kit = toolkit.find_toolkit(info["cuda"], offline=True)
    nccl_include, _lib = build_horovod.nccl_dirs()
    stamp = build_horovod.cache_root() / "nccl-sources-check" / fingerprint(info, kit, nccl_include)
    if stamp.is_file():
        return  # this very check passed with these patches, scripts, compilers and headers
    arch = min(toolkit.choose_architectures(toolkit.nvcc_architectures(kit.root / "bin" / "nvcc"))[0])
    src = build_horovod.extract_sdist(build_horovod.obtain_sdist(None, offline=False), tmp_path)
    patching.apply_series(src)
    sources = sorted(set(GPU_SOURCES) | {rel for rel in patched_sources()
                                         if GPU_ONLY_PART.search((src / rel).read_bytes())})
    commands = configure(src, tmp_path, info, kit, arch)
    with ThreadPoolExecutor(2) as pool:  # the two compilers side by side, one a core
        extension = pool.submit(compile_extension, src, tmp_path, commands, sources)
        kernels = pool.submit(compile_kernels, tmp_path, commands)
        extension, kernels = extension.result(), kernels.result()
    if extension.returncode:
        pytest.fail(f"the NCCL build's sources do not compile after the patches ({', '.join(sources)}):\n"
                    f"{errors(extension.stderr)}", False)
    if kernels.returncode:
        pytest.fail(f"{KERNELS} does not compile for sm_{arch}:\n{errors(kernels.stderr)}", False)
    assert (tmp_path / "cuda_kernels.o").stat().st_size > 0
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps({"sources": sources + [KERNELS], "arch": arch, "toolkit": str(kit.root),
                                 "seconds": round(time.monotonic() - started)}) + "\n")
