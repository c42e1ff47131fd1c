"""GPU benchmark: Llama-2-7B-shaped GPTQ / EXL2 checkpoints on one GPU (run by bench/gpu.sh).

Question: how close does decode get to the bandwidth floor, and what do batch 8/32 and a
2,048-token prompt reach? Prints one table; writes JSON (bench/results/gpu_h200.json and,
when set, $OUT/gpu_h200.json).

Decode runs the native model with a static per-batch K/V context (below), greedy on the device
(exl_core::greedy_pick, the sampler's greedy fast path; --greedy argmax: torch's argmax), each step
captured in a CUDA graph per batch size (eager numbers printed too).
The Generator's scheduler and the rest of its sampler are not in these numbers.

    python bench/gpu_bench.py --gptq /tmp/llama7b_gptq --exl2 /tmp/llama7b_exl2
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from exl_core.ops.attention import (paged_attention, rope_paged_attention, rope_paged_attention_ordered, rope_write_kv,
                                    write_kv)
from exl_core.ops.dispatch import has_cuda_kernel
from exl_core.ops.rope import apply_rope

PROMPT, DECODE = 128, 128
PROFILE = os.environ.get("EXL_BENCH_PROFILE", "1") == "1"
PROFILE_PROMPT = os.environ.get("EXL_BENCH_PROFILE_PROMPT", "0") == "1"   # with --prompt-only: its kernels too


def gpu_time(fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of fn() over reps, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def copy_bandwidth() -> float:
    """Device copy GB/s (bytes read + written) on a 2 GiB buffer."""
    n = 1 << 30
    src = torch.randn(n // 2, device="cuda")
    dst = torch.empty_like(src)
    t = gpu_time(lambda: dst.copy_(src), 20)
    return 2 * (n // 2) * 4 / t / 1e9


def bytes_per_token(model) -> int:
    """Bytes one batch-1 decode step must read: every packed weight (words, fp32 scale/zero,
    perm), dense layers, norms; the K/V cache is small at 256 tokens and left out."""
    total = 0
    for _, lin in model.linear_layers():
        pw = lin.packed
        if pw is not None:
            for t in (pw.qweight, pw.scale, pw.zero, pw.perm, pw.bias):
                total += 0 if t is None else t.numel() * t.element_size()
        else:
            total += lin.w_t.numel() * lin.w_t.element_size()
    for layer in model.layers:
        total += 2 * layer.input_layernorm.weight.numel() * layer.input_layernorm.weight.element_size()
    return total


# ------------------------------------------------------------------------ contexts (ForwardContext)

class _CapPositions(torch.Tensor):
    """Positions whose .max() is a fixed bound: the model sizes its rope table with
    int(positions.max()), which would sync the device (illegal inside graph capture)."""
    __torch_function__ = torch._C._disabled_torch_function_impl
    bound = 0

    def max(self, *a, **k):  # noqa: A003
        if a or k:
            return super().max(*a, **k)
        return torch.tensor(self.bound - 1)

    def min(self, *a, **k):  # noqa: A003  (apply_rope's range check; positions are >= 0 here)
        if a or k:
            return super().min(*a, **k)
        return torch.tensor(0)


TOKEN_MAJOR = True    # K/V cache (B, T, Hkv, D): the paged cache's layout (exl_core/cache/paged.py) and
                      # ExLlamaV2's; a prefill writes it with one contiguous copy (64 writes of 2048 x 32 x 128:
                      # 649 us against 1,575 us into (B, Hkv, T, D), bench/prompt_probe.py). --kv-layout htd: the latter (A/B)


GREEDY_PICK = True   # each step's token by exl_core::greedy_pick (the sampler's greedy fast path: argmax, max, lse and
                     # logprob in one launch, csrc/cuda/greedy_cuda.cu) where the extension has it; --greedy argmax:
                     # torch's argmax alone (the bench through stop 46: 10.04 us of a 7B batch-1 step, stop 39 timeline)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The bench's greedy token per row (B,) on the device."""
    if GREEDY_PICK and has_cuda_kernel("greedy_pick"):
        return torch.ops.exl_core.greedy_pick(logits)[0]
    return logits.argmax(-1)


