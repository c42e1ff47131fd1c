"""Where a batch-1 CPU decode step's time goes, per-op Python layers vs the fused C++ stack.

One process, one model (SmolLM2-135M GPTQ 4-bit, int8 head, as bench/cpu_decode.py), the
native Generator decoding greedily. Each mode runs the same decode twice (warm-up, timed) and
splits each step's wall time into: the decoder layers (the `decoder_layers` dispatcher call:
the Python per-op loop or the C++ stack), the head (final norm + lm_head), sampling, and the
rest of the step (scheduler, context tensors, stop checks, streaming text). cpu_ms_per_token
is the process's CPU time per token: on a shared machine it moves less than wall time.
Also times the quantized matmuls of one decode step alone (the layers' kernel floor).

    python bench/cpu_decode_breakdown.py [--threads 1] [--new-tokens 128] [--format gptq] [--activations int8]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_results  # noqa: E402


class _Timer:
    def __init__(self):
        self.total = 0.0

    def wrap(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total += time.perf_counter() - t0
        return timed


def _decode(gen, prompt, n_new, timers=(), stack=None):
    from exl_core.generation import Job
    from exl_core.generation.sampling import SamplerSettings
    job = Job(prompt, max_new_tokens=n_new, sampler=SamplerSettings(temperature=0.0), stop_on_eos=False)
    gen.enqueue(job)
    gen.iterate()                                  # prefill (not timed)
    for t in timers:
        t.total = 0.0
    if stack is not None:
        stack.stage_times(True)                    # zeroes and starts the C++ stack's stage clock
    steps, t0, c0 = 0, time.perf_counter(), time.process_time()
    while gen.has_work():
        gen.iterate()
        steps += 1
    return steps, time.perf_counter() - t0, time.process_time() - c0


def _matmul_floor(model, reps=20) -> float:
    """Seconds for one decode step's quantized/dense matmuls of the layers alone (M = 1), each
    through the kernel the model's dispatch would pick (int8 activations where requested)."""
    from exl_core.ops.qmatmul import wants_int8
    calls = []
    for blk in model.layers:
        for m in (blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj, blk.self_attn.o_proj,
                  blk.mlp.gate_proj, blk.mlp.up_proj, blk.mlp.down_proj):
            x = torch.randn(1, m.in_features, dtype=model.dtype)
            if m.is_quantized:
                pw = m.packed
                op = torch.ops.exl_core.qmatmul_int8 if wants_int8(pw) else torch.ops.exl_core.qmatmul
                calls.append(lambda x=x, pw=pw, op=op: op(x, pw.qweight, pw.groups, pw.scale, pw.zero, pw.perm,
                                                          pw.bias))
            else:
                calls.append(lambda x=x, m=m: torch.ops.exl_core.dense_matmul(x, m.w_t, m.bias))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for c in calls:
            c()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--format", default="gptq", choices=["gptq", "exl2"])
    ap.add_argument("--activations", default="exact", choices=["exact", "int8"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from exl_core.cache import Cache
    from exl_core.generation import Generator
    from exl_core.generation import generator as gen_mod
    from exl_core.loader import load_model
    from exl_core.ops import decoder_layer, dispatch
    from exl_core.ops.dispatch import Candidate
    from quantized_models import quantized_smollm2

    model, tok = load_model(quantized_smollm2(args.format), head="int8", activations=args.activations)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a long story about a dragon."}],
                                     tokenize=True)
    layers_t, head_t, sample_t = _Timer(), _Timer(), _Timer()
    decoder_layer.DISPATCH.candidates = [Candidate(c.name, c.check, layers_t.wrap(c.run))
                                         for c in decoder_layer.DISPATCH.candidates]
    model.lm_head.forward = head_t.wrap(model.lm_head.forward)
    model.norm.forward = head_t.wrap(model.norm.forward)
    gen_mod.sample_batch = sample_t.wrap(gen_mod.sample_batch)

    rows = []
    for mode in ("python", "cpu_layer"):
        dispatch._FORCED["decoder_layers"] = mode
        gen = Generator(model, Cache(model, max_tokens=len(prompt) + args.new_tokens + 64), tok)
        _decode(gen, prompt, args.new_tokens)                       # warm-up
        stack = model._native_stack().obj if mode == "cpu_layer" else None
        steps, wall, cpu = _decode(gen, prompt, args.new_tokens, (layers_t, head_t, sample_t), stack)
        stages = {k: v / steps * 1e3 for k, v in stack.stage_times(False).items()} if stack is not None else {}
        ms = lambda s: s / steps * 1e3  # noqa: E731
        rows.append({"layers_path": mode, "ms_per_token": ms(wall), "tok_s": steps / wall, "cpu_ms_per_token": ms(cpu),
                     "layers_ms": ms(layers_t.total), "head_ms": ms(head_t.total), "sample_ms": ms(sample_t.total),
                     "rest_ms": ms(wall - layers_t.total - head_t.total - sample_t.total),
                     "stack_stage_ms": stages})
    dispatch._FORCED.pop("decoder_layers")
    floor = _matmul_floor(model) * 1e3
    for r in rows:
        r["layer_matmuls_ms"] = floor
        r["layers_other_ms"] = r["layers_ms"] - floor
    rows[1]["speedup"] = rows[0]["ms_per_token"] / rows[1]["ms_per_token"]
    cols = ["layers_path", "ms_per_token", "cpu_ms_per_token", "tok_s", "layers_ms", "layer_matmuls_ms", "layers_other_ms", "head_ms",
            "sample_ms", "rest_ms", "speedup"]
    print_table(rows, cols)
    print("C++ stack, ms per token by stage: " + ", ".join(f"{k} {v:.3f}" for k, v in rows[1]["stack_stage_ms"].items()))
    suffix = "" if args.activations == "exact" else f"_{args.activations}"
    write_results(f"cpu_decode_breakdown_{args.format}{suffix}_{args.threads}thread",
                  {"threads": args.threads, "new_tokens": args.new_tokens, "format": args.format,
                   "activations": args.activations, "rows": rows})


if __name__ == "__main__":
    main()
