"""CUDA candidates for the quantized matmul dispatchers (kernels in exl_core/csrc/cuda/*.cu); the small ops' are in
cuda_small_ops.py, which install() also runs.

Imported once from exl_core/ops/__init__.py; each op's Dispatcher gets a `cuda` Candidate
at the front. Every check refuses (with a reason) off the GPU or when the extension was built
without CUDA, so CPU behaviour is unchanged.

qmatmul policy (rows M of x), from bench/gpu_bench.py's sweep on the H200 (every path on the
same 7B-shaped weights in CUDA graphs; "gemv_sweep" of a full run, bench/results/gpu_h200_run_b944a0b.json):
  fp16 x, N % 4 == 0, 16-byte aligned buffers, shared memory permitting, mixed widths with WIDE_MIXED_MIN_ROWS <=
  M <= WIDE_MAX_ROWS, or uniform 4-bit with WIDE_MIN_ROWS <= M <= WIDE_MAX_ROWS over at least WIDE_U4_MIN_TILES x
  128 columns in the launch:
                       decode GEMM for batches, 128 columns x one K range per block with x's rows staged
                       once per block, weights scaled in fp16 before the mma (`exl_core::qgemm_wide`,
                       `qgemm_wide_multi`); EXL_CORE_WIDE=0 turns it off (A/B)
  fp16 x, M <= KSLICE_MAX_ROWS (uniform 4-bit; 1 or 17+ rows for mixed widths), N % 4 == 0, 16-byte aligned
  buffers, shared memory permitting, up to 8 rows at most ~3 column tiles of 32 per SM (not gate/up), but
  uniform 4-bit gate/up at one row:
                       decode kernel, 32 columns x K slices per block, one launch
                       (`exl_core::qgemm_kslice`, `qgemm_kslice_multi`); EXL_CORE_KSLICE=0 turns it off (A/B)
  fp16 x, M <= SKINNY_MAX_ROWS, N % 4 == 0, 16-byte aligned buffers, K within the kernel's limit:
                       decode kernel, weights as the tensor-core A operand (`exl_core::qgemm_skinny`),
                       one launch; q/k/v and gate/up together (`qgemm_skinny_multi`)
  fp16 x, MMA_MIN_ROWS <= M <= MMA_MAX_ROWS (in practice only where kslice and skinny refuse, e.g. x past
  their shared memory; mixed widths up to MMA_MIXED_MAX_ROWS), same layout:
                       fused dequantise + tensor-core GEMM (`exl_core::qgemm_mma`), one launch;
                       q/k/v and gate/up together in one launch (`qgemm_mma_multi`)
  M <= GEMV_MAX_ROWS (bf16/fp32 x; fp16 only where the tensor-core kernels refuse):
                       fused fp32 dequantise-GEMV (`exl_core::qgemv_chunks`), deterministic
  otherwise            dequantise to W [K, N] in x's dtype + cuBLAS, in slices (`exl_core::qdequant_mm`)
qgemm_kslice vs qgemm_skinny (us, M=1, bench/cuda_probe.py kslice, 16 distinct weights per CUDA graph, H200;
bench/results/cuda_kslice_h200_run_b5b4aff.json): GPTQ 4096x4096 5.6 vs 8.1, q/k/v 3x4096 10.9 vs 17.8, 11008x4096
12.1 vs 16.9, gate/up 2x11008 19.7 vs 24.2 (at 8 rows 31.4 vs 26.8: skinny there); EXL2 (the earlier sweep,
bench/results/cuda_kslice_h200.json: b5b4aff's mixed-width staging was reverted) 8.1 vs 12.7, 22.2 vs 26.2, 18.6 vs
26.5, gate/up 37.6 vs 36.7 (skinny kept). (GPTQ in that earlier sweep, before the one-LOP3 extraction, the walking
refill and ring 4: 6.6 / 16.8 / 13.7 / 27.3 vs skinny 8.8 / 19.6 / 18.3 / 27.1.) b5b4aff's GPTQ figures were taken
with a staging through registers that 57704d5 replaced by cp.async (not swept since).
qgemm_kslice above 8 rows (x from global memory) against the paths those rows had (same run, us, GPTQ
4096x4096 / q/k/v / gate/up / 11008x4096): M=16 kslice 9.3/18.9/34.4/21.7 vs skinny 11.2/27.6/44.2/21.9;
M=32 kslice 12.9/38.4/66.0/30.2 vs qgemm_mma 20.6/57.3/108.6/46.1 (bench/results/cuda_kslice_h200.json).
Measured before qgemm_kslice (us, 4096x4096 / 4096x11008 / 11008x4096, with PDL; the sweep of commit 3517c25:
`git show 3517c25:bench/results/gpu_h200.json`, the committed file is a later run within ~0.5 us): M=1 skinny
8.8/15.6/18.6, gemv 13.9/23.2/25.0, mma 12.3/29.7/25.7; M=8 skinny 9.8/17.1/20.5, mma 13.1/32.4/27.8;
M=16 skinny 12.1/26.6/22.7, mma 15.3/36.2/31.2, dequant+cuBLAS 23.4/61.1/61.1; M=32 skinny
19.8/58.3/56.8, mma 21.4/55.8/48.7, dequant+cuBLAS 23.7/61.4/61.9; M=64 mma 42.2/109.6/93.5,
dequant+cuBLAS 22.4/61.2/63.3.
qgemm_wide vs qgemm_kslice (us, GPTQ 4-bit g128, 4096x4096 / q/k/v / gate/up / 11008x4096, one call of
bench/cuda_probe.py kslice, 16 distinct weights per CUDA graph, H200, bench/results/cuda_kslice_h200.json): 32 rows
14.4 / 27.6 / 47.2 / 32.2 vs 13.0 / 38.9 / 66.1 / 30.5; 16 rows 10.6 / 20.6 / 35.3 / 24.9 vs 9.5 / 19.4 / 34.7 /
21.8 (so 16 rows stay on kslice). Mixed widths (EXL2 ~4.0 bpw, act-order) at 16 rows, where kslice does not go:
wide 15.2 / 42.6 / 46.6 / 34.0 vs qgemm_skinny 20.4 / 43.8 / 73.9 / 41.5, so mixed widths take wide from 9 rows.
The chunk table (int32 [K/32, 3]: bits, group, first qweight row per 32 rows of K) is built
once per weight and cached on the device in `pw.meta`.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from . import cuda_dequant as cd
from .cuda_dequant import uniform4 as _uniform4   # there so that cuda_dequant imports nothing from here
from . import cuda_scale_half2 as h2mod
from . import cuda_wg_decode as wg
from .cuda_scale_half2 import half2_of
from .dispatch import Candidate, has_cuda_kernel
from .xchunks import staged_xchunks

KSLICE_MAX_ROWS = 32        # four mma n-tiles of x rows; above 8 rows x is read from global memory, not staged
KSLICE_STAGED_ROWS = 8      # rows whose x qgemm_kslice stages (there qgemm_kslice_silu computes silu(gate) * up)
KSLICE_MIXED_ROWS = (1, 17)  # mixed widths / act-order take 1 row, or 17 and more (x pre-permuted per weight): at
                             # 8 staged rows q/k/v took 50.0 us against skinny's 32.0 (the per-row gather); at 16
                             # rows kslice and skinny tie (q/k/v 47.1 vs 44.0, gate/up 62.9 vs 74.1); at 32 kslice
                             # wins everywhere (q/k/v 68.2 vs qgemm_mma 79.1, gate/up 97.1 vs dequantise+cuBLAS 131.4)
KSLICE_MIXED_ONE_WAVE = True  # and 2..8 staged rows where the launch has at most one column tile per SM (the o
                             # projection: qgemm_kslice's policy then runs 16 warps a block): EXL2 4096x4096 at 8 rows
                             # 10.8-11.0 us against qgemm_skinny's 16.3 (H200, cuda_probe.py kslice), batch-8 decode
                             # step 1.0378x-1.0452x faster (bench/decode_knockout.py, same process, four calls); q/k/v
                             # (384 tiles) ties with skinny (32.2-32.6 vs 32.0) and stays there; not for the
                             # SwiGLU-fused down projection (qgemm_kslice_silu at 2..5 rows of K 11008: not measured)
KSLICE_MIXED_WAVES = os.environ.get("EXL_CORE_KSLICE_MIXED_SKINNY", "1") == "0"   # A/B: mixed widths at 2..8 rows
                             # on qgemm_kslice whatever the tile count, the SwiGLU-fused down included (its C++
                             # policy reads the same variable)
KSLICE_ON = os.environ.get("EXL_CORE_KSLICE", "1") != "0"
GROUP_SHIFT_ON = os.environ.get("EXL_CORE_GROUP_SHIFT", "1") != "0"   # 0: kslice/wide read groups from the table (A/B)
SILU_FUSE_ON = os.environ.get("EXL_CORE_SILU_FUSE", "1") != "0"       # 0: silu_mul then the down projection (A/B)
WIDE_MIN_ROWS, WIDE_MAX_ROWS = 17, 32   # qgemm_wide (uniform 4-bit; 9..16: kslice as fast); cuda_norm_perm._lean
WIDE_MIXED_MIN_ROWS = 9     # mixed widths: from 9 rows (two n-tiles), where the alternative is qgemm_skinny
WIDE_U4_MIN_TILES = int(os.environ.get("EXL_CORE_WIDE_U4_MIN_TILES", "64"))   # (env: A/B runs)
                            # uniform 4-bit launches narrower than 64 x 128 columns stay on kslice: at 32 rows (H200,
                            # cuda_probe.py kslice, one call) 4096x4096 wide 14.4 vs kslice 13.0 us, 11008x4096 32.2
                            # vs 30.5; q/k/v 27.6 vs 38.9, gate/up 47.2 vs 66.1. Mixed widths: wide everywhere (EXL2
                            # 18.7 vs 18.7, 52.3 vs 53.7, 56.4 vs 87.3, 42.0 vs 44.7). Re-checked end to end after
                            # the wide kernel's faster reduction (stop 26, GPTQ bs32, same call, gpu.sh widetiles):
                            # o/down on wide 7,004.2 vs 7,620.3 tok/s (call 2), 7,182.7 vs 7,731.8 (call 4), and
                            # with 4 splits instead of 8 6,430.1 -- though bench/wide_probe.cu times wide's 4096x4096
                            # and 11008x4096 at 12.3 / 25.3 us, below kslice's 13.0 / 30.5 of the older sweep
WIDE_ON = os.environ.get("EXL_CORE_WIDE", "1") != "0"
# qgemm_wide's TWIN instances (extra rows folded into their main chunks): off by default until they have run on a GPU
# (stop 36 wrote them; its last device call stopped at a Python name clash before the kernel); 1: on
WIDE_TWIN_ON = os.environ.get("EXL_CORE_WIDE_TWIN", "0") == "1"
RESIDUAL_ADD_ON = os.environ.get("EXL_CORE_RESIDUAL_ADD", "1") != "0"   # 0: o/down never add in their GEMM (A/B)
SKINNY_MAX_ROWS = 16        # fp16: at 32 rows qgemm_mma is faster on 2 of the 3 shapes (sweep)
MMA_MIN_ROWS = 3            # fp16 outside the skinny kernel's reach: below this the GEMV is faster
MMA_MAX_ROWS = 32           # above this dequantise + cuBLAS is faster (64 rows: 2x)
MMA_MIXED_MAX_ROWS = 16     # weights that are not uniform 4-bit: measured on EXL2 mixed widths only, where
                            # dequantise + cuBLAS won at 32 rows end to end (bs32 2,599.1 vs 2,447.0 tok/s)
GEMV_MAX_ROWS = 8           # the fp32 GEMV loses to dequantise + cuBLAS from 16 rows on
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


_has_cuda_kernel = has_cuda_kernel       # the name the kernels' tests import


def chunk_table(groups: torch.Tensor, device: torch.device) -> torch.Tensor:
    """groups int32 [G, 4] (bits, k_start, k_len, qrow_start) -> int32 [K/32, 3] on `device`."""
    rows = []
    for gi, (bits, _k, k_len, q0) in enumerate(groups.tolist()):
        rows += [(bits, gi, q0 + c * bits) for c in range(k_len // 32)]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 3).to(device)


def _chunks_of(pw) -> torch.Tensor:
    dev = pw.qweight.device
    cached = pw.meta.get("_cuda_chunks")
    if cached is None or cached.device != dev:
        cached = chunk_table(pw.groups, dev)
        pw.meta["_cuda_chunks"] = cached
    return cached


# ---------------------------------------------------------------------------- qmatmul

def _mma_ok(pw) -> bool:
    """qgemm_mma's layout needs (and the other decode kernels, which share its launch table): 4-column (16-byte)
    loads of qweight, scale and zero, and fewer than 2^31 words of qweight."""
    key = pw.qweight.data_ptr()            # buffers can be replaced (set_packed, .to): re-check then
    cached = pw.meta.get("_cuda_mma_ok")
    if cached is None or cached[0] != key:
        ok = (_has_cuda_kernel("qgemm_mma") and pw.out_features % 4 == 0 and
              pw.qweight.numel() < 2 ** 31 and                  # build_mats: 32-bit word offsets
              all(t.data_ptr() % 16 == 0 for t in (pw.qweight, pw.scale, pw.zero)))
        cached = pw.meta["_cuda_mma_ok"] = (key, ok)
    return cached[1]


_MAX_K: dict = {}


def _skinny_ok(rows: int, pw, device) -> bool:
    """qgemm_skinny (the caller checks x is fp16) for 1..SKINNY_MAX_ROWS rows, K > 0, when K's slice of
    x fits the kernel's shared memory."""
    if not (1 <= rows <= SKINNY_MAX_ROWS and pw.in_features > 0 and pw.rows is None and _mma_ok(pw) and
            _has_cuda_kernel("qgemm_skinny")):
        return False
    key = (rows, device.index)
    if key not in _MAX_K:
        _MAX_K[key] = torch.ops.exl_core.qgemm_skinny_max_k(rows, device.index or 0)
    return pw.in_features <= _MAX_K[key]