PAGED_DECODE = True  # decode K/V write and attention by the library's kernels over the static cache; --decode-attn
                     # sdpa: index_copy and the masked SDPA over every slot this bench used before (A/B)


class StaticKV:
    """K/V of B equal-length sequences: per layer (B, max_len, Hkv, D), or (B, Hkv, max_len, D) with
    TOKEN_MAJOR off; `htd(t)` views either as (B, Hkv, T, D) for SDPA."""

    def __init__(self, model, B: int, max_len: int):
        c = model.config
        shape = ((B, max_len, c.num_key_value_heads, c.head_dim) if TOKEN_MAJOR else
                 (B, c.num_key_value_heads, max_len, c.head_dim))
        self.k = [torch.zeros(shape, dtype=model.dtype, device="cuda") for _ in range(c.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=model.dtype, device="cuda") for _ in range(c.num_hidden_layers)]
        self.B, self.max_len = B, max_len
        self.pos = torch.zeros(1, dtype=torch.int64, device="cuda")      # next position (device side)
        self.kpos = torch.arange(max_len, device="cuda")

    @staticmethod
    def htd(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2) if TOKEN_MAJOR else t


class PrefillContext:
    """T new tokens per sequence starting at position 0; logits for each sequence's last row."""

    def __init__(self, kv: StaticKV, T: int):
        self.kv, self.T = kv, T
        self.num_positions = T          # stated, so Model.forward reads no max position back (a sync; graphs)
        self.positions = torch.arange(T, device="cuda").repeat(kv.B)
        self.logit_rows = torch.arange(kv.B, device="cuda") * T + T - 1

    def attend_rope(self, layer, q, k, v, cos_sin, scale, window):
        """Rope and the K/V write in one launch (the library's rope_write_kv, as PagedContext.attend_rope at a prefill; the
        cache (B, max_len, Hkv, D) is B pages of max_len slots), then SDPA over the cache's first T slots."""
        if not TOKEN_MAJOR:
            q, k = apply_rope(q, k, self.positions, cos_sin)
            return self.attend(layer, q, k, v, scale, window)
        B, T, L = self.kv.B, self.T, self.kv.max_len
        kc, vc = self.kv.k[layer], self.kv.v[layer]
        if layer == 0:
            self.slots = (torch.arange(B, device="cuda")[:, None] * L + torch.arange(T, device="cuda")).reshape(-1)
        q = rope_write_kv(q, k, v, self.positions, cos_sin, kc, vc, self.slots)
        q = q.view(B, T, *q.shape[1:]).transpose(1, 2)                   # (B, Hq, T, D)
        o = F.scaled_dot_product_attention(q, kc[:, :T].transpose(1, 2), vc[:, :T].transpose(1, 2), is_causal=True,
                                           scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(B * T, q.shape[1], q.shape[3])

    def attend(self, layer, q, k, v, scale, window):
        B, T = self.kv.B, self.T
        q = q.view(B, T, *q.shape[1:]).transpose(1, 2)                   # (B, Hq, T, D)
        k = k.view(B, T, *k.shape[1:])                                   # (B, T, Hkv, D)
        v = v.view(B, T, *v.shape[1:])
        kc, vc = self.kv.k[layer], self.kv.v[layer]
        if TOKEN_MAJOR:
            kc[:, :T] = k
            vc[:, :T] = v
        else:
            kc[:, :, :T] = k.transpose(1, 2)
            vc[:, :, :T] = v.transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
                                           enable_gqa=True)
        return o.transpose(1, 2).reshape(B * T, q.shape[1], q.shape[3])


