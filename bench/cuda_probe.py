"""Probe one qmatmul kernel on a random 4096x4096 4-bit weight (for ncu, or a quick timing).

    python bench/cuda_probe.py [mma|gemv|skinny|skinny_tiled|ks] [M] [splits]   # ncu -k regex:qgemm ...
    python bench/cuda_probe.py check                         # do the C++ input checks raise (not crash)?
    python bench/cuda_probe.py layout                        # row-major vs column-tiled qweight, timed
    python bench/cuda_probe.py kslice                        # decode kernels: qgemm_kslice variants vs skinny
    python bench/cuda_probe.py ks|wide M [splits K N]        # 8 distinct KxN weights (4096x4096) x 3 rounds (for ncu)
    python bench/cuda_probe.py syncs CKPT                    # where a prefill / decode step syncs the host
    python bench/cuda_probe.py prompt CKPT                   # 2048-token prefill: SDPA backends, host time
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

import exl_core  # noqa: F401  (loads the extension)
from exl_core.formats.packed import PackedWeight
from exl_core.ops.cuda_candidates import chunk_table


def weight(K=4096, N=4096, bits=4) -> PackedWeight:
    groups = torch.tensor([(bits, k, 128, k * bits // 32) for k in range(0, K, 128)], dtype=torch.int32)
    qw = torch.randint(-2**31, 2**31, (K * bits // 32, N), dtype=torch.int64).to(torch.int32)
    G = K // 128
    return PackedWeight(qw, groups, torch.rand(G, N) * 0.002 + 0.002, torch.full((G, N), 8.0), None, K, N).to("cuda")


def tiled(qweight: torch.Tensor) -> torch.Tensor:
    """[Q, N] -> [N/128, Q, 128]: each 128-column strip contiguous."""
    Q, N = qweight.shape
    return qweight.view(Q, N // 128, 128).permute(1, 0, 2).contiguous()


def weight_exl2(K=4096, N=4096) -> PackedWeight:
    """EXL2-like: 3/4/5-bit groups of 128 rows mixed (~4.0 bits), a random input permutation."""
    groups, q = [], 0
    for i, k in enumerate(range(0, K, 128)):
        bits = (5, 4, 4, 4, 4, 4, 4, 4, 4, 4, 3)[i % 11]
        groups.append((bits, k, 128, q))
        q += 128 * bits // 32
    qw = torch.randint(-2**31, 2**31, (q, N), dtype=torch.int64).to(torch.int32)
    G = len(groups)
    return PackedWeight(qw, torch.tensor(groups, dtype=torch.int32), torch.rand(G, N) * 0.002 + 0.002,
                        torch.full((G, N), 8.0), torch.randperm(K), K, N).to("cuda")


def kslice_table() -> None:
    """Per decode shape (single weights and the q/k/v, gate/up launches of a 7B layer), M = 1, 8, 16, 32:
    qgemm_skinny (its policy; and for 16/32 rows qgemm_mma and dequantise + cuBLAS) against qgemm_kslice per
    (kw, ring), 16 distinct weights per CUDA graph."""
    sys.path.insert(0, "bench")
    from gpu_bench import graph_time
    from exl_core.ops.cuda_candidates import _group_shift, _min_group
    ops = torch.ops.exl_core
    rows = []
    shapes = (("4096x4096", 4096, (4096,)), ("qkv 4096x3x4096", 4096, (4096,) * 3),
              ("gate_up 4096x2x11008", 4096, (11008, 11008)), ("11008x4096", 11008, (4096,)))
    for fmt in ("gptq", "exl2"):
        make = weight if fmt == "gptq" else weight_exl2
        u4 = fmt == "gptq"
        rings = (4, 8)
        for name, K, Ns in shapes:
            sets = [[make(K, N) for N in Ns] for _ in range(max(2, 16 // len(Ns)))]
            for s in sets:
                for pw in s:
                    pw.meta["_ch"] = chunk_table(pw.groups, "cuda")
            nbytes = sum(t.numel() * t.element_size() for pw in sets[0] for t in (pw.qweight, pw.scale, pw.zero))
            mg = _min_group(sets[0][0])
            gs = _group_shift(sets[0][0]) if u4 else -1              # as the dispatcher passes it
            for M in (1, 8, 16, 32):
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)

                def args(s):
                    return (x, [p.qweight for p in s], [p.meta["_ch"] for p in s], [p.scale for p in s],
                            [p.zero for p in s], [p.perm for p in s], [None] * len(s))
                ref = ops.qgemm_skinny_multi(*args(sets[0]), u4)
                cells = []
                t = graph_time(lambda: [ops.qgemm_skinny_multi(*args(s), u4) for s in sets]) / len(sets)
                cells.append(f"skinny {t * 1e6:6.1f}us {nbytes / t / 1e9:5.0f}GB/s")
                if M > 8:                                     # the other paths the policy had for these rows
                    t = graph_time(lambda: [ops.qgemm_mma_multi(*args(s)) for s in sets]) / len(sets)
                    cells.append(f"mma {t * 1e6:6.1f}us")
                    t = graph_time(lambda: [x @ ops.qdequant_chunks(p.qweight, p.meta["_ch"], p.scale, p.zero, p.perm,
                                                                    torch.float16) for s in sets for p in s]) / len(sets)
                    cells.append(f"dequant_mm {t * 1e6:6.1f}us")
                tiles = sum((N + 31) // 32 for N in Ns)
                for kw in ((8, 16) if M <= 8 else (4, 8)):
                    if not ops.qgemm_kslice_fits(M, K, tiles, mg, u4, 0, kw):
                        cells.append(f"k{kw} no fit")
                        continue
                    for ring in (rings if M <= 8 else (0,)):
                        y = ops.qgemm_kslice_multi(*args(sets[0]), u4, kw, ring, mg, gs)
                        err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(y, ref))
                        t = graph_time(lambda: [ops.qgemm_kslice_multi(*args(s_), u4, kw, ring, mg, gs)
                                                for s_ in sets]) / len(sets)
                        cells.append(f"k{kw}r{ring} {t * 1e6:6.1f}us {nbytes / t / 1e9:5.0f}GB/s"
                                     f"{'' if err < 2e-3 else f' ERR {err:.1e}'}")
                wtiles = sum((N + 127) // 128 for N in Ns)
                if M > 8 and ops.qgemm_wide_fits(M, K, wtiles, mg, 0):
                    y = ops.qgemm_wide_multi(*args(sets[0]), u4, 0, mg, gs)
                    err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(y, ref))
                    t = graph_time(lambda: [ops.qgemm_wide_multi(*args(s_), u4, 0, mg, gs) for s_ in sets]) / len(sets)
                    cells.append(f"wide {t * 1e6:6.1f}us {nbytes / t / 1e9:5.0f}GB/s"
                                 f"{'' if err < 2e-3 else f' ERR {err:.1e}'}")
                if ops.qgemm_kslice_fits(M, K, tiles, mg, u4, 0):
                    t = graph_time(lambda: [ops.qgemm_kslice_multi(*args(s_), u4, 0, 0, mg, gs) for s_ in sets]) / len(sets)
                    cells.append(f"policy {t * 1e6:6.1f}us")
                print(f"{fmt} {name:22s} M={M}: " + " | ".join(cells), flush=True)
                rows.append(kslice_row(fmt, name, M, cells))
    write_probe_json("cuda_kslice_h200", rows)


def kslice_row(fmt: str, shape: str, M: int, cells: list[str]) -> dict:
    """One printed line of kslice_table as {variant: us}."""
    us = {m[1]: float(m[2]) for m in (re.match(r"(\S+)\s+([0-9.]+)us", c) for c in cells) if m}
    return {"format": fmt, "shape": shape, "M": M, "us": us}


def write_probe_json(name: str, rows: list[dict]) -> None:
    body = json.dumps({"benchmark": name, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "what": "us per call, 16 distinct weights per CUDA graph", "rows": rows}, indent=1) + "\n"
    path = Path(__file__).parent / "results" / f"{name}.json"
    path.write_text(body)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(body)


def layout_table() -> None:
    """qgemm_skinny on row-major vs column-tiled words, 16 distinct weights per CUDA graph (> L2)."""
    sys.path.insert(0, "bench")
    from gpu_bench import graph_time
    ops = torch.ops.exl_core
    copy = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    t = graph_time(lambda: copy.clone())
    print(f"copy {2 * copy.numel() / t / 1e9:.0f} GB/s (read+write)")
    for K, N in ((4096, 4096), (4096, 11008), (11008, 4096), (4096, 12288)):
        pws = [weight(K, N) for _ in range(16)]
        chs = [chunk_table(pw.groups, "cuda") for pw in pws]
        tws = [tiled(pw.qweight) for pw in pws]
        nbytes = sum(t.numel() * 4 for t in (pws[0].qweight, pws[0].scale, pws[0].zero))
        for M in (1, 8, 16):
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            a = ops.qgemm_skinny(x, pws[0].qweight, chs[0], pws[0].scale, pws[0].zero, None, None, True)
            b = ops.qgemm_skinny(x, tws[0], chs[0], pws[0].scale, pws[0].zero, None, None, True)
            same = bool(torch.equal(a, b))
            cells = []
            for name, qs in (("rowmajor", [pw.qweight for pw in pws]), ("tiled", tws)):
                for sp in (0, 2, 4, 8):
                    t = graph_time(lambda: [ops.qgemm_skinny(x, q, ch, pw.scale, pw.zero, None, None, True, sp)
                                            for q, ch, pw in zip(qs, chs, pws)]) / len(pws)
                    cells.append(f"{name}/s{sp} {t * 1e6:6.1f}us {nbytes / t / 1e9:5.0f}GB/s")
            print(f"K={K:5d} N={N:5d} M={M:2d} equal={same}: " + "  ".join(cells), flush=True)


def host_syncs(ckpt: str) -> None:
    """Every place a 512-token prefill and an eager decode step make the host wait for the GPU
    (torch's sync debug mode), by innermost exl_core frame: each one stalls the launch queue."""
    import collections
    import traceback
    import warnings
    sys.path.insert(0, "bench")
    from gpu_bench import DecodeContext, PrefillContext, StaticKV
    from exl_core.loader import load_model
    model, _ = load_model(ckpt, device="cuda", dtype=torch.float16, load_tokenizer=False)
    kv = StaticKV(model, 1, 520)
    ids = torch.randint(0, model.config.vocab_size, (512,)).cuda()
    with torch.inference_mode():
        tok = model.forward(ids, PrefillContext(kv, 512)).argmax(-1)       # warm (tables, plans)
        kv.pos.fill_(512)
        for label, fn in (("prefill 512", lambda: model.forward(ids, PrefillContext(kv, 512))),
                          ("decode step", lambda: model.forward(tok, DecodeContext(kv)))):
            torch.cuda.synchronize()
            where: collections.Counter = collections.Counter()

            def record(message, category, filename, lineno, file=None, line=None):
                frames = [f for f in traceback.extract_stack()[:-1] if "exl_core" in f.filename]
                f = frames[-1] if frames else None
                where[f"{f.filename.split('exl_core/')[-1]}:{f.lineno} {f.line}" if f else str(message)[:60]] += 1

            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    fn()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            print(f"{label}: {sum(where.values())} syncing calls")
            for k, n in where.most_common(12):
                print(f"  {n:4d}x {k}")


def prompt_backends(ckpt: str) -> None:
    """2048-token prefill (gpu_bench's harness) under each SDPA backend: GPU time (events) and the host's
    time to issue the forward (no sync): host time near GPU time means the launch queue runs dry."""
    import time
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sys.path.insert(0, "bench")
    from gpu_bench import PrefillContext, StaticKV, gpu_time
    from exl_core.loader import load_model
    model, _ = load_model(ckpt, device="cuda", dtype=torch.float16, load_tokenizer=False)
    kv = StaticKV(model, 1, 2048)
    ids = torch.randint(0, model.config.vocab_size, (2048,)).cuda()
    fn = lambda: model.forward(ids, PrefillContext(kv, 2048))  # noqa: E731
    with torch.inference_mode():
        for name, backends in (("default", None), ("flash", [SDPBackend.FLASH_ATTENTION]),
                               ("cudnn", [SDPBackend.CUDNN_ATTENTION]), ("efficient", [SDPBackend.EFFICIENT_ATTENTION])):
            try:
                ctx = sdpa_kernel(backends) if backends else torch.autograd.graph.saved_tensors_hooks(id, id)
                with ctx:
                    t = gpu_time(fn, 5, warmup=2)
                    host = []
                    for _ in range(3):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        fn()
                        host.append(time.perf_counter() - t0)
                        torch.cuda.synchronize()
                print(f"prompt 2048 sdpa={name:9s} {2048 / t:9.0f} tok/s  gpu {t * 1e3:6.2f} ms  host issue "
                      f"{min(host) * 1e3:6.2f} ms", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"prompt 2048 sdpa={name}: {type(e).__name__} {str(e)[:150]}")


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "mma"
    if what == "prompt":
        prompt_backends(sys.argv[2])
        return
    if what == "syncs":
        host_syncs(sys.argv[2])
        return
    if what == "layout":
        layout_table()
        return
    if what == "kslice":
        kslice_table()
        return
    if what == "check":
        for code in ("ops.qgemm_mma(x.float(), pw.qweight, ch, pw.scale, pw.zero, None, None)",
                     "ops.qgemv_chunks(x, pw.qweight, ch[:3], pw.scale, pw.zero, None, None)"):
            src = ("import torch, exl_core; from bench.cuda_probe import weight; from exl_core.ops.cuda_candidates "
                   "import chunk_table; ops = torch.ops.exl_core; pw = weight(256, 64); ch = chunk_table(pw.groups, "
                   f"'cuda'); x = torch.randn(2, 256, device='cuda').half()\ntry:\n {code}\nexcept Exception as e:\n "
                   "print('raised', type(e).__name__, str(e)[:120])")
            r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True)
            print(f"check rc={r.returncode}: {code[:40]} -> {r.stdout.strip()[:200]} {r.stderr.strip()[-200:]}")
        return
    M = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    splits = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    # K and N (default 4096 x 4096): one weight of N = 12288 or 22016 columns gives the grid of the batch-32 q/k/v or
    # gate/up launch (3 x 4096 or 2 x 11008 columns), K = 11008 the down projection's
    K = int(sys.argv[4]) if len(sys.argv) > 4 else 4096
    N = int(sys.argv[5]) if len(sys.argv) > 5 else 4096
    pws = [weight(K, N) for _ in range(8)]
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    ops = torch.ops.exl_core
    for _ in range(3):
        for pw in pws:
            ch = chunk_table(pw.groups, "cuda") if "_ch" not in pw.meta else pw.meta["_ch"]
            pw.meta["_ch"] = ch
            if what == "mma":
                ops.qgemm_mma(x, pw.qweight, ch, pw.scale, pw.zero, None, None, splits)
            elif what == "ks":                            # qgemm_kslice, its policy's kw / ring
                ops.qgemm_kslice(x, pw.qweight, ch, pw.scale, pw.zero, None, None, True, min_group=128)
            elif what == "wide":                          # qgemm_wide, its policy's splits; GPTQ g128 group shift
                ops.qgemm_wide(x, pw.qweight, ch, pw.scale, pw.zero, None, None, True, splits, 128, 2)
            elif what.startswith("skinny"):
                q = tiled(pw.qweight) if what == "skinny_tiled" else pw.qweight
                ops.qgemm_skinny(x, q, ch, pw.scale, pw.zero, None, None, True, splits)
            else:
                ops.qgemv_chunks(x, pw.qweight, ch, pw.scale, pw.zero, None, None)
    torch.cuda.synchronize()
    print("probe done", what, M, splits, K, N)


if __name__ == "__main__":
    main()
