"""Which batch-decode launches qgemm_wg_decode takes (csrc/cuda/qgemm_wg_decode_cuda.cu: wgmma, stream-K, sm_90),
split from cuda_candidates.py, which routes to it (its _route / _many_run).

On by default since stop 58 (GPTQ 7B shapes at 32 rows, figures truncated; timelines: bench/decode_timeline.py, adds a
layer, medians over layers 2-31, us):
- stop 57's probe: q/k/v 20.32 against qgemm_wide's 23.62, 11008x4096 18.78 against 25.35 (bench/wgmma_probe.cu).
- stop 58 call 2 (the atomics' finish, o on it): down 18.87 against qgemm_kslice's 22.09, q/k/v 20.95 against
  qgemm_wide's 21.47, o (4096 x 4096) 11.55 against qgemm_kslice's 10.01 -- so a launch takes it only from MIN_ELEMS
  weight elements and o stays on qgemm_kslice.
- call 3: SwiGLU's gate/up pair on it (qgemm_wg_swiglu) 36.07 against qgemm_wide_swiglu's 30.52, so kind "pair" is
  off by default.
- call 4, same process, untraced steps: the exact finish (default) 3,860.09, the atomics' 3,785.53, off 3,892.77 (EXL2
  4,126.38 / 4,040.19 / 4,185.57); down 21.34 / 18.94 / 22.11 -- the exact finish reads a split tile's slots one block
  at a time, and down's 172 k-tiles span 5-6 blocks (41.6 items a block). bench --quick: batch 32 GPTQ 8,278.01
  against 8,229.19 off, EXL2 7,716.56 against 7,628.64.
EXL_CORE_WG_DECODE: "multi,single" (default), else a comma list of "multi" (q/k/v-style launches), "single" (one
weight), "pair" (SwiGLU's gate/up, ops/cuda_swiglu.py); "1": every kind; "0": off.
EXL_CORE_WG_FINISH: how a column tile split across blocks is added up -- "ordered" (default: in block order, the same
bits every run), "atomic" (fp32 atomics: faster, above, but the bits may differ from run to run; stop 58 ran it as
EXL_CORE_WG_EXACT=0, a name now refused with a message). Deterministic finishes that did not beat "ordered" were
removed (NOTES.md stops 59-61): the slots copied into shared memory a few at once (stop 61 call 2, bench --quick batch
32 against ordered, GPTQ / EXL2: 0.9901x-0.9903x / 0.9915x-0.9921x) and the tails' slots through the idle stages (stop
61 call 1: 1.0005x-1.0020x / 0.9977x-0.9992x).
"""
from __future__ import annotations

import functools
import os

import torch

from .cuda_dequant import uniform4
from .dispatch import has_cuda_kernel

WG_DECODE = os.environ.get("EXL_CORE_WG_DECODE", "multi,single")
FINISHES = {"atomic": 0, "ordered": 1}      # csrc qgemm_wg_streamk_kernel.cuh Finish


def finish_setting(env=os.environ) -> int:
    """The split tiles' finish the environment asks for (module docstring)."""
    if "EXL_CORE_WG_EXACT" in env:                       # stop 58's name: refused, not silently ignored
        raise ValueError("EXL_CORE_WG_EXACT is no longer read: set EXL_CORE_WG_FINISH=atomic (was EXL_CORE_WG_EXACT=0) "
                         "or leave it unset (ordered, was EXL_CORE_WG_EXACT=1)")
    v = env.get("EXL_CORE_WG_FINISH", "ordered")
    if v not in FINISHES:
        raise ValueError(f"EXL_CORE_WG_FINISH={v!r}: expected one of {', '.join(FINISHES)}")
    return FINISHES[v]


FINISH = finish_setting()
KINDS = ("multi", "single", "pair")
MIN_ROWS, MAX_ROWS = 17, 32
MIN_ELEMS = 1 << 25         # K x N summed over a launch's weights: a 7B's q/k/v 50.3 M and down 45.0 M, not o's 16.7 M
MAX_TILES = 1024            # column tiles of 128 a launch its workspace covers (qgemm_wg_decode_cuda.cu kMaxTiles)
_READY: set = set()         # (device, pair, finish) the op has run with: the workspace it needs exists, so graph
                            # captures may use it (qgemm_wg_decode_cuda.cu allocates each part on first need)