class DecodeContext:
    """One token per sequence at the device-side position kv.pos; graph-capturable (no syncs)."""

    def __init__(self, kv: StaticKV):
        self.kv = kv
        p = kv.pos.expand(kv.B).as_subclass(_CapPositions)
        p.bound = kv.max_len
        self.positions = p
        self.logit_rows = None

    def _paged(self, layer):
        """The library's paged decode (the Generator's path): sequence b is page b of max_len slots."""
        kv = self.kv
        if layer == 0:
            B = kv.B
            self.table = torch.arange(B, dtype=torch.int32, device="cuda").view(B, 1)
            self.cu = torch.arange(B + 1, dtype=torch.int64, device="cuda")
            self.lens = (kv.pos + 1).expand(B).contiguous()
            self.slots = torch.arange(B, device="cuda") * kv.max_len + kv.pos
        return kv.k[layer], kv.v[layer]

    def attend_rope(self, layer, q, k, v, cos_sin, scale, window):
        if not (PAGED_DECODE and TOKEN_MAJOR):
            q, k = apply_rope(q, k, self.positions, cos_sin)
            return self.attend(layer, q, k, v, scale, window)
        kc, vc = self._paged(layer)
        return rope_paged_attention(q, k, v, self.positions, cos_sin, kc, vc, self.slots, self.table, self.cu,
                                    self.lens, scale, window, max_q_len=1)      # as PagedContext.attend_rope

    def attend_rope_ordered(self, layer, q, k, v, cos_sin, scale, window, order):
        """attend_rope's output stored in o_proj's act-order, as PagedContext.attend_rope_ordered (the model takes
        it unless EXL_CORE_ATTN_OUT_ORDER=0); None where attend_rope is not the paged kernel's."""
        if not (PAGED_DECODE and TOKEN_MAJOR):
            return None
        kc, vc = self._paged(layer)
        return rope_paged_attention_ordered(q, k, v, self.positions, cos_sin, kc, vc, self.slots, self.table, self.cu,
                                            self.lens, scale, window, 1, order)

    def attend(self, layer, q, k, v, scale, window):
        kv = self.kv
        kc, vc = kv.k[layer], kv.v[layer]
        if PAGED_DECODE and TOKEN_MAJOR:
            kc, vc = self._paged(layer)
            write_kv(kc, vc, k, v, self.slots)
            return paged_attention(q, kc, vc, self.table, self.cu, self.lens, scale, window, max_q_len=1)
        t = 1 if TOKEN_MAJOR else 2
        kc.index_copy_(t, kv.pos, k.unsqueeze(t))                          # one token at pos
        vc.index_copy_(t, kv.pos, v.unsqueeze(t))
        if layer == 0:                                                     # keys 0..pos, once per step
            self.mask = (kv.kpos <= kv.pos).view(1, 1, 1, -1)
        mask = self.mask
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kv.htd(kc), kv.htd(vc), attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        return o.squeeze(2)                                               # (B, Hq, D)


# ------------------------------------------------------------------------ measurements

@torch.inference_mode()
def decode_graph(model, B: int, graphs: bool = True):
    """The bench's decode after a PROMPT-token prompt: (step, replay, reset). step() runs one greedy step eagerly;
    with graphs, replay() replays it captured in a CUDA graph (else it is step); reset() puts the position back
    to the prompt's end."""
    kv = StaticKV(model, B, PROMPT + DECODE + 8)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (B * PROMPT,)).cuda()     # CPU RNG: a failed capture cannot poison it
    logits = model.forward(ids, PrefillContext(kv, PROMPT))
    tok = greedy_ids(logits)                                             # (B,)
    kv.pos.fill_(PROMPT)
    ctx = DecodeContext(kv)

    def step():
        nxt = greedy_ids(model.forward(tok, ctx))
        tok.copy_(nxt)
        kv.pos.add_(1)

    def reset():
        kv.pos.fill_(PROMPT)

    if not graphs:
        return step, step, reset
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):                                                # warm: chunk tables, rope table
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    reset()
    return step, g.replay, reset


