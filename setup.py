"""Builds the torch extension `exl_core._C`.

CPU sources (csrc/*.cpp, csrc/cpu/*.cpp) are always built. CUDA sources (csrc/cuda/*.cu)
are added when the installed torch has CUDA and nvcc is present; set EXL_CORE_NO_CUDA=1 to
skip them. Torch is deliberately not a build-system requirement (an isolated build would
pull a multi-GB CUDA wheel): install with `pip install -e . --no-build-isolation`.
"""
import glob
import os
import shutil
import subprocess
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME
except ImportError as e:  # pragma: no cover - guidance for users
    raise SystemExit("exl_core needs torch installed before building: pip install torch, then "
                     "pip install -e . --no-build-isolation") from e

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("exl_core", "csrc")


def _sources(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, CSRC, pattern)))


def _shared_libstdcxx():
    """The shared C++ runtime (libstdc++.so.6), named by its path on the link line (Linux). On the H200 image the
    extension came out with libstdc++ linked in statically (ldd listed no libstdc++.so.6 for it, and libstdc++'s
    stream code ran from inside it; why that toolchain did so was not found): a private copy that died with SIGSEGV
    formatting the first failing TORCH_CHECK's message instead of raising (bench/throw_probe.py, stop 43). Named
    before the compiler's own -lstdc++, the shared runtime supplies every symbol and the archive adds nothing."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        found = subprocess.run([os.environ.get("CXX", "c++"), "-print-file-name=libstdc++.so.6"],
                               capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    return [found] if os.path.isabs(found) and os.path.exists(found) else []


def _want_cuda():
    if os.environ.get("EXL_CORE_NO_CUDA") == "1":
        return False
    has_nvcc = CUDA_HOME is not None and (shutil.which("nvcc") is not None or
                                          os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")))
    return torch.version.cuda is not None and has_nvcc


def _extension():
    cpp = _sources("*.cpp") + _sources("cpu/*.cpp")
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-DEXL_CORE_CPU"]
    # Kernels pick AVX2/AVX-512 paths at run time via __attribute__((target(...))), so the
    # baseline build stays portable to any x86-64 CPU.
    link = ["-fopenmp"] + _shared_libstdcxx()
    if _want_cuda():
        cu = _sources("cuda/*.cu")
        cuda = tuple(int(p) for p in torch.version.cuda.split(".")[:2])
        if cuda < (12, 5):      # qgemm_wg_decode's tensor maps: cudaGetDriverEntryPointByVersion (CUDA 12.5)
            cu = [c for c in cu if not c.endswith("qgemm_wg_decode_cuda.cu")]
        # 90a (CUDA 12.0+): sm_90 with its arch-specific instructions (wgmma: qgemm_wg_decode); the other kernels
        # compile to the same SASS as for 90 (qgemm_kslice_cuda.cu compared, stop 57)
        archs = os.environ.get("EXL_CORE_CUDA_ARCHS", "80;90a" if cuda >= (12, 0) else "80;90").split(";")
        gencode = []
        for a in archs:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        nvcc = ["-O3", "-std=c++20", "--use_fast_math", "-lineinfo", "-DEXL_CORE_CUDA"] + gencode
        return CUDAExtension("exl_core._C", cpp + cu,
                             extra_compile_args={"cxx": cxx + ["-DEXL_CORE_CUDA"], "nvcc": nvcc},
                             extra_link_args=link)
    return CppExtension("exl_core._C", cpp, extra_compile_args={"cxx": cxx}, extra_link_args=link)


setup(ext_modules=[_extension()],
      cmdclass={"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)})
