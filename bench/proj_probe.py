"""Per-launch time of the decode projections of the bench's checkpoints, GPTQ against EXL2 rewritten as uniform 4-bit
rows (formats.uniform4), with variants that separate the rewrite's extra rows from its layout and data.

Why: bench/decode_timeline.py (stop 32 call 1, truncated) put EXL2's batch-32 gate/up launch (the SwiGLU pair kernel)
at 41.92 us against GPTQ's 31.58 (the same kernel instance, 6.25 % more rows of K) and its down launch at 25.85
against 22.30 (8.1 % more rows).
Each case is one CUDA graph of the launch over 16 layers' weights (no L2 reuse between launches), replayed; the
figure is the graph's time over 16.
    python bench/proj_probe.py --gptq /tmp/ck/gptq --exl2 /tmp/ck/exl2
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_bench  # noqa: E402
from common import graph_us  # noqa: E402

LAYERS = range(8, 24)


def truncated(pw, groups: int):
    """pw's first `groups` groups as a weight of their rows (uniform 4-bit, no permutation): the rewrite without its
    extra rows, its layout and values otherwise."""
    from exl_core.formats.packed import PackedWeight
    g = pw.groups[:groups]
    k = int(g[-1, 1] + g[-1, 2])
    q = int(g[-1, 3]) + int(g[-1, 2]) * 4 // 32
    return PackedWeight(pw.qweight[:q], g.contiguous(), pw.scale[:groups].contiguous(), pw.zero[:groups].contiguous(),
                        None, k, pw.out_features, None, {}, None)


def fresh(pw):
    """pw with a fresh meta (no kernel caches carried over)."""
    from exl_core.formats.packed import PackedWeight
    return PackedWeight(pw.qweight, pw.groups, pw.scale, pw.zero, pw.perm, pw.in_features, pw.out_features, pw.bias,
                        {}, pw.rows)


def cases_for(model, fmt: str) -> dict:
    """{name: [per layer: [weights of the launch]]} for gate/up (the pair) and down."""
    from exl_core.model.linear import _without_perm
    out = {}
    mlps = [model.layers[i].mlp for i in LAYERS]
    if fmt == "gptq":
        out["gate_up"] = [[m.gate_proj.packed, m.up_proj.packed] for m in mlps]
        out["down"] = [[m.down_proj.packed] for m in mlps]
    else:
        out["gate_up"] = [[_without_perm(m.gate_proj), _without_perm(m.up_proj)] for m in mlps]
        out["gate_up_fresh"] = [[fresh(pw) for pw in ws] for ws in out["gate_up"]]
        out["gate_up_4096"] = [[truncated(pw, 32) for pw in ws] for ws in out["gate_up"]]
        out["down"] = [[_without_perm(m.down_proj)] for m in mlps]
        n = int(mlps[0].down_proj.packed.in_features) // 128
        out["down_11008"] = [[truncated(pw, n) for pw in ws] for ws in out["down"]]
    return out


def run(model, fmt: str) -> list[dict]:
    from exl_core.ops import cuda_candidates as cc, cuda_swiglu
    from exl_core.ops.qmatmul import qmatmul
    rows = []
    for name, per_layer in cases_for(model, fmt).items():
        pw0 = per_layer[0][0]
        K = pw0.k_rows
        for B in (1, 8, 32):
            x = torch.randn(B, K, device="cuda", dtype=torch.float16) * 0.1
            if len(per_layer[0]) == 2:
                pair = B == 32 and cuda_swiglu._check(x, *per_layer[0]) is None
                fns = [(lambda ws=ws: cuda_swiglu._run(x, *ws)) if pair else (lambda ws=ws: cc._many_run(x, ws))
                       for ws in per_layer]
                how = "pair" if pair else "many"
            else:
                fns = [lambda ws=ws: qmatmul(x, ws[0]) for ws in per_layer]
                how = "one"
            try:
                us = graph_us(fns)
            except Exception as e:  # noqa: BLE001 - a probe reports and goes on
                print(f"{fmt} {name} B={B}: {e!r}")
                continue
            row = {"format": fmt, "case": name, "rows": B, "how": how, "K": K, "N": pw0.out_features, "us": us,
                   "group_shift": cc._group_shift(pw0), "min_group": cc._min_group(pw0)}
            rows.append(row)
            print(f"{fmt:5} {name:14} B={B:2} {how:4} K={K:5} N={pw0.out_features:5} gs={row['group_shift']:2} "
                  f"mg={row['min_group']:4} {us:8.2f} us", flush=True)
    return rows


def main() -> None:
    ap = gpu_bench.probe_parser(__doc__, "proj_probe_h200.json")
    a = ap.parse_args()
    out = gpu_bench.probe_record("proj_probe", "one projection launch over 16 layers' weights, CUDA graph", "cases")
    from exl_core.loader import load_model

    def run_format(path, fmt):
        model, _ = load_model(path, device="cuda", dtype=torch.float16, load_tokenizer=False)
        try:
            return run(model, fmt)
        finally:
            del model
            torch.cuda.empty_cache()
    out["cases"] += gpu_bench.probe_formats(a, run_format)
    gpu_bench._write(out, a.json)


if __name__ == "__main__":
    main()