@torch.inference_mode()
def decode_tok_s(model, B: int, graphs: bool) -> float:
    step, replay, reset = decode_graph(model, B, graphs)
    if not graphs:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(DECODE):
            step()
        torch.cuda.synchronize()
        return B * DECODE / (time.perf_counter() - t0)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(DECODE):
        replay()
    b.record()
    b.synchronize()
    return B * DECODE / (a.elapsed_time(b) / 1e3)


@torch.inference_mode()
def profile_decode(model, B: int) -> list[dict]:
    """Kernel time of one eager decode step at batch B after a PROMPT-token prompt."""
    kv = StaticKV(model, B, PROMPT + 8)
    ids = torch.randint(0, model.config.vocab_size, (B * PROMPT,)).cuda()
    tok = model.forward(ids, PrefillContext(kv, PROMPT)).argmax(-1)
    kv.pos.fill_(PROMPT)
    ctx = DecodeContext(kv)
    return profile_table(lambda: model.forward(tok, ctx), f"decode bs{B} step")


def prefill_call(model, T: int = 2048):
    """fn() -> logits: one T-token prompt of random ids through the bench's prefill context (what prompt_tok_s
    times; bench/prompt_timeline.py and prompt_host.py trace it)."""
    kv = StaticKV(model, 1, T)
    ids = torch.randint(0, model.config.vocab_size, (T,)).cuda()
    return lambda: model.forward(ids, PrefillContext(kv, T))


@torch.inference_mode()
def prompt_tok_s(model, T: int = 2048) -> float:
    return T / gpu_time(prefill_call(model, T), 5, warmup=2)