_KSLICE_FITS: dict = {}


def _min_group(pw) -> int:
    """The weight's smallest group (rows of K): sizes qgemm_kslice's scale slots."""
    cached = pw.meta.get("_cuda_min_group")
    if cached is None:
        cached = pw.meta["_cuda_min_group"] = int(pw.groups[:, 2].min()) if pw.groups.numel() else 0
    return cached


def _group_shift(pw) -> int:
    """s where every group is 32 * 2**s rows of K in order (chunk c in group c >> s: GPTQ, with or without
    act-order, whose groups run in quantisation order), else -1: qgemm_kslice and qgemm_wide then read the
    chunk table (uniform 4-bit weights only use the shift)."""
    if not GROUP_SHIFT_ON:
        return -1
    cached = pw.meta.get("_cuda_group_shift")
    if cached is None:
        cached = -1
        g = pw.groups.cpu().long()                                  # (bits, k_start, k_len, qrow_start)
        gs = int(g[0, 2]) if g.shape[0] else 0
        cpg = gs // 32
        if gs % 32 == 0 and cpg >= 1 and cpg & (cpg - 1) == 0 and cpg < 1 << 15:   # the kernels take s < 16
            starts = torch.arange(g.shape[0]) * gs
            if torch.equal(g[:, 1], starts) and torch.equal(g[:, 2], (pw.k_rows - starts).clamp(max=gs)):
                cached = cpg.bit_length() - 1
        pw.meta["_cuda_group_shift"] = cached
    return cached


