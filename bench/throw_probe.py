"""Which failing TORCH_CHECK kills the process on this machine (bench/gpu.sh phase `throwprobe`).

On the H200 image a TORCH_CHECK failing inside a CUDA op of exl_core._C ends the process with SIGSEGV instead of
raising (tests/test_cuda_kernels.py::test_qgemm_mma_refuses_bad_input, xfail).  Each case runs in a child process:
a torch op's own check on CUDA, exl_core's CPU op, exl_core's CUDA op; then the CUDA op again under gdb (where the
image has it) for the native stack of the crash.

    PYTHONPATH=. python bench/throw_probe.py
"""
from __future__ import annotations

import shutil
import subprocess
import sys

CASES = {
    "torch mm on cuda (libtorch's check)": "torch.mm(torch.zeros(2, 3, device='cuda'), torch.zeros(4, 5, device='cuda'))",
    "exl_core CPU op (qmatmul, bad groups)": "torch.ops.exl_core.qmatmul(torch.zeros(2, 64), torch.zeros(8, 4, "
    "dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32), torch.ones(1, 4), torch.zeros(1, 4), None, None)",
    "exl_core CUDA op (l2-free qdequant_mm, slice 0)": "torch.ops.exl_core.qdequant_mm(torch.zeros(2, 32, "
    "device='cuda', dtype=torch.half), torch.zeros(4, 8, dtype=torch.int32, device='cuda'), torch.tensor([[4, 0, 0]], "
    "dtype=torch.int32, device='cuda'), torch.ones(1, 8, device='cuda'), torch.zeros(1, 8, device='cuda'), None, None, "
    "None, None, 0)",
}


def child(expr: str) -> str:
    return f"import torch, exl_core.ops.cuda_candidates\ntry:\n    {expr}\nexcept RuntimeError as e:\n" \
           f"    print('raised:', str(e).splitlines()[0][:160])\n"


def main() -> None:
    for name, expr in CASES.items():
        r = subprocess.run([sys.executable, "-c", child(expr)], capture_output=True, text=True)
        print(f"{name}: rc {r.returncode}; {r.stdout.strip()[:200]} {r.stderr.strip()[-300:]}")
    gdb = shutil.which("gdb")
    if gdb is None:
        print("no gdb on this image")
        return
    r = subprocess.run([gdb, "-batch", "-ex", "run", "-ex", "bt 40", "--args", sys.executable, "-c",
                        child(CASES["exl_core CUDA op (l2-free qdequant_mm, slice 0)"])],
                       capture_output=True, text=True, timeout=240)
    print("gdb:\n" + "\n".join(line[:220] for line in r.stdout.splitlines() if line.startswith(("#", "Thread", "Program"))))


if __name__ == "__main__":
    main()
