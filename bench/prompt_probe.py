"""Where could a 2,048-token prompt's ~49 ms go? One GPU process, four probes, one table + JSON.

  1. baseline  eager prefill, gpu_bench's harness; again with ctx.num_positions set (no positions.max() sync)
  2. graph     the same forward from one CUDA graph: eager - graph ~ launch gaps (run last: a failed
               capture must not disturb the other parts)
  3. matmul    per 7B shape, x fp16 [2048, K], NW distinct GPTQ 4-bit g128 weights per CUDA graph (> L2),
               us per weight: (a) dequant, (b) GEMM, (c) dequant + GEMM (the model), (d) dequant on a side
               stream overlapping the previous GEMM, (e) L2-sized column slices: dequant [K, S] into one
               reused scratch block, GEMM into y's columns; "projection" scales them to the whole prompt
  4. kv_copy   64 K/V writes of (2048, 32, 128): PrefillContext's (1, H, T, D) cache (transposed read)
               against a (1, T, H, D) cache (contiguous copy)

    python bench/prompt_probe.py CKPT    # JSON: bench/results/prompt_probe_h200.json (and $OUT/ when set)
    PROBE_PARTS=matmul PROBE_SLICES=4096,5504 python bench/prompt_probe.py CKPT   # a subset
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]          # exl_core from this tree; gpu_bench / cuda_probe
from cuda_probe import weight  # noqa: E402  (imports exl_core: loads the extension)
from gpu_bench import PrefillContext, StaticKV, gpu_time, graph_time  # noqa: E402
from exl_core.formats.packed import PackedWeight  # noqa: E402
from exl_core.ops.cuda_candidates import _chunks_of  # noqa: E402

T = 2048
NW = 8                                                    # weights per graph: 8 x >= 32 MB of W, L2 is 50 MB
SHAPES = ((4096, 4096), (4096, 11008), (11008, 4096))
PER_LAYER = {(4096, 4096): 4, (4096, 11008): 2, (11008, 4096): 1}   # q/k/v/o, gate/up, down of a 7B layer
SLICES = tuple(int(v) for v in os.environ.get("PROBE_SLICES", "1024,2048,4096").split(","))
PARTS = set(os.environ.get("PROBE_PARTS", "baseline,matmul,kv_copy,projection,graph").split(","))
ROWS: list[dict] = []


def write_json() -> None:
    """After every part, so a timeout keeps what was measured (cuda_probe.write_probe_json's layout)."""
    body = json.dumps({"benchmark": "prompt_probe_h200", "gpu": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "what": f"{T}-token prompt pieces; matmul us per weight, {NW} distinct weights per CUDA "
                               "graph; kv_copy us for 64 copies", "rows": ROWS}, indent=1) + "\n"
    path = _HERE / "results" / "prompt_probe_h200.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(body)


def attempt(row: dict, key: str, fn) -> None:
    """row[key] = fn(), or row[key + '_error'] (printed with its traceback): one failure stops nothing."""
    try:
        row[key] = fn()
    except Exception as e:  # noqa: BLE001 - a probe keeps going and reports the failure
        traceback.print_exc()
        row[key + "_error"] = f"{type(e).__name__}: {str(e)[:250]}"


def add(row: dict) -> None:
    ROWS.append(row)
    print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    write_json()


# ------------------------------------------------------------------------ 1, 2: the model

def part_prompt(model, ids, kv) -> None:
    r = {"part": "baseline"}
    attempt(r, "eager_ms", lambda: gpu_time(lambda: model.forward(ids, PrefillContext(kv, T)), 5, warmup=2) * 1e3)
    if "eager_ms" in r:
        r["tok_s"] = T / r["eager_ms"] * 1e3
    ctx = PrefillContext(kv, T)
    ctx.num_positions = T                                 # no int(positions.max()) sync
    attempt(r, "eager_nosync_ms", lambda: gpu_time(lambda: model.forward(ids, ctx), 5, warmup=2) * 1e3)
    add(r)


def part_graph(model, ids, kv) -> None:
    ctx = PrefillContext(kv, T)
    ctx.num_positions = T                                 # a host sync is illegal inside capture
    model.forward(ids, ctx)                               # eager first: rope table, chunk tables, dispatch
    torch.cuda.synchronize()
    r = {"part": "graph"}
    attempt(r, "graph_ms", lambda: graph_time(lambda: model.forward(ids, ctx), reps=10) * 1e3)
    if "graph_ms" in r:
        r["tok_s"] = T / r["graph_ms"] * 1e3
        eager = next((x.get("eager_ms") for x in ROWS if x["part"] == "baseline"), None)
        if eager is not None:
            r["eager_minus_graph_ms"] = eager - r["graph_ms"]       # ~ launch gaps (and host syncs)
    add(r)


# ------------------------------------------------------------------------ 3: matmul pieces

def dq(pw) -> torch.Tensor:
    """The model's dequantise (cuda_candidates._qmatmul_run's last branch): a fresh fp16 W [K, N]."""
    return torch.ops.exl_core.qdequant_chunks(pw.qweight, _chunks_of(pw), pw.scale, pw.zero, pw.perm, torch.float16)


def col_slice(pw, a: int, b: int) -> PackedWeight:
    """Columns a..b of pw as their own contiguous PackedWeight (K, groups and perm unchanged)."""
    sp = PackedWeight(pw.qweight[:, a:b].contiguous(), pw.groups, pw.scale[:, a:b].contiguous(),
                      pw.zero[:, a:b].contiguous(), pw.perm, pw.in_features, b - a)
    sp.meta["_cuda_chunks"] = _chunks_of(pw)              # the chunk table depends on K's groups only
    return sp


def overlapped(x, pws, side, ev_dq, ev_mm) -> list:
    """Dequantise weight i+1 on `side` while weight i's GEMM runs on the current stream. Double-buffered
    like a real two-scratch version: dequant i+2 waits for GEMM i. Graph-safe: side joins the current
    (capture) stream first and is joined back at the end."""
    main = torch.cuda.current_stream()
    side.wait_stream(main)                                # x is ready; under capture, side joins the graph
    ws, ys = [None] * len(pws), []

    def issue(i):
        with torch.cuda.stream(side):
            if i >= 2:
                side.wait_event(ev_mm[i - 2])
            ws[i] = dq(pws[i])                            # allocated on side's stream
            ev_dq[i].record(side)

    issue(0)
    for i in range(len(pws)):
        if i + 1 < len(pws):
            issue(i + 1)
        main.wait_event(ev_dq[i])
        ws[i].record_stream(main)                         # the allocator must not hand W out before the GEMM ran
        ys.append(x @ ws[i])
        ev_mm[i].record(main)
        ws[i] = None
    main.wait_stream(side)                                # rejoin: a capture must end on its origin stream
    return ys


def into_columns(x, N: int, sets, get_w) -> list:
    """Per weight: y [T, N]; per column slice (a, b, s): y[:, a:b] = x @ get_w(s), written in place."""
    ys = []
    for parts in sets:
        y = torch.empty(T, N, device="cuda", dtype=torch.float16)
        for a, b, s in parts:
            torch.mm(x, get_w(s), out=y[:, a:b])          # get_w's temporary dies here: the next slice reuses it
        ys.append(y)
    return ys


def cuda_kernels(fn) -> list[str]:
    """Names of the CUDA kernels fn() launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages()
                   if (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) > 0})


def part_matmul(K: int, N: int, side) -> dict:
    pws = [weight(K, N) for _ in range(NW)]
    for pw in pws:
        _chunks_of(pw)                                    # built outside any capture (a host->device copy)
    x = torch.randn(T, K, device="cuda", dtype=torch.float16)
    ws = [dq(pw) for pw in pws]
    ref = x @ ws[0]
    r = {"part": "matmul", "K": K, "N": N}

    def us(fn):
        return graph_time(fn) / NW * 1e6

    def dq_only():
        for pw in pws:
            dq(pw)                                        # dropped at once: one reused block, as in the model
    attempt(r, "a_dequant_us", lambda: us(dq_only))
    attempt(r, "b_gemm_us", lambda: us(lambda: [x @ w for w in ws]))
    wts = [w.t().contiguous() for w in ws]                # W stored [N, K]: cuBLAS's TN form instead of NN
    attempt(r, "b_gemm_tn_us", lambda: us(lambda: [x @ wt.t() for wt in wts]))
    attempt(r, "b_gemm_tn_maxdiff", lambda: float((x @ wts[0].t() - ref).abs().max()))
    wts.clear()
    attempt(r, "c_dequant_gemm_us", lambda: us(lambda: [x @ dq(pw) for pw in pws]))
    ev_dq = [torch.cuda.Event() for _ in pws]
    ev_mm = [torch.cuda.Event() for _ in pws]
    attempt(r, "d_overlap_maxdiff", lambda: float((overlapped(x, pws, side, ev_dq, ev_mm)[0] - ref).abs().max()))
    attempt(r, "d_overlap_us", lambda: us(lambda: overlapped(x, pws, side, ev_dq, ev_mm)))
    if "c_dequant_gemm_us" in r and "d_overlap_us" in r:
        r["d_saves_us"] = r["c_dequant_gemm_us"] - r["d_overlap_us"]
    ws.clear()                                            # free the full Ws before the slices
    r["ref_absmax"] = float(ref.abs().max())
    for S in SLICES:
        if S >= N:
            continue
        cuts = [(a, min(a + S, N)) for a in range(0, N, S)]      # the last one partial when N % S
        sl = [[(a, b, col_slice(pw, a, b)) for a, b in cuts] for pw in pws]
        attempt(r, f"e{S}_maxdiff", lambda: float((into_columns(x, N, sl, dq)[0] - ref).abs().max()))
        # one scratch: consecutive slice dequants land on the same block (caching allocator, one stream)
        attempt(r, f"e{S}_scratch_reused", lambda: dq(sl[0][0][2]).data_ptr() == dq(sl[0][1][2]).data_ptr())
        attempt(r, f"e{S}_us", lambda: us(lambda: into_columns(x, N, sl, dq)))
        wsl = [[(a, b, dq(sp)) for a, b, sp in parts] for parts in sl]      # the slice GEMMs alone:
        attempt(r, f"e{S}_mm_only_us", lambda: us(lambda: into_columns(x, N, wsl, lambda w: w)))  # narrow GEMMs
        # mm(out=column view): cuBLAS writes y in place (ldc = N) unless an extra copy kernel shows up
        y = torch.empty(T, N, device="cuda", dtype=torch.float16)
        w0 = wsl[0][0][2]
        attempt(r, f"e{S}_out_extra_kernels", lambda: sorted(
            set(cuda_kernels(lambda: torch.mm(x, w0, out=y[:, :S]))) - set(cuda_kernels(lambda: torch.mm(x, w0)))))
        wsl.clear()
        sl.clear()
    torch.cuda.empty_cache()
    return r


# ------------------------------------------------------------------------ 4: K/V copy

def part_kv(H: int = 32, D: int = 128, n: int = 64) -> dict:
    src = [torch.randn(T, H, D, device="cuda", dtype=torch.float16) for _ in range(n)]  # rope's k / proj's v
    hd = [torch.zeros(1, H, T, D, device="cuda", dtype=torch.float16) for _ in range(n)]  # StaticKV layout
    td = [torch.zeros(1, T, H, D, device="cuda", dtype=torch.float16) for _ in range(n)]

    def copy_hd():                                        # PrefillContext.attend's write
        for s, c in zip(src, hd):
            c[:, :, :T] = s.view(1, T, H, D).transpose(1, 2)

    def copy_td():
        for s, c in zip(src, td):
            c[:, :T] = s.view(1, T, H, D)

    r = {"part": "kv_copy", "copies": n}
    nbytes = 2 * n * T * H * D * 2                        # read + write
    for name, fn in (("hd_transposed", copy_hd), ("td_contiguous", copy_td)):
        attempt(r, f"{name}_us", lambda: graph_time(fn) * 1e6)
        if f"{name}_us" in r:
            r[f"{name}_gb_s"] = nbytes / r[f"{name}_us"] * 1e-3
    r["hd_ok"] = bool(torch.equal(hd[0][0].transpose(0, 1), src[0]))   # the graph replays wrote it
    for t in (src, hd, td):
        t.clear()
    torch.cuda.empty_cache()
    return r


# ------------------------------------------------------------------------ main

def projection(layers: int) -> dict:
    """Matmul rows scaled to a whole prompt: ms for the 7 projections x `layers` (best slice width per shape)."""
    mm = {(r["K"], r["N"]): r for r in ROWS if r["part"] == "matmul"}
    out = {"part": "projection", "layers": layers}
    for key in ("a_dequant_us", "b_gemm_us", "c_dequant_gemm_us", "d_overlap_us", "e_best_us"):
        vals = []
        for shape, n in PER_LAYER.items():
            r = mm.get(shape, {})
            v = r.get(key) if key != "e_best_us" else min(
                (r[f"e{S}_us"] for S in SLICES if f"e{S}_us" in r), default=r.get("c_dequant_gemm_us"))
            vals.append(None if v is None else n * v)
        if None not in vals:
            out[key.replace("_us", "_ms")] = layers * sum(vals) / 1e3
    return out


@torch.inference_mode()
def main() -> None:
    from exl_core.loader import load_model
    m = {"part": "load"}                          # parts 3 and 4 still run (7B defaults) if the load fails
    attempt(m, "model", lambda: load_model(sys.argv[1], device="cuda", dtype=torch.float16, load_tokenizer=False)[0])
    model = m.pop("model", None)
    c = model.config if model is not None else None
    H, D, L = (c.num_key_value_heads, c.head_dim, c.num_hidden_layers) if c else (32, 128, 32)
    side = torch.cuda.Stream()
    steps = [(f"matmul {K}x{N}", (lambda K, N: lambda: add(part_matmul(K, N, side)))(K, N)) for K, N in SHAPES]
    steps += [("kv_copy", lambda: add(part_kv(H, D))), ("projection", lambda: add(projection(L)))]
    if model is not None:
        kv = StaticKV(model, 1, T)
        ids = torch.randint(0, c.vocab_size, (T,)).cuda()   # CPU RNG: a failed capture cannot poison it
        steps.insert(0, ("baseline", lambda: part_prompt(model, ids, kv)))
        steps.append(("graph", lambda: part_graph(model, ids, kv)))         # last: see the docstring
    else:
        add(m)
    steps = [(n, f) for n, f in steps if n.split()[0] in PARTS]        # PROBE_PARTS: a subset
    for name, fn in steps:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one failure stops nothing
            traceback.print_exc()
            add({"part": name, "error": f"{type(e).__name__}: {str(e)[:250]}"})
    print(f"\n== {T}-token prompt probe, {torch.cuda.get_device_name()}")
    for r in ROWS:
        cells = [f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "part"]
        print(f"{r['part']:11s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