def _pws_group_shift(pws) -> int:
    """The weights' common group shift (one launch serves them all), or -1."""
    shifts = {_group_shift(pw) for pw in pws}
    return shifts.pop() if len(shifts) == 1 else -1


def _k_rows(pws) -> int:
    """The weights' common row count (PackedWeight.k_rows), 0 where they differ (one launch cannot serve them)."""
    ks = {pw.k_rows for pw in pws}
    return ks.pop() if len(ks) == 1 else 0


def _kslice_ok(rows: int, pws, device, one_wave: bool = True) -> bool:
    """qgemm_kslice (the caller checks x is fp16) for 1..KSLICE_MAX_ROWS rows when its shared memory
    (x's rows, the chunk table, scale/zero slots) fits; pws share K.  Weights with more rows than x has columns
    (formats.uniform4) have no other decode kernel: the 2..8-row refusal of wide launches (qgemm_kslice_fits with
    kw 0) does not apply to them, so they ask with kw 8, the kernel's choice for more tiles than SMs up to three 8-warp
    blocks an SM; above that it takes 4 (wave_kw's one wave), whose shared memory is never larger."""
    u4 = all(_uniform4(pw) for pw in pws)
    tiles = sum((pw.out_features + 31) // 32 for pw in pws)
    rows_ok = 1 <= rows <= KSLICE_MAX_ROWS and (u4 or rows == KSLICE_MIXED_ROWS[0] or rows >= KSLICE_MIXED_ROWS[1] or
                                                (one_wave and KSLICE_MIXED_ONE_WAVE and rows <= KSLICE_STAGED_ROWS and
                                                 tiles <= _sm_count(device)) or
                                                (KSLICE_MIXED_WAVES and rows <= KSLICE_STAGED_ROWS))
    K = _k_rows(pws)
    if not (KSLICE_ON and rows_ok and pws[0].in_features > 0 and K > 0 and all(_mma_ok(pw) for pw in pws) and
            _has_cuda_kernel("qgemm_kslice")):
        return False
    extra = rows <= KSLICE_STAGED_ROWS and any(pw.rows is not None for pw in pws) and tiles > _sm_count(device)
    key = (rows, K, tiles, min(_min_group(pw) for pw in pws), u4, device.index or 0, 8 if extra else 0)
    if key not in _KSLICE_FITS:
        _KSLICE_FITS[key] = bool(torch.ops.exl_core.qgemm_kslice_fits(*key))
    return _KSLICE_FITS[key]


_SM_COUNT: dict = {}


def _sm_count(device) -> int:
    idx = device.index or 0
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


_WIDE_FITS: dict = {}


def _wg_ok(rows: int, pws, device, kind: str) -> bool:
    """qgemm_wg_decode's policy (cuda_wg_decode.py; kind "multi", "single" or "pair") plus the 16-byte alignment every
    decode kernel needs."""
    return wg.wg_ok(rows, pws, device, kind) and all(_mma_ok(pw) for pw in pws)


def _wg_run(x2, pws) -> list:
    return wg.run(x2, pws, [_chunks_of(pw) for pw in pws])


def _wide_ok(rows: int, pws, device, any_rows: bool = False) -> bool:
    """qgemm_wide (the caller checks x is fp16): mixed widths from WIDE_MIXED_MIN_ROWS, uniform 4-bit from
    WIDE_MIN_ROWS over at least WIDE_U4_MIN_TILES column tiles, up to WIDE_MAX_ROWS rows, when its shared memory
    (x stages, the chunk table slice, the block's scale/zero rows) fits on this device; pws share K.  any_rows:
    from one row and any width of launch (weights with extra rows where qgemm_kslice refuses them: the kernel
    zero-fills the x rows past M)."""
    u4 = all(_uniform4(pw) for pw in pws)
    lo = 1 if any_rows else WIDE_MIN_ROWS if u4 else WIDE_MIXED_MIN_ROWS
    K = _k_rows(pws)
    if not (WIDE_ON and lo <= rows <= WIDE_MAX_ROWS and pws[0].in_features > 0 and K > 0 and
            all(_mma_ok(pw) for pw in pws) and _has_cuda_kernel("qgemm_wide")):
        return False
    tiles = sum((pw.out_features + 127) // 128 for pw in pws)
    if tiles < WIDE_U4_MIN_TILES and u4 and not any_rows:
        return False
    return _wide_fits(rows, K, tiles, min(_min_group(pw) for pw in pws), device.index or 0)


def _wide_fits(*key) -> bool:
    """torch.ops.exl_core.qgemm_wide_fits(*key), asked once per key (a host-side plan, on every launch's path)."""
    if key not in _WIDE_FITS:
        _WIDE_FITS[key] = bool(torch.ops.exl_core.qgemm_wide_fits(*key))
    return _WIDE_FITS[key]


def _wide_twins(rows: int, pws, device) -> tuple[Optional[torch.Tensor], int]:
    """(twins, k_main) for qgemm_wide's TWIN instances (formats.uniform4.twin_groups: extra rows folded into their
    main chunks) where every weight has the same twin layout, reads x as it is (no permutation, x's K its rows) and
    the launch fits with the twin words' shared memory; else (None, 0).  The int32 table is made once a weight.
    (The prompt's dequantise pairs chunks by cuda_dequant.twins_of, from the permutation; this pairs groups, from
    the layout as_uniform4 wrote, for views without the permutation.)"""
    if not WIDE_TWIN_ON or any(pw.perm is not None or pw.rows is not None for pw in pws):
        return None, 0
    from ..formats.uniform4 import twin_groups
    gs = _pws_group_shift(pws)
    tabs = []
    for pw in pws:
        if "_cuda_wide_twins" not in pw.meta:
            pw.meta["_cuda_wide_twins"] = twin_groups(pw)
        tabs.append(pw.meta["_cuda_wide_twins"])
    first = tabs[0]
    if gs < 0 or first is None or any(t != first for t in tabs) or first[1] % (32 << gs) or \
            len(first[0]) != first[1] // (32 << gs) or not all(_uniform4(pw) for pw in pws):
        return None, 0
    tiles = sum((pw.out_features + 127) // 128 for pw in pws)
    if not _wide_fits(rows, first[1], tiles, min(_min_group(pw) for pw in pws), device.index or 0, 0, False, True):
        return None, 0
    held = pws[0].meta.get("_cuda_wide_twins_t")
    if held is None or held.device != device:
        if torch.cuda.is_current_stream_capturing():   # no copy inside a graph: the plain launch is captured then
                                                        # (callers run a step eagerly first, as the bench and Generator)
            return None, 0
        held = pws[0].meta["_cuda_wide_twins_t"] = torch.tensor(first[0], dtype=torch.int32, device=device)
    return held, first[1]


def _mma_rows_ok(rows: int, pw) -> bool:
    """qgemm_mma's row range for this weight (the caller checks _mma_ok)."""
    return MMA_MIN_ROWS <= rows <= (MMA_MAX_ROWS if _uniform4(pw) else MMA_MIXED_MAX_ROWS)


def _qmatmul_check(x, pw) -> Optional[str]:
    if x.device.type != "cuda":
        return f"x is on {x.device}, not CUDA"
    if pw.in_features == 0:
        return "in_features 0: nothing to multiply (the reference returns the bias)"
    if not _has_cuda_kernel("qgemv_chunks"):
        return "extension built without CUDA kernels (csrc/cuda)"
    if pw.qweight.device != x.device:
        return f"qweight on {pw.qweight.device}, x on {x.device}"
    if x.dtype not in _FLOATS:
        return f"x dtype {x.dtype} not supported (float16, bfloat16, float32)"
    if pw.scale.dtype != torch.float32 or pw.zero.dtype != torch.float32:
        return f"scale/zero must be float32, got {pw.scale.dtype}/{pw.zero.dtype}"
    return None


def _qmatmul_run(x, pw):
    x2 = x.reshape(-1, pw.in_features)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    chunks = _chunks_of(pw)
    perm = _perm_of(pw, x.device)
    bias = pw.bias if pw.bias is None or pw.bias.dtype == x.dtype else pw.bias.to(x.dtype)
    rows = x2.shape[0]
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    route = _route(rows, pw, x2)
    if route == "wg":
        y = _wg_run(x2, [pw])[0]
    elif route == "wide":
        y = torch.ops.exl_core.qgemm_wide(x2, pw.qweight, chunks, pw.scale, pw.zero, perm, bias, _uniform4(pw),
                                          min_group=_min_group(pw), group_shift=_group_shift(pw))
    elif route == "kslice":
        y = torch.ops.exl_core.qgemm_kslice(x2, pw.qweight, chunks, pw.scale, pw.zero, perm, bias, _uniform4(pw),
                                            group_shift=_group_shift(pw),
                                            min_group=_min_group(pw))
    elif route == "skinny":
        y = torch.ops.exl_core.qgemm_skinny(x2, pw.qweight, chunks, pw.scale, pw.zero, perm, bias, _uniform4(pw))
    elif route == "mma":
        y = torch.ops.exl_core.qgemm_mma(x2, pw.qweight, chunks, pw.scale, pw.zero, perm, bias)
    elif route == "gemv":
        y = torch.ops.exl_core.qgemv_chunks(x2, pw.qweight, chunks, pw.scale, pw.zero, perm, bias)
    else:
        y = cd.dequant_mm(x2, pw, chunks, perm, bias)
    return y.reshape(*x.shape[:-1], pw.out_features)


def _route(rows: int, pw, x2) -> str:
    """The kernel _qmatmul_run gives these rows: a decode kernel, the fp32 GEMV, or dequantise + cuBLAS."""
    if rows > _decode_max_rows():          # a prompt: no decode kernel's checks on its host time
        return "dequant"
    if x2.dtype == torch.float16:
        dev = x2.device
        if _wg_ok(rows, [pw], dev, "single"):
            return "wg"
        if _wide_ok(rows, [pw], dev):
            return "wide"
        if _kslice_ok(rows, [pw], dev):
            return "kslice"
        if pw.rows is not None:               # formats.uniform4: no other decode kernel takes its extra rows
            return "wide" if _wide_ok(rows, [pw], dev, any_rows=True) else "dequant"
        if _skinny_ok(rows, pw, dev):
            return "skinny"
        if _mma_rows_ok(rows, pw) and _mma_ok(pw):
            return "mma"
    return "gemv" if rows <= GEMV_MAX_ROWS and pw.rows is None else "dequant"


def _add_check(residual, x, pw) -> Optional[str]:
    if not RESIDUAL_ADD_ON:
        return "EXL_CORE_RESIDUAL_ADD=0"
    if x.numel() <= MMA_MAX_ROWS * pw.in_features:
        return "decode-sized rows: the decode kernels have no add in their epilogue"
    why = _qmatmul_check(x, pw)
    if why is not None:
        return why
    x2 = x.reshape(-1, pw.in_features)
    if x.dtype == torch.float32:
        return "float32 x: the fp32 path is not cuBLAS's"
    if pw.bias is not None:
        return "a bias (the add takes none)"
    if (residual.dtype != x.dtype or residual.device != x.device or not residual.is_contiguous()
            or residual.shape != (x2.shape[0], pw.out_features)):
        return f"residual {residual.dtype} {tuple(residual.shape)} is not a contiguous [rows, N] tensor in x's dtype"
    if _route(x2.shape[0], pw, x2) != "dequant":
        return "these rows take a decode kernel (no add in its epilogue)"
    return None


def _add_run(residual, x, pw) -> bool:
    x2 = x.reshape(-1, pw.in_features)
    cd.dequant_mm(x2 if x2.is_contiguous() else x2.contiguous(), pw, _chunks_of(pw), _perm_of(pw, x.device), None,
                add_to=residual)
    return True


def _decode_max_rows() -> int:
    """The most rows any decode kernel takes (past them, dequantise + cuBLAS)."""
    return max(WIDE_MAX_ROWS, KSLICE_MAX_ROWS, MMA_MAX_ROWS, SKINNY_MAX_ROWS, GEMV_MAX_ROWS)


def prompt_adds_extra_rows(rows: int) -> bool:
    """Whether `rows` rows of x reach the prompt's dequantise + cuBLAS path (past every decode kernel) with the extra
    rows of a weight rewritten as uniform 4-bit rows added into its K rows in the dequantise (PROMPT_NATURAL_X):
    the norm before such weights then writes x in its natural order (model.llama._norm_many)."""
    return cd.PROMPT_NATURAL_X and rows > _decode_max_rows()


def _silu_down_check(gate, up, pw) -> Optional[str]:
    why = _qmatmul_check(gate, pw)
    if why is None and (up.device != gate.device or up.dtype != gate.dtype):
        why = f"up {up.dtype} on {up.device}, gate {gate.dtype} on {gate.device}"
    return why


def _silu_down_run(gate, up, pw):
    """One launch (qgemm_kslice_silu) where the decode kernel takes these rows with x staged, else silu_mul then
    qmatmul (both through their dispatchers)."""
    g2 = gate.reshape(-1, pw.in_features)
    rows = g2.shape[0]
    if not (SILU_FUSE_ON and gate.dtype == torch.float16 and rows <= KSLICE_STAGED_ROWS and _mma_ok(pw) and
            _kslice_ok(rows, [pw], gate.device, one_wave=False) and _has_cuda_kernel("qgemm_kslice_silu")):
        from .qmatmul import _run_silu_each
        return _run_silu_each(gate, up, pw)
    bias = pw.bias if pw.bias is None or pw.bias.dtype == gate.dtype else pw.bias.to(gate.dtype)
    g2, u2 = g2.contiguous(), up.reshape(-1, pw.in_features).contiguous()
    xc = staged_xchunks(pw, g2, u2)                 # x by chunk offsets instead of perm (ops/xchunks.py)
    perm = None if xc is not None else _perm_of(pw, gate.device)
    h2, mul = _half2_args(pw, gate.device)
    y = torch.ops.exl_core.qgemm_kslice_silu(g2, u2, pw.qweight, _chunks_of(pw), pw.scale, pw.zero, perm,
                                             None if bias is None else bias.contiguous(), _uniform4(pw),
                                             min_group=_min_group(pw), group_shift=_group_shift(pw), xchunks=xc,
                                             sz_half2=h2, sz_mul=mul)
    return y.reshape(*gate.shape[:-1], pw.out_features)


def _half2_args(pw, device) -> tuple:
    """(sz_half2, sz_mul) of the SwiGLU-fused down projection's uniform 4-bit weight (ops/cuda_scale_half2.py), or
    (None, None): the kernel then reads the float32 scale and zero."""
    split = half2_of(pw, device) if _uniform4(pw) else None
    return split if split is not None else (None, None)


def _half2_lists(pws, device, rows: int) -> tuple:
    """([sz_half2], [sz_mul]) for a staged-row qgemm_kslice launch of these weights under EXL_CORE_KSLICE_H2_ALL=1
    (every weight split), else (None, None)."""
    if rows > KSLICE_STAGED_ROWS or not h2mod.KSLICE_H2_ALL:
        return None, None
    splits = [_half2_args(pw, device) for pw in pws]
    if any(h is None for h, _ in splits):
        return None, None
    return [h for h, _ in splits], [m for _, m in splits]


def _perm_of(pw, device):
    perm = pw.perm
    if perm is not None and (perm.dtype != torch.int64 or perm.device != device):
        perm = pw.meta.get("_cuda_perm")
        if perm is None or perm.device != device:
            perm = pw.perm.to(device=device, dtype=torch.int64).contiguous()
            pw.meta["_cuda_perm"] = perm
    return perm


def _many_check(x, pws) -> Optional[str]:
    if x.dtype != torch.float16:
        return f"x dtype {x.dtype}: the one-launch path is the fp16 tensor-core kernel"
    if not 1 <= len(pws) <= 4:
        return f"{len(pws)} weights (one launch takes 1..4)"
    for i, pw in enumerate(pws):
        why = _qmatmul_check(x, pw)
        if why is None and not _mma_ok(pw):
            why = "N not a multiple of 4 or buffers not 16-byte aligned"
        if why is not None:
            return f"weight {i}: {why}"
    if not _k_rows(pws):
        return "weights with different row counts (PackedWeight.rows): one launch takes one K"
    return None


def _weights_args(pws, device, dtype) -> tuple:
    """The per-weight lists the *_multi ops take after x: qweight, chunks, scale, zero, perm, bias (in x's dtype)."""
    return ([pw.qweight for pw in pws], [_chunks_of(pw) for pw in pws], [pw.scale for pw in pws],
            [pw.zero for pw in pws], [_perm_of(pw, device) for pw in pws],
            [None if pw.bias is None else pw.bias.to(dtype).contiguous() for pw in pws])


def _many_run(x, pws):
    """q/k/v or gate/up in one launch (each block serves one weight; x is read per block anyway)."""
    x2 = x.reshape(-1, pws[0].in_features)
    rows = x2.shape[0]
    if rows > _decode_max_rows():
        return [_qmatmul_run(x, pw) for pw in pws]
    if _wg_ok(rows, pws, x.device, "multi"):
        ys = _wg_run(x2 if x2.is_contiguous() else x2.contiguous(), pws)
        return [y.reshape(*x.shape[:-1], pw.out_features) for y, pw in zip(ys, pws)]
    wide = _wide_ok(rows, pws, x.device)
    kslice = wide or _kslice_ok(rows, pws, x.device)
    if not kslice and any(pw.rows is not None for pw in pws):     # formats.uniform4: wide is the other kernel
        wide = kslice = _wide_ok(rows, pws, x.device, any_rows=True)
    skinny = kslice or all(_skinny_ok(rows, pw, x.device) for pw in pws)
    if not (skinny or all(_mma_rows_ok(rows, pw) and pw.rows is None for pw in pws)):
        return [_qmatmul_run(x, pw) for pw in pws]
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    args = (x2, *_weights_args(pws, x.device, x.dtype))
    u4 = all(_uniform4(pw) for pw in pws)
    if wide:
        twins, k_main = _wide_twins(rows, pws, x.device)
        ys = torch.ops.exl_core.qgemm_wide_multi(*args, u4, min_group=min(_min_group(pw) for pw in pws),
                                                 group_shift=_pws_group_shift(pws), twins=twins, k_main=k_main)
    elif kslice:
        h2, mul = _half2_lists(pws, x.device, rows)
        ys = torch.ops.exl_core.qgemm_kslice_multi(*args, u4, min_group=min(_min_group(pw) for pw in pws),
                                                   group_shift=_pws_group_shift(pws), sz_half2=h2, sz_mul=mul)
    elif skinny:
        ys = torch.ops.exl_core.qgemm_skinny_multi(*args, u4)
    else:
        ys = torch.ops.exl_core.qgemm_mma_multi(*args)
    return [y.reshape(*x.shape[:-1], pw.out_features) for y, pw in zip(ys, pws)]


# ---------------------------------------------------------------------------- registration

def install_candidate(disp, check, run) -> None:
    """Put Candidate("cuda", check, run) at the front of `disp` (idempotent), replacing any other called "cuda": an op
    module's placeholder must not serve behind it (it would reach the C++ checks that crash instead of refusing)."""
    disp.candidates[:] = [c for c in disp.candidates if c.name != "cuda"]
    disp.candidates.insert(0, Candidate("cuda", check, run))


def install() -> None:
    """Put a `cuda` candidate at the front of each dispatcher (idempotent): the quantized matmuls' here, the small
    ops' (norm, SwiGLU product, rope, dense layers, paged attention) from cuda_small_ops.py."""
    from . import cuda_small_ops, qmatmul
    cuda_small_ops.install()
    install_candidate(qmatmul.DISPATCH, _qmatmul_check, _qmatmul_run)
    install_candidate(qmatmul.DISPATCH_MANY, _many_check, _many_run)             # q/k/v, gate/up
    install_candidate(qmatmul.DISPATCH_SILU, _silu_down_check, _silu_down_run)   # the MLP's down projection
    install_candidate(qmatmul.DISPATCH_ADD, _add_check, _add_run)                # o and down into the residual


install()
