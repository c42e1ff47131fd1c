"""The kernels of one graphed decode step on a timeline (run by bench/gpu.sh phase `timeline`).

Question: where does a graphed step's time go, kernel by kernel -- how long each launch runs, and how much each
adds to the step's end (the critical path), under programmatic dependent launch (a kernel may start before the one
ahead of it ends)? The knock-out run (decode_knockout.py) gives a part's total; this gives every launch, the gaps
between them; and same-process variants of the step (VARIANTS: rope and the K/V write as their own launch at batch 1
and 32, and silu_mul as its own launch at batch 32; the fold in qgemm_wide at batch 32 again since stop 52, as
`fold_wide`; earlier stops' variants -- o and down on qgemm_wide, the RMSNorm fold off -- are in git history, commit
ec87252).

torch.profiler (CUPTI) records the kernels of REPLAYS replays of the bench's step graph (bench/gpu_bench.py); the
middle replay is reported. A kernel's `adds` is its end minus the latest end before it (0 when it ends inside an
earlier kernel's time): the adds of a step sum to its span. The untraced replay time is printed next to the traced
span (tracing may stretch the step).

    python bench/decode_timeline.py --gptq /tmp/exl_bench/gptq --exl2 /tmp/exl_bench/exl2
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from contextlib import contextmanager
from unittest import mock
from pathlib import Path

import torch

import gpu_bench
from exl_core.model import llama
from exl_core.ops import attention, cuda_candidates, cuda_norm_fold, cuda_swiglu, cuda_wg_decode

REPLAYS = 3
ACTIVITY, KERNEL_CAT = "CUDA", "kernel"     # (tests/CPU smoke runs: "CPU", "cpu_op")
# kernel name -> part of the step (first match wins; the rest are "other")
PARTS = (("wg", r"qgemm_wg"), ("wide", r"qgemm_wide"), ("kslice", r"qgemm_kslice"), ("skinny", r"qgemm_skinny"),
         ("mma", r"qgemm_mma"),
         ("attention", r"paged_attention|attn"), ("rope_kv", r"rope|write_kv|kv_write"), ("norm", r"rms_norm|norm"),
         ("silu", r"silu"), ("gemv", r"gemv_kernel"), ("x_gather", r"gather_cols"), ("gemm_fp16", r"gemm|cutlass|sm90_xmma|nvjet"),
         ("argmax", r"argmax|reduce"), ("embed", r"index_select|embedding"))


def part_of(name: str) -> str:
    for part, pat in PARTS:
        if re.search(pat, name, re.I):
            return part
    return "other"


# Same-process variants (module settings, or with os.environ an environment variable, read per call): rope and the
# K/V write as their own launch before attention (ops/attention.ROPE_ATTN_FUSE off); silu_mul as its own launch after
# gate/up (ops/cuda_swiglu off).
_PERM_NORM = llama.rms_norm_permuted
_bank_orders: dict = {}


def _bank_order(P: int, H: int, device, dtype=torch.int32) -> torch.Tensor:
    """An index of P entries in [0, H) under which rms_norm_vec_kernel's gather has no bank conflict: its thread t of
    a warp reads entry 8 (b + t) + e at step e (b a multiple of 32), here 2 t + 64 e + 512 ((b + t) // 32) mod H, so
    the 32 reads of a step fall in 32 banks.  (Ascending order would not do: entries 16 bytes apart per thread, 4-way
    conflicts.)  H a multiple of 64."""
    key = (P, H, str(device), dtype)
    if key not in _bank_orders:
        j = torch.arange(P)
        v, e = j // 8, j % 8
        _bank_orders[key] = ((2 * (v % 32) + 64 * e + 512 * (v // 32)) % H).to(dtype).to(device)
    return _bank_orders[key]


def _perm_norm_banks(x, weight, eps, perm, residual=None, site="mlp"):
    """llama.rms_norm_permuted with perm replaced by _bank_order: the same launch without the gather's bank
    conflicts.  Timing only: the step computes garbage."""
    return _PERM_NORM(x, weight, eps, _bank_order(perm.numel(), x.shape[-1], perm.device, perm.dtype), residual, site)


# perm_banks (stop 37): the rewrite's permuted norms add ~1.9 us a launch more than GPTQ's plain ones at batch 32
# (decode_timeline_h200_stop37_call7_cce1488.json) -- is it the random gather's bank conflicts?
VARIANTS = {"rope_attn_off": (attention, "ROPE_ATTN_FUSE", False),
            "perm_banks": (llama, "rms_norm_permuted", _perm_norm_banks),
            "swiglu_off": (cuda_swiglu, "WIDE_SWIGLU_ON", False),
            "norm_perm_off": (llama, "NORM_PERM_DEVICES", ()),
            "wide_twin": (cuda_candidates, "WIDE_TWIN_ON", True),
            "attn_order_off": (llama, "ATTN_OUT_ORDER_DEVICES", ()),
            "stage2_off": (os.environ, "EXL_CORE_ATTN_STAGE2", "0"),   # the host reads it per attention call
            "fold_wide": (cuda_norm_fold, "NORM_FOLD_WIDE", True),
            # stop 58: the stream-K wgmma kernels at 17..32 rows off; their SwiGLU pair on; o on them too (no size
            # floor); their weight boxes after the PDL wait; split tiles by atomics
            "wg_off": (cuda_wg_decode, "WG_DECODE", "0"),
            "wg_pair": (cuda_wg_decode, "WG_DECODE", "1"),
            "wg_atomic": (cuda_wg_decode, "FINISH", 0),
            "wg_o": (cuda_wg_decode, "MIN_ELEMS", 0),
            "wg_late_w": (os.environ, "EXL_CORE_WG_EARLY_W", "0")}


@contextmanager
def variant_set(variant: str):
    if not variant:
        yield
        return
    mod, name, value = VARIANTS[variant]
    patch = mock.patch.dict(mod, {name: value}) if mod is os.environ else mock.patch.object(mod, name, value)
    with patch:
        yield


def traced_kernels(replay) -> list[list[dict]]:
    """Kernels (name, ts, dur in us) of REPLAYS replays, split into replays by the number of kernels."""
    from torch.profiler import ProfilerActivity, profile
    replay()
    torch.cuda.synchronize()
    with profile(activities=[getattr(ProfilerActivity, ACTIVITY)]) as prof:
        for _ in range(REPLAYS):
            replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    ks = sorted(({"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"])} for e in events
                 if e.get("ph") == "X" and e.get("cat") == KERNEL_CAT), key=lambda k: k["ts"])
    if len(ks) < REPLAYS:
        raise RuntimeError(f"{len(ks)} kernels traced over {REPLAYS} replays")
    if len(ks) % REPLAYS:
        print(f"warning: {len(ks)} kernels traced over {REPLAYS} replays: not a whole number per replay")
    n = len(ks) // REPLAYS
    return [ks[i * n:(i + 1) * n] for i in range(REPLAYS)]


def step_rows(ks: list[dict]) -> list[dict]:
    """Per kernel: start offset, duration, gap to the latest end before it (negative: it overlaps), adds."""
    t0, frontier, rows = ks[0]["ts"], ks[0]["ts"], []
    for k in ks:
        end = k["ts"] + k["dur"]
        rows.append({"name": k["name"][:120], "part": part_of(k["name"]), "start_us": k["ts"] - t0,
                     "dur_us": k["dur"], "gap_us": k["ts"] - frontier, "adds_us": max(0.0, end - frontier)})
        frontier = max(frontier, end)
    return rows


def summarise(rows: list[dict]) -> dict:
    parts: dict = {}
    for r in rows:
        p = parts.setdefault(r["part"], {"launches": 0, "dur_us": 0.0, "adds_us": 0.0, "gap_us": 0.0})
        p["launches"] += 1
        p["dur_us"] += r["dur_us"]
        p["adds_us"] += r["adds_us"]
        p["gap_us"] += r["gap_us"]
    span = rows[-1]["start_us"] + rows[-1]["dur_us"]
    return {"span_us": span, "launches": len(rows), "adds_total_us": sum(r["adds_us"] for r in rows), "parts": parts}


@torch.inference_mode()              # the step's tensors are inference tensors (reset() updates one in place)
def run_case(model, fmt: str, B: int, variant: str, skip: int = 0) -> dict:
    """skip: steps replayed before the traced ones, so the traced step reads skip more keys a sequence (the
    untraced mean covers the bench's DECODE steps, the traced step sits near their start without it)."""
    if not 0 <= skip <= gpu_bench.DECODE - REPLAYS - 1:     # the cache holds the prompt and DECODE steps
        raise ValueError(f"skip {skip}: 0..{gpu_bench.DECODE - REPLAYS - 1}")
    with variant_set(variant):
        _, replay, reset = gpu_bench.decode_graph(model, B)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(gpu_bench.DECODE):
            replay()
        b.record()
        b.synchronize()
        untraced = a.elapsed_time(b) * 1e3 / gpu_bench.DECODE
        reset()
        for _ in range(skip):
            replay()
        steps = traced_kernels(replay)
    rows = step_rows(steps[REPLAYS // 2])
    case = {"format": fmt, "batch": B, "variant": variant, "skip_steps": skip, "untraced_step_us": untraced,
            "traced_spans_us": [summarise(step_rows(s))["span_us"] for s in steps], **summarise(rows), "kernels": rows}
    after = f" after {skip} steps" if skip else ""
    print(f"\n== {fmt} bs{B} {variant or 'default'}{after}: untraced step {untraced:.2f} us, "
          f"traced span {case['span_us']:.2f} us (replays {', '.join(f'{s:.2f}' for s in case['traced_spans_us'])}), {case['launches']} launches")
    print(f"{'part':10s} {'launches':>8s} {'dur us':>10s} {'adds us':>10s} {'gaps us':>10s}")
    for p, v in sorted(case["parts"].items(), key=lambda kv: -kv[1]["adds_us"]):
        print(f"{p:10s} {v['launches']:8d} {v['dur_us']:10.2f} {v['adds_us']:10.2f} {v['gap_us']:10.2f}")
    per_layer = max(1, (len(rows) - 4) // model.config.num_hidden_layers)
    mid = len(rows) // 2 - (len(rows) // 2) % per_layer
    print("-- a middle layer's launches (start, dur, gap, adds in us):")
    for r in rows[mid:mid + per_layer + 2]:
        print(f"{r['start_us']:9.2f} {r['dur_us']:8.2f} {r['gap_us']:7.2f} {r['adds_us']:7.2f}  {r['part']:9s} "
              f"{r['name'][:70]}")
    return case


def run_format(path: Path, fmt: str) -> list[dict]:
    """fmt "exl2_u4": the EXL2 folder loaded with EXL_CORE_EXL2_AS_U4=1 (formats.uniform4: mixed widths as
    uniform 4-bit rows, the CUDA default since stop 30); "exl2": with EXL_CORE_EXL2_AS_U4=0 (the mixed-width
    kernels)."""
    # exl2_u4 at 32 rows with q/k/v and gate/up gathering x (a launch) after a plain norm, not after the permuted
    # norm: does the norm before it slow the rewrite's gate/up (stop 32 call 1, truncated: adds 42.04 us without the
    # SwiGLU pair kernel, 41.92 with it; GPTQ's 31.58)?  Call 3: 34.91 us so, against 41.75 by default.
    # Short runs: TIMELINE_CASES="fmt:batch[:variant],..." (e.g. "gptq:32,exl2_u4:32:wide_twin") keeps those cases
    # only (and skips gptq_with_u4_gate_up).  Stop 37's variants of the rewrite at 32 rows run only when named there:
    # wide_twin (qgemm_wide folds the extra rows into their main chunks; EXL2 bench --quick 0.9160x at batch 32, stop
    # 37 call 1) and perm_banks; at batch 1, 8 or 32, attn_order_off (the attention's output in natural order, o
    # gathering it: EXL_CORE_ATTN_OUT_ORDER=0); stage2_off (the attention's second iteration of old keys loaded after
    # the PDL wait, as before stop 39: EXL_CORE_ATTN_STAGE2=0).
    keep = {c.strip() for c in os.environ.get("TIMELINE_CASES", "").split(",") if c.strip()}
    cases = [(1, ""), (8, ""), (32, "")] + ([(1, "rope_attn_off"), (32, "rope_attn_off"), (32, "swiglu_off")]
                                            if fmt == "gptq" else [(32, "norm_perm_off")] if fmt == "exl2_u4" else [])
    if fmt == "exl2_u4":
        cases += [(32, v) for v in ("wide_twin", "perm_banks") if f"{fmt}:32:{v}" in keep]   # they act at 32 rows
        cases += [(B, "attn_order_off") for B in (1, 8, 32) if f"{fmt}:{B}:attn_order_off" in keep]
    cases += [(B, "stage2_off") for B in (1, 8, 32) if f"{fmt}:{B}:stage2_off" in keep]   # stop 39: any format
    # fold_wide (stop 52): the norm folded into qgemm_wide at 17..32 rows (EXL_CORE_NORM_FOLD_WIDE=1; GPTQ, whose
    # weights have no permutation), last measured in stop 27 (0.9364x at batch 32)
    if f"{fmt}:32:fold_wide" in keep:
        cases.append((32, "fold_wide"))
    wg_variants = ("wg_off", "wg_pair", "wg_o", "wg_late_w", "wg_atomic")   # stop 58: any format
    cases += [(32, v) for v in wg_variants if f"{fmt}:32:{v}" in keep]
    if keep:
        cases = [(B, v) for B, v in cases if f"{fmt}:{B}" + (f":{v}" if v else "") in keep]
        if not cases:
            return []
    from exl_core.loader import load_model
    with mock.patch.dict(os.environ, {"EXL_CORE_EXL2_AS_U4": "1" if fmt == "exl2_u4" else "0"}):
        model, _ = load_model(path, device="cuda", dtype=torch.float16, load_tokenizer=False)
    # TIMELINE_SKIPS="0 120": each case traced after each number of untraced steps (keys 131 and 251 a sequence
    # after the bench's 128-token prompt), e.g. for the attention's share as the keys grow
    skips = [int(v) for v in os.environ.get("TIMELINE_SKIPS", "0").split()]
    out = []
    for (B, variant), skip in ((c, k) for c in cases for k in skips):
        try:
            out.append(run_case(model, fmt, B, variant, skip))
        except Exception as e:  # noqa: BLE001 - a probe keeps going and reports the failure
            print(f"{fmt} bs{B} {variant}: {e!r}")
            out.append({"format": fmt, "batch": B, "variant": variant, "skip_steps": skip, "error": repr(e)[:300]})
    del model
    torch.cuda.empty_cache()
    return out


def gptq_with_u4_gate_up(gptq: Path, exl2: Path) -> list[dict]:
    """GPTQ's model with every layer's gate/up replaced by EXL2's uniform 4-bit rewrite cut to its first 4,096 rows
    (no extra rows: GPTQ's K, the rewrite's values, scales and zeros; the outputs are not a model's, the launches
    are): whether the rewrite's batch-32 gate/up launch (41.92 us against GPTQ's 31.58, stop 32 call 1; 40.31
    against 38.20 alone, proj_probe.py call 2; truncated) is slow for its data or for its place in the step.  Call 3:
    31.13 us, as GPTQ's own 30.87 -- not the data."""
    from exl_core.loader import load_model
    from exl_core.model.linear import QuantLinear, _without_perm
    from proj_probe import truncated
    with mock.patch.dict(os.environ, {"EXL_CORE_EXL2_AS_U4": "1"}):
        src, _ = load_model(exl2, device="cuda", dtype=torch.float16, load_tokenizer=False)
    cut = [[truncated(_without_perm(m), 32) for m in (b.mlp.gate_proj, b.mlp.up_proj)] for b in src.layers]
    del src
    model, _ = load_model(gptq, device="cuda", dtype=torch.float16, load_tokenizer=False)
    for b, (g, u) in zip(model.layers, cut):
        b.mlp.gate_proj, b.mlp.up_proj = QuantLinear.from_packed(g), QuantLinear.from_packed(u)
    out = [run_case(model, "gptq_u4gu", B, "") for B in (1, 32)]
    del model, cut
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = gpu_bench.probe_parser(__doc__, "decode_timeline_h200.json")
    ap.add_argument("--exl2-u4", action="store_true", help="the EXL2 folder again, as uniform 4-bit rows")
    a = ap.parse_args()
    out = gpu_bench.probe_record("decode_timeline", f"step after a {gpu_bench.PROMPT}-token prompt, CUDA graph, as "
                                 "gpu_bench.py; torch.profiler", "cases")
    out["cases"] += gpu_bench.probe_formats(a, run_format)
    if a.exl2_u4 and a.exl2 is not None:
        out["cases"] += run_format(a.exl2, "exl2_u4")
        if a.gptq is not None and not os.environ.get("TIMELINE_CASES"):
            try:
                out["cases"] += gptq_with_u4_gate_up(a.gptq, a.exl2)
            except Exception as e:  # noqa: BLE001 - the cases above are still written
                print(f"gptq_u4gu: {e!r}")
    gpu_bench._write(out, a.json)


if __name__ == "__main__":
    main()
