"""Builds the torch extension `exl_core._C`.

CPU sources (csrc/*.cpp, csrc/cpu/*.cpp) are always built. CUDA sources (csrc/cuda/*.cu)
are added when the installed torch has CUDA and nvcc is present; set EXL_CORE_NO_CUDA=1 to
skip them. Torch is deliberately not a build-system requirement (an isolated build would
pull a multi-GB CUDA wheel): install with `pip install -e . --no-build-isolation`.
"""
import glob
import os
import shutil

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
    link = ["-fopenmp"]
    if _want_cuda():
        cu = _sources("cuda/*.cu")
        archs = os.environ.get("EXL_CORE_CUDA_ARCHS", "80;90").split(";")
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
