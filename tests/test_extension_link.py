"""The built extension raises a failing TORCH_CHECK as a Python error and uses the process's one C++ runtime.

On the H200 image the extension came out with libstdc++ linked in statically (ldd listed no libstdc++.so.6 for it);
the private copy's stream code then died with SIGSEGV while formatting the first failing check's message
(bench/throw_probe.py, stop 43). setup.py now names the shared runtime on the link line.
"""
import shutil
import subprocess
import sys

import pytest

from exl_core.ops.dispatch import extension

_BAD_GROUPS = """
import torch, exl_core.ops.dispatch as d
d.extension()
try:
    torch.ops.exl_core.qmatmul(torch.zeros(2, 64), torch.zeros(8, 4, dtype=torch.int32),
                               torch.zeros(1, 3, dtype=torch.int32), torch.ones(1, 4), torch.zeros(1, 4), None, None)
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0])
"""


def _need_extension():
    if extension() is None:
        pytest.skip("extension not built")


def test_failing_check_raises_in_a_fresh_process():
    """A CPU op's failing check (a [1, 3] groups table) reaches Python as RuntimeError naming the op and the problem;
    in a child process, so that the crash this guards against fails this test only."""
    _need_extension()
    r = subprocess.run([sys.executable, "-c", _BAD_GROUPS], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-800:])
    assert "raised: exl_core::qmatmul: groups must be" in r.stdout and "[1, 3]" in r.stdout, r.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("readelf") is None,
                    reason="reads the ELF dynamic section (Linux, binutils)")
def test_extension_links_the_shared_cpp_runtime():
    _need_extension()
    r = subprocess.run(["readelf", "-d", extension().__file__], capture_output=True, text=True, timeout=60)
    needed = [line.split("[", 1)[1].rstrip("]") for line in r.stdout.splitlines() if "(NEEDED)" in line]
    assert "libstdc++.so.6" in needed, needed