def capture_graph(fn):
    """(graph, its output): fn() captured in a CUDA graph after two warm calls on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def graph_time(fn, reps: int = 10) -> float:
    """Median seconds of one replay of a CUDA graph of fn() (launch gaps shrunk, no host overhead)."""
    return gpu_time(capture_graph(fn)[0].replay, reps)


@torch.inference_mode()
def gemv_sweep(model) -> list[dict]:
    """Per projection shape and M, every qmatmul path on the same weights: the batch-1 decode kernel
    (qgemm_kslice, 1..32 rows), the batch decode kernel (qgemm_wide, 9..32 rows), the skinny decode kernel (qgemm_skinny, with its split-K choices), the
    tensor-core kernel (qgemm_mma), the fp32 GEMV
    (qgemv_chunks), dequantise + cuBLAS. Each timing runs the shape's
    16 distinct layer weights back to back in one CUDA graph (> L2: no cache reuse between calls);
    GB/s counts packed words + scale/zero once per call."""
    from exl_core.ops.cuda_candidates import _chunks_of, _group_shift, _min_group, _uniform4
    by_shape: dict = {}
    for _, lin in model.linear_layers():
        pw = lin.packed
        if pw is not None:
            by_shape.setdefault((pw.in_features, pw.out_features), []).append(pw)
    ops = torch.ops.exl_core
    rows = []
    for (K, N), pws in by_shape.items():
        pws = pws[:16]
        for pw in pws:
            _chunks_of(pw)
        nbytes = sum(t.numel() * t.element_size() for t in (pws[0].qweight, pws[0].scale, pws[0].zero))
        for M in (1, 2, 4, 8, 16, 32, 64):
            x = torch.randn(M, K).to("cuda", model.dtype)
            ch = {id(pw): pw.meta["_cuda_chunks"] for pw in pws}
            u4 = all(_uniform4(pw) for pw in pws)              # the library's own check, every weight
            paths = {
                "kslice": lambda pw: ops.qgemm_kslice(x, pw.qweight, ch[id(pw)], pw.scale, pw.zero, pw.perm, None, u4,
                                                      min_group=_min_group(pw), group_shift=_group_shift(pw)),
                "wide": lambda pw: ops.qgemm_wide(x, pw.qweight, ch[id(pw)], pw.scale, pw.zero, pw.perm, None, u4,
                                                  min_group=_min_group(pw), group_shift=_group_shift(pw)),
                "skinny": lambda pw: ops.qgemm_skinny(x, pw.qweight, ch[id(pw)], pw.scale, pw.zero, pw.perm, None, u4),
                "mma": lambda pw: ops.qgemm_mma(x, pw.qweight, ch[id(pw)], pw.scale, pw.zero, pw.perm, None),
                "gemv": lambda pw: ops.qgemv_chunks(x, pw.qweight, ch[id(pw)], pw.scale, pw.zero, pw.perm, None),
                "dequant_mm": lambda pw: x @ ops.qdequant_chunks(pw.qweight, ch[id(pw)], pw.scale, pw.zero,
                                                                 pw.perm, model.dtype),
            }
            if M in (1, 8, 32):                               # split-K choices of the decode kernel
                for sp in (1, 2, 4, 8):
                    paths[f"skinny_s{sp}"] = (lambda sp: lambda pw: ops.qgemm_skinny(
                        x, pw.qweight, ch[id(pw)], pw.scale, pw.zero, pw.perm, None, u4, sp))(sp)
            row = {"K": K, "N": N, "M": M}
            for name, f in paths.items():
                if ((name == "gemv" and M > 16) or (name.startswith("skinny") and M > 32) or
                        (name == "kslice" and (x.dtype != torch.float16 or not ops.qgemm_kslice_fits(
                            M, K, (N + 31) // 32, _min_group(pws[0]), u4, 0))) or
                        (name == "wide" and (x.dtype != torch.float16 or M < 9 or not ops.qgemm_wide_fits(
                            M, K, (N + 127) // 128, _min_group(pws[0]), 0)))):
                    continue
                try:
                    t = graph_time(lambda: [f(pw) for pw in pws]) / len(pws)
                    row[f"{name}_us"] = t * 1e6
                    row[f"{name}_gb_s"] = nbytes / t / 1e9
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_error"] = repr(e)[:200]
            rows.append(row)
    return rows


@torch.inference_mode()
def profile_table(fn, label: str, top: int = 14) -> list[dict]:
    """CUDA kernel time by kernel name for one call of fn() (torch.profiler), printed and returned."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows.append({"kernel": ev.key[:90], "calls": ev.count, "us": t})
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    print(f"\n-- profile {label}: {total:.0f} us of kernels")
    for r in rows[:top]:
        print(f"{r['us']:10.0f} us {r['calls']:6d}x  {r['kernel']}")
    return rows[:top]


def profile_prompt(model, fmt: str, top: int = 14) -> list[dict]:
    """profile_table of one 2,048-token prompt through the bench's prefill context."""
    kv = StaticKV(model, 1, 2048)
    ids = torch.randint(0, model.config.vocab_size, (2048,)).cuda()
    return profile_table(lambda: model.forward(ids, PrefillContext(kv, 2048)), f"{fmt} prompt 2048", top=top)


