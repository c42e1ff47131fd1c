"""Why a failing TORCH_CHECK kills the process on the H200 image (bench/gpu.sh phase `throwprobe`).

On that image a TORCH_CHECK failing inside an op of exl_core._C (CPU ops too) ends the process with SIGSEGV instead
of raising, while libtorch's own checks raise (stop 42 call 3). The image has no gdb, so each crashing case runs
again with bench/segv_trace.c preloaded, which prints the native stack as module+offset; addr2line names the
functions. Minimal extensions built here with torch's load_inline (C++ only, with exl_core's flags, with CUDA) show
whether any extension built on the image crashes the same way, and the toolchain lines show what each side uses.

    PYTHONPATH=. python bench/throw_probe.py
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

CASES = {
    "torch mm on cuda (libtorch's check)":
        "torch.mm(torch.zeros(2, 3, device='cuda'), torch.zeros(4, 5, device='cuda'))",
    "exl_core CPU op (qmatmul, bad groups)": "torch.ops.exl_core.qmatmul(torch.zeros(2, 64), torch.zeros(8, 4, "
    "dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32), torch.ones(1, 4), torch.zeros(1, 4), None, None)",
    "exl_core CUDA op (l2-free qdequant_mm, slice 0)": "torch.ops.exl_core.qdequant_mm(torch.zeros(2, 32, "
    "device='cuda', dtype=torch.half), torch.zeros(4, 8, dtype=torch.int32, device='cuda'), torch.tensor([[4, 0, 0]], "
    "dtype=torch.int32, device='cuda'), torch.ones(1, 8, device='cuda'), torch.zeros(1, 8, device='cuda'), None, None, "
    "None, None, 0)",
}

# A minimal op whose check fails: registered like exl_core's (TORCH_LIBRARY + TORCH_LIBRARY_IMPL), called the same way.
MINI_CPP = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor boom(const at::Tensor& x) { TORCH_CHECK(x.dim() == 5, "boom: x must have 5 dims, got ", x.dim()); return x; }
TORCH_LIBRARY(NAME, m) { m.def("boom(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(NAME, CPU, m) { m.impl("boom", &boom); }
"""
MINI_CU = r"""
__global__ void nothing(float* p) { if (p) p[threadIdx.x] = 0.f; }
void launch_nothing() { nothing<<<1, 1>>>(nullptr); }
"""
MINI_VARIANTS = {  # name: (extra C++ flags, extra link flags, with CUDA)
    "mini_plain": ([], [], False),
    "mini_exlflags": (["-O3", "-std=c++20", "-fopenmp"], ["-fopenmp"], False),
    "mini_cuda": (["-O3", "-std=c++20"], [], True),
    "mini_shared_runtime": ([], ["LIBSTDCXX"], False),     # setup.py's fix: libstdc++.so.6 named by its path
}


