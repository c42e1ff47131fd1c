"""The host-side rule of qgemm_wg_decode (ops/cuda_wg_decode.py layout_ok): which weights the stream-K wgmma
kernel may take -- uniform 4-bit words in K order, groups of 64 rows or more starting at multiples of 64 (a 64-row
tile reads one scale / zero pair), K % 64 == 0, N % 8 == 0, no permutation, no bias.  Pure host logic: runs on the
CPU."""
from __future__ import annotations

import pytest

from exl_core.ops.cuda_wg_decode import layout_ok
from test_cuda_kernels import random_packed


@pytest.mark.parametrize("layout,N,perm,bias,ok", [
    ([(4, 128)] * 4, 256, False, False, True),                   # GPTQ g128
    ([(4, 64), (4, 128), (4, 192)], 136, False, False, True),    # 64-row multiples, N a multiple of 8 only
    ([(4, 32)] * 8, 256, False, False, False),                   # 32-row groups: two scale pairs in a tile
    ([(4, 96), (4, 160)], 256, False, False, False),             # a group starting past a 64-row boundary
    ([(4, 128)] * 2 + [(4, 32)], 256, False, False, False),      # a trailing 32-row group (K 288)
    ([(5, 128), (4, 128)], 256, False, False, False),            # a 5-bit group: not uniform 4-bit
    ([(4, 128)] * 2, 132, False, False, False),                  # N % 8 != 0
    ([(4, 128)] * 2, 256, True, False, False),                   # act-order permutation (x would need a gather)
    ([(4, 128)] * 2, 256, False, True, False),                   # a bias (the kernel adds none)
])
def test_wg_layout_rule(layout, N, perm, bias, ok):
    assert layout_ok(random_packed(layout, N, perm=perm, bias=bias, seed=1)) is ok


@pytest.mark.parametrize("setting,on", [("1", {"multi", "single", "pair"}), ("0", set()), ("pair", {"pair"}),
                                        ("multi,single", {"multi", "single"})])
def test_wg_kinds(setting, on, monkeypatch):
    """EXL_CORE_WG_DECODE: "1" every kind of launch, "0" none, else the kinds it lists."""
    from exl_core.ops import cuda_wg_decode as wg
    monkeypatch.setattr(wg, "WG_DECODE", setting)
    assert {k for k in wg.KINDS if wg.kind_on(k)} == on


def test_wg_finish_setting():
    """EXL_CORE_WG_FINISH picks the split tiles' finish; an unknown value is an error that names the variable."""
    from exl_core.ops.cuda_wg_decode import FINISHES, finish_setting
    assert finish_setting({}) == FINISHES["ordered"]
    assert finish_setting({"EXL_CORE_WG_FINISH": "atomic"}) == FINISHES["atomic"]
    with pytest.raises(ValueError, match="expected one of atomic, ordered"):       # a removed finish (stop 61)
        finish_setting({"EXL_CORE_WG_FINISH": "ordered_smem"})
    with pytest.raises(ValueError, match="EXL_CORE_WG_FINISH='fast'"):
        finish_setting({"EXL_CORE_WG_FINISH": "fast"})
    with pytest.raises(ValueError, match="EXL_CORE_WG_FINISH=atomic"):               # the old name, not ignored
        finish_setting({"EXL_CORE_WG_EXACT": "0"})