_CC_MAJOR: dict = {}


def layout_ok(pw) -> bool:
    """Uniform 4-bit words in K order whose groups are 64 rows or more, each starting at a multiple of 64 (the
    kernel reads one scale / zero pair a 64-row tile; so K is a multiple of 64), N a multiple of 8, no permutation
    or bias."""
    cached = pw.meta.get("_cuda_wg_layout")
    if cached is None:
        g = pw.groups.cpu().long()
        pw.meta["_cuda_groups_key"] = tuple(map(tuple, g.tolist()))      # one launch takes one group layout
        cached = pw.meta["_cuda_wg_layout"] = bool(
            uniform4(pw) and g.shape[0] > 0 and (g[:, 1] % 64 == 0).all() and (g[:, 2] % 64 == 0).all()
            and pw.k_rows // 32 <= 512 and pw.out_features % 8 == 0)
    return cached and pw.perm is None and pw.bias is None and pw.in_features == pw.k_rows and pw.qweight.dim() == 2


def has_swiglu() -> bool:
    return has_cuda_kernel("qgemm_wg_swiglu")


def _cc_major(idx: int) -> int:
    if idx not in _CC_MAJOR:
        _CC_MAJOR[idx] = torch.cuda.get_device_capability(idx)[0]
    return _CC_MAJOR[idx]


@functools.lru_cache(maxsize=8)
def _kinds(setting: str) -> frozenset:
    return frozenset(KINDS) if setting == "1" else frozenset(k.strip() for k in setting.split(","))


def kind_on(kind: str) -> bool:
    """WG_DECODE turns this kind of launch (one of KINDS) on."""
    return kind in _kinds(WG_DECODE)


def wg_ok(rows: int, pws, device, kind: str) -> bool:
    """The op for these fp16 rows (the caller checks the dtype and the weights' 16-byte alignment): WG_DECODE on for
    this kind of launch, 17..32 rows, an sm_90 device, 1..3 weights of one shape and group layout (layout_ok) within
    MAX_TILES and of MIN_ELEMS elements or more; its first call on a device for this kind's workspace (the pair's
    buffers, the atomics' sums) not inside a graph capture (it allocates them then)."""
    if not MIN_ROWS <= rows <= MAX_ROWS or not kind_on(kind):
        return False
    if not (1 <= len(pws) <= 3 and has_cuda_kernel("qgemm_wg_decode")):
        return False
    idx = device.index or 0
    if (idx, kind == "pair", FINISH) not in _READY and torch.cuda.is_current_stream_capturing():
        return False
    first = pws[0]
    if _cc_major(idx) != 9 or not all(layout_ok(pw) for pw in pws):
        return False
    if not len(pws) * first.k_rows * first.out_features >= MIN_ELEMS:
        return False
    if len(pws) * ((first.out_features + 127) // 128) > MAX_TILES:
        return False
    return all(pw.k_rows == first.k_rows and pw.out_features == first.out_features and
               pw.meta["_cuda_groups_key"] == first.meta["_cuda_groups_key"] for pw in pws[1:])


def run(x2, pws, chunks) -> list:
    """[x2 @ W] for each weight (chunks: their chunk tables), in one launch."""
    ys = torch.ops.exl_core.qgemm_wg_decode(x2, [pw.qweight for pw in pws], chunks, [pw.scale for pw in pws],
                                            [pw.zero for pw in pws], FINISH)
    _READY.add((x2.device.index or 0, False, FINISH))
    return ys


def run_swiglu(x2, gate, up, chunks, tails=None, cols: int = 0):
    """silu(x2 @ gate) * (x2 @ up) in one launch as fp16 [rows, cols or N]; tails as ops/swiglu.py says."""
    h = torch.ops.exl_core.qgemm_wg_swiglu(x2, [gate.qweight, up.qweight], chunks, [gate.scale, up.scale],
                                           [gate.zero, up.zero], tails, cols, FINISH)
    _READY.add((x2.device.index or 0, True, FINISH))
    return h