def run(cmd: list[str], env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def child(expr: str, imports: str = "import torch, exl_core.ops.cuda_candidates") -> str:
    return f"{imports}\ntry:\n    {expr}\nexcept RuntimeError as e:\n" \
           f"    print('raised:', str(e).splitlines()[0][:160])\n"


def symbolise(stderr: str) -> str:
    """segv_trace's module+offset frames with addr2line's function and line where the module has them."""
    out = []
    for line in stderr.splitlines():
        m = re.match(r"segv_trace #(\d+) (\S+)\+0x([0-9a-f]+) (\S+)", line)
        if not m:
            if line.startswith("segv_trace"):
                out.append(line)
            continue
        i, mod, off, sym = int(m[1]), m[2], int(m[3], 16), m[4]
        where = sym
        if shutil.which("addr2line") and sym == "?":
            r = run(["addr2line", "-f", "-C", "-e", mod, hex(off - 1 if i > 1 else off)], timeout=60)
            where = " @ ".join(r.stdout.split("\n")[:2]).strip()[:200]
        out.append(f"#{i} {os.path.basename(mod)}+{hex(off)} {where}")
    return "\n".join(out)


def toolchain() -> None:
    import torch
    print("g++:", (run(["g++", "--version"]).stdout.splitlines() or ["none"])[0], "; libstdc++.so / .so.6 / .a:",
          [run(["g++", f"-print-file-name={f}"]).stdout.strip() for f in ("libstdc++.so", "libstdc++.so.6",
                                                                          "libstdc++.a")])
    print("torch built with:", [ln.strip() for ln in torch.__config__.show().splitlines() if "GCC" in ln or
                                "CXX_COMPILER" in ln or "CXX11_ABI" in ln][:4])
    print("torch cxx11 abi:", torch._C._GLIBCXX_USE_CXX11_ABI, "; TORCH_* set:",
          {k: v for k, v in os.environ.items() if k.startswith("TORCH_")})
    import exl_core
    pkg = os.path.dirname(exl_core.__file__)
    so = next((os.path.join(pkg, f) for f in os.listdir(pkg) if f.startswith("_C") and f.endswith(".so")), None)
    if so and shutil.which("readelf"):
        print("NEEDED by _C:", re.findall(r"\[(.+?)\]", run(["readelf", "-d", so]).stdout))
    if so and shutil.which("nm"):
        own = [ln for ln in run(["nm", "-C", "--defined-only", so]).stdout.splitlines()
               if "std::ostream::_M_insert" in ln]
        print("std::ostream::_M_insert defined in _C (a static libstdc++ copy):", len(own))
    if so and shutil.which("ldd"):
        print("ldd _C:", [ln.strip() for ln in run(["ldd", so]).stdout.splitlines()
                          if re.search(r"stdc\+\+|gcc_s|gomp|c10|torch_cpu|cudart", ln)])
    maps = run([sys.executable, "-c", "import torch, exl_core._C; print(open('/proc/self/maps').read())"]).stdout
    print("loaded in one process:", sorted({os.path.basename(p) for p in re.findall(r"(/\S+\.so[.\d]*)", maps)
                                            if re.search(r"stdc\+\+|gcc_s|gomp", p)}))


def mini_extensions(tracer: str | None) -> None:
    """Builds the MINI_VARIANTS side by side (load_inline, a process each), then calls each one's failing op."""
    build_root = tempfile.mkdtemp(prefix="throwmini_")
    builds = {}
    runtime = run(["g++", "-print-file-name=libstdc++.so.6"]).stdout.strip()
    for name, (cflags, ldflags, cuda) in MINI_VARIANTS.items():
        ldflags = [runtime if f == "LIBSTDCXX" else f for f in ldflags]
        code = (f"import torch, os\nfrom torch.utils.cpp_extension import load_inline\n"
                f"d = os.path.join({build_root!r}, {name!r}); os.makedirs(d, exist_ok=True)\n"
                f"load_inline({name!r}, cpp_sources=[{MINI_CPP.replace('NAME', name)!r}"
                + (" + 'void launch_nothing();'" if cuda else "") + "], "
                + (f"cuda_sources=[{MINI_CU!r}], " if cuda else "")
                + f"extra_cflags={cflags!r}, extra_ldflags={ldflags!r}, build_directory=d, is_python_module=False, "
                f"verbose=False)\n")
        builds[name] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
    for name, proc in builds.items():
        _, err = proc.communicate(timeout=400)
        if proc.returncode != 0:
            print(f"{name}: build failed rc {proc.returncode}: {err.strip()[-400:]}")
            continue
        so = os.path.join(build_root, name, f"{name}.so")
        case = child(f"torch.ops.{name}.boom(torch.zeros(2))", f"import torch\ntorch.ops.load_library({so!r})")
        r = run([sys.executable, "-c", case])
        print(f"{name}: rc {r.returncode}; {r.stdout.strip()[:160]} {r.stderr.strip()[-200:]}")
        if r.returncode != 0 and tracer:
            r = run([sys.executable, "-c", case], env={**os.environ, "LD_PRELOAD": tracer})
            print(symbolise(r.stderr))


def main() -> None:
    toolchain()
    tracer = None
    if shutil.which("gcc"):
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "segv_trace.c")
        r = run(["gcc", "-shared", "-fPIC", "-O1", "-o", "/tmp/segv_trace.so", src])
        tracer = "/tmp/segv_trace.so" if r.returncode == 0 else None
        print("segv_trace:", "built" if tracer else r.stderr[-300:])
    for name, expr in CASES.items():
        for extra in ({}, {"TORCH_SHOW_CPP_STACKTRACES": "1"}, {"TORCH_SHOW_CPP_STACKTRACES": "0"}):
            r = run([sys.executable, "-c", child(expr)], env={**os.environ, **extra})
            print(f"{name} {extra or ''}: rc {r.returncode}; {r.stdout.strip()[:200]} {r.stderr.strip()[-300:]}")
        if r.returncode != 0 and tracer:
            r = run([sys.executable, "-c", child(expr)], env={**os.environ, "LD_PRELOAD": tracer})
            print(symbolise(r.stderr))
    mini_extensions(tracer)


if __name__ == "__main__":
    main()