def bench_format(path: Path, fmt: str, bw: float, out: dict, quick: bool = False, prompt_only: bool = False,
                 decode_after_prompt: bool = False) -> None:
    """quick: CUDA-graph decode and the prompt only (no sweep, eager runs or profiles), for A/B runs;
    prompt_only: the prompt alone (A/B runs of the prompt path); decode_after_prompt: batch 1 and 32 graph decode
    again after the prompt (what the prompt leaves in L2: qdequant_chunks' persisting lines)."""
    from exl_core.loader import load_model
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model, _ = load_model(path, device="cuda", dtype=torch.float16, load_tokenizer=False)
    torch.cuda.synchronize()
    r = out[fmt] = {"load_s": time.perf_counter() - t0}
    nbytes = bytes_per_token(model)
    r["bytes_per_token_gb"] = nbytes / 1e9
    r["floor_bs1_tok_s"] = bw * 1e9 / nbytes
    if fmt == "gptq" and not quick:
        try:
            out["gemv_sweep"] = gemv_sweep(model)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            out["gemv_sweep_error"] = repr(e)[:300]
    for B in (() if prompt_only else (1, 8, 32)):
        for graphs in ((True,) if quick else (False, True)):
            key = f"bs{B}_decode_tok_s" + ("" if graphs else "_eager")
            try:
                r[key] = decode_tok_s(model, B, graphs)
            except Exception as e:  # noqa: BLE001 - a bench keeps going and reports the failure
                traceback.print_exc()
                r[key + "_error"] = repr(e)[:300]
        if f"bs{B}_decode_tok_s" not in r and f"bs{B}_decode_tok_s_eager" in r:
            r[f"bs{B}_decode_tok_s"] = r[f"bs{B}_decode_tok_s_eager"]
    # The decode runs' graphs and cached blocks released first: timed right after them, the prompt read lower than in a
    # process of its own (stop 49: EXL2 42,543.29 against 45,607.01-46,023.56 tok/s; NOTES, eighteenth session: after
    # gc + empty_cache it read near its own process's figure again; the cause is not isolated).
    gc.collect()
    torch.cuda.empty_cache()
    try:             # before the profiles: after a torch.profiler session launches cost more host time
        r["prompt2048_tok_s"] = prompt_tok_s(model)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        r["prompt2048_error"] = repr(e)[:300]
    for B in ((1, 32) if decode_after_prompt and not prompt_only else ()):
        r[f"bs{B}_decode_after_prompt_tok_s"] = decode_tok_s(model, B, True)
    if prompt_only and PROFILE_PROMPT:     # the prompt's kernels by name (A/B runs of the prompt path)
        try:
            r["profile_prompt2048"] = profile_prompt(model, fmt, top=24)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            r["profile_error"] = repr(e)[:300]
    if PROFILE and not quick and not prompt_only:
        try:
            r["profile_decode_bs1"] = profile_decode(model, 1)
            r["profile_decode_bs32"] = profile_decode(model, 32)
            r["profile_prompt2048"] = profile_prompt(model, fmt)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            r["profile_error"] = repr(e)[:300]
    r["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    del model
    torch.cuda.empty_cache()


def probe_parser(doc: str, json_name: str) -> argparse.ArgumentParser:
    """The command line of a decode probe on the bench's checkpoints (decode_knockout.py, decode_timeline.py)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--gptq", type=Path)
    ap.add_argument("--exl2", type=Path)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / json_name)
    return ap


def probe_record(benchmark: str, decode: str, key: str) -> dict:
    """A decode probe's JSON record (the bench's decode settings on: token-major paged K/V), `key` its empty list."""
    global TOKEN_MAJOR, PAGED_DECODE
    TOKEN_MAJOR, PAGED_DECODE = True, True
    return {"benchmark": benchmark, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "decode": decode, key: []}


def probe_formats(a, run_format) -> list:
    """run_format(path, fmt)'s rows for each checkpoint folder given (--gptq, --exl2), in that order."""
    return [row for fmt in ("gptq", "exl2") if getattr(a, fmt) is not None for row in run_format(getattr(a, fmt), fmt)]


