"""The Horovod build script's pure parts: reading torch's C++ standard, patching the sdist, the cache key."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import build_horovod  # noqa: E402


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


def fake_sdist(root):
    """The exact lines of Horovod 0.28.1 that the patches edit, in files of the same names."""
    write(root / "CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)\nset(CMAKE_CXX_STANDARD_REQUIRED ON)\n")
    write(root / "horovod/torch/CMakeLists.txt",
          'execute_process(COMMAND ${PY_EXE} -c "from distutils.sysconfig import get_python_inc; '
          'print(get_python_inc())"\n                OUTPUT_VARIABLE PYTHON_INCLUDE_PATH)\n'
          'if(NOT Pytorch_VERSION VERSION_LESS "1.5.0")\n    set(CMAKE_CXX_STANDARD 14)\nendif()\n')
    write(root / "cmake/Modules/FindPytorch.cmake", 'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)\n')


def test_patches_raise_the_standard_everywhere_and_let_cpu_builds_ignore_cuda_torch(tmp_path):
    fake_sdist(tmp_path)
    build_horovod.apply_patches(tmp_path, 20)
    top = (tmp_path / "CMakeLists.txt").read_text()
    torch_cmake = (tmp_path / "horovod/torch/CMakeLists.txt").read_text()
    find = (tmp_path / "cmake/Modules/FindPytorch.cmake").read_text()
    assert "CMAKE_CXX_STANDARD 20" in top and "CMAKE_CXX_STANDARD 14" not in top
    assert "CMAKE_CXX_STANDARD 20" in torch_cmake and "CMAKE_CXX_STANDARD 14" not in torch_cmake
    assert "distutils" not in torch_cmake and "sysconfig.get_paths()" in torch_cmake
    assert "HVD_TRAIN_TORCH_CPU_ONLY" in find and "set(Pytorch_CUDA FALSE)" in find


def test_a_source_tree_that_does_not_match_stops_instead_of_half_patching(tmp_path):
    fake_sdist(tmp_path)
    write(tmp_path / "CMakeLists.txt", "set(CMAKE_CXX_STANDARD 17)\n")
    with pytest.raises(SystemExit, match="cannot patch CMakeLists.txt"):
        build_horovod.apply_patches(tmp_path, 20)


def test_cache_key_separates_torch_versions_and_gpu_builds():
    cpu = build_horovod.build_key({"torch": "2.15.0"}, gpu=False)
    assert cpu != build_horovod.build_key({"torch": "2.15.0"}, gpu=True)
    assert cpu != build_horovod.build_key({"torch": "2.16.0"}, gpu=False)
    assert f"cp{sys.version_info.major}{sys.version_info.minor}" in cpu
    assert build_horovod.patch_fingerprint() in cpu


def test_cpu_build_environment_asks_for_pytorch_mpi_and_gloo_and_no_cuda(tmp_path):
    env = build_horovod.build_env(gpu=False, cxx_standard=20, work_dir=tmp_path)
    for var in ("HOROVOD_WITH_PYTORCH", "HOROVOD_WITH_MPI", "HOROVOD_WITH_GLOO", "HOROVOD_WITHOUT_TENSORFLOW",
                "HOROVOD_WITHOUT_MXNET", "HVD_TRAIN_TORCH_CPU_ONLY"):
        assert env[var] == "1", var
    assert env["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5"
    assert "HOROVOD_GPU_OPERATIONS" not in env