def _write(out: dict, path: Path) -> None:
    text = json.dumps(out, indent=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(text + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gptq", type=Path)
    ap.add_argument("--exl2", type=Path)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "gpu_h200.json")
    ap.add_argument("--quick", action="store_true", help="graph decode and prompt only (A/B runs)")
    ap.add_argument("--prompt-only", action="store_true", help="the 2048-token prompt only (A/B runs)")
    ap.add_argument("--decode-after-prompt", action="store_true", help="batch 1 and 32 decode again after the prompt")
    ap.add_argument("--kv-layout", choices=("thd", "htd"), default="thd",
                    help="the bench's K/V cache: (B, T, Hkv, D) (default) or (B, Hkv, T, D) (A/B)")
    ap.add_argument("--decode-attn", choices=("paged", "sdpa"), default="paged",
                    help="decode attention: the paged kernel (default) or a masked SDPA over all slots (A/B)")
    ap.add_argument("--greedy", choices=("pick", "argmax"), default="pick",
                    help="each decode step's token: exl_core::greedy_pick (default) or torch's argmax (A/B)")
    a = ap.parse_args()
    global TOKEN_MAJOR, PAGED_DECODE, GREEDY_PICK
    TOKEN_MAJOR = a.kv_layout == "thd"
    PAGED_DECODE = a.decode_attn == "paged"
    GREEDY_PICK = a.greedy == "pick"
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                 "decode": f"{DECODE} tokens after a {PROMPT}-token prompt, greedy on device, CUDA graph per batch",
                 "pdl": os.environ.get("EXL_CORE_PDL", "1") != "0",
                 "kslice": os.environ.get("EXL_CORE_KSLICE", "1") != "0",
                 "wide": os.environ.get("EXL_CORE_WIDE", "1") != "0", "kv_layout": a.kv_layout,
                 "attn_cluster": os.environ.get("EXL_CORE_ATTN_CLUSTER", "1") != "0",
                 "rope_kv_fuse": os.environ.get("EXL_CORE_ROPE_KV_FUSE", "1") != "0",
                 "residual_add": os.environ.get("EXL_CORE_RESIDUAL_ADD", "1") != "0",
                 "dequant_l2": os.environ.get("EXL_CORE_DEQUANT_L2", "0") == "1",
                 "decode_attn": a.decode_attn if TOKEN_MAJOR else "sdpa",
                 "greedy": "greedy_pick" if GREEDY_PICK and has_cuda_kernel("greedy_pick") else "argmax",
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    bw = out["copy_bw_gb_s"] = copy_bandwidth()
    for fmt in ("gptq", "exl2"):
        p = getattr(a, fmt)
        if p is not None:
            bench_format(p, fmt, bw, out, a.quick or a.prompt_only, a.prompt_only, a.decode_after_prompt)
            _write(out, a.json)          # after each format: a timeout keeps what was measured
    for row in out.get("gemv_sweep", []):
        cells = "  ".join(f"{n} {row[n + '_us']:7.1f} us ({row[n + '_gb_s']:5.0f} GB/s)" for n in ("kslice", "skinny", "mma", "gemv", "dequant_mm")
                          if n + "_us" in row)
        errs = [k for k in row if k.endswith("_error")]
        print(f"K={row['K']:5d} N={row['N']:5d} M={row['M']:3d}: {cells} {errs if errs else ''}")
    print(f"\nGPU {out['gpu']}  copy bandwidth {bw:.0f} GB/s")
    keys = ["floor_bs1_tok_s", "bs1_decode_tok_s", "bs1_decode_tok_s_eager", "bs8_decode_tok_s",
            "bs8_decode_tok_s_eager", "bs32_decode_tok_s", "bs32_decode_tok_s_eager", "prompt2048_tok_s",
            "peak_mem_gb", "bytes_per_token_gb", "load_s"]
    fmts = [f for f in ("gptq", "exl2") if f in out]
    print(f"{'metric':28s}" + "".join(f"{f:>14s}" for f in fmts))
    for k in keys:
        print(f"{k:28s}" + "".join(f"{out[f][k]:14.1f}" if isinstance(out[f].get(k), float) else f"{'-':>14s}"
                                   for f in fmts))
    for f in fmts:
        for k, v in out[f].items():
            if k.endswith("error"):
                print(f"{f} {k}: {v}")


if __name__ == "__main__":
    main()
