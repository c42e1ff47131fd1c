"""Where a graphed decode step's time goes: the bench's decode (bench/gpu_bench.py) with parts of the step
knocked out, one at a time, on the same loaded model and in the same process (run by bench/gpu.sh phase `knockout`).

Question: how much of the step do the small kernels between the projections cost on the critical path (and so what
could fusing them into the projections gain), against the projections themselves?

A knocked-out part returns its input instead of its result, so the numbers the step computes are garbage; only its
time is measured. Knock-outs: `norm` (every RMSNorm launch, and the residual add it carries: the RMSNorm modules and
the permuted norm of act-order weights; a norm folded into the q/k/v and gate/up kernels, GPTQ at 1..8 rows, has no
launch of its own and stays), `attn` (the paged attention; since rope and the K/V write moved into the attention
kernel, a rope_write_kv launch runs in its place, so this measures attention less that launch), `rope_attn` (both),
`head` (the fp16 lm_head: a memset of the logits instead),
and `all` (the three, leaving the projections, the embedding and the argmax). Also same-process A/B variants:
`kslice_mixed_off` (EXL2, batch 8: the dispatcher's rule that sends a mixed-width launch of at most one column tile
per SM to qgemm_kslice, `KSLICE_MIXED_ONE_WAVE`, off) and `attn_one_wave_off` (batches 8 and 32: the paged attention's
one-wave instance off, EXL_CORE_ATTN_ONE_WAVE=0, which the extension reads per call).

    python bench/decode_knockout.py --gptq /tmp/exl_bench/gptq --exl2 /tmp/exl_bench/exl2
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch

import gpu_bench
from exl_core.model import llama
from exl_core.ops import cuda_candidates

KNOCKOUTS = ("none", "norm", "attn", "rope_attn", "head", "all")


def _norm_passthrough(self, x, residual=None):
    return x if residual is None else (x, residual)


def _perm_norm_passthrough(x, weight, eps, perm, residual=None, site="mlp"):
    """llama.rms_norm_permuted knocked out: x as it is (the extended width of weights with extra rows cannot be)."""
    if perm.numel() != x.shape[-1]:
        raise ValueError("the norm knock-out cannot stand in for a norm that writes extra columns")
    return x if residual is None else (x, residual)


@contextmanager
def knocked_out(model, what: str):
    """Patches the parts `what` names for the duration (class attributes of the bench's context and RMSNorm, the
    model module's permuted norm, the model's head instance)."""
    parts = {"all": ("norm", "rope_attn", "head")}.get(what, (what,))
    saved = []
    if "norm" in parts:
        saved.append((llama.RMSNorm, "forward", llama.RMSNorm.forward))
        llama.RMSNorm.forward = _norm_passthrough
        saved.append((llama, "rms_norm_permuted", llama.rms_norm_permuted))
        llama.rms_norm_permuted = _perm_norm_passthrough
    if "attn" in parts or "rope_attn" in parts:
        ctx = gpu_bench.DecodeContext
        saved.append((ctx, "attend_rope", ctx.attend_rope))
        saved.append((ctx, "attend_rope_ordered", ctx.attend_rope_ordered))
        ctx.attend_rope_ordered = lambda self, *args: None          # the knocked-out attend_rope serves o too
        if "attn" in parts:
            def attend_rope(self, layer, q, k, v, cos_sin, scale, window):
                kc, vc = self._paged(layer)
                return gpu_bench.rope_write_kv(q, k, v, self.positions, cos_sin, kc, vc, self.slots)
        else:
            def attend_rope(self, layer, q, k, v, cos_sin, scale, window):
                self._paged(layer)
                return q
        ctx.attend_rope = attend_rope
    head_patched = False
    if "head" in parts:
        vocab = model.config.vocab_size
        head_patched = True
        model.lm_head.forward = lambda h: h.new_zeros(h.shape[0], vocab)
    try:
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        if head_patched:
            del model.lm_head.forward                 # the class's forward again (no instance attribute left)


@contextmanager
def variant_set(variant: str):
    """A same-process A/B variant (module docstring) for the duration; the previous settings come back after."""
    saved_rule, saved_env = cuda_candidates.KSLICE_MIXED_ONE_WAVE, os.environ.get("EXL_CORE_ATTN_ONE_WAVE")
    if variant == "kslice_mixed_off":
        cuda_candidates.KSLICE_MIXED_ONE_WAVE = False
    elif variant == "attn_one_wave_off":
        os.environ["EXL_CORE_ATTN_ONE_WAVE"] = "0"
    elif variant:
        raise ValueError(f"unknown variant {variant!r}")
    try:
        yield
    finally:
        cuda_candidates.KSLICE_MIXED_ONE_WAVE = saved_rule
        if saved_env is None:
            os.environ.pop("EXL_CORE_ATTN_ONE_WAVE", None)
        else:
            os.environ["EXL_CORE_ATTN_ONE_WAVE"] = saved_env


def run_format(path: Path, fmt: str, reps: int) -> list[dict]:
    from exl_core.loader import load_model
    model, _ = load_model(path, device="cuda", dtype=torch.float16, load_tokenizer=False)
    rows = []
    cases = [(B, k, "") for B in (1, 32) for k in KNOCKOUTS] + [(32, "none", "attn_one_wave_off"), (8, "none", ""),
                                                                (8, "none", "attn_one_wave_off")]
    if fmt == "exl2":
        cases += [(8, "none", "kslice_mixed_off")]
    for B, what, variant in cases:
        with knocked_out(model, what), variant_set(variant):
            tok_s = [gpu_bench.decode_tok_s(model, B, True) for _ in range(reps)]
        best = max(tok_s)
        row = {"format": fmt, "batch": B, "knockout": what, "variant": variant, "tok_s": tok_s,
               "step_ms": B / best * 1e3}
        rows.append(row)
        print(f"{fmt} bs{B:<3d} {what:10s} {variant:18s}: {' '.join(f'{t:9.1f}' for t in tok_s)} tok/s, "
              f"step {row['step_ms']:.4f} ms", flush=True)
    for B in (1, 8, 32):
        base = [r["step_ms"] for r in rows if r["batch"] == B and r["knockout"] == "none" and not r["variant"]]
        for r in rows:
            if base and r["batch"] == B and (r["knockout"] != "none" or r["variant"]):
                r["saved_ms"] = base[0] - r["step_ms"]
    del model
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = gpu_bench.probe_parser(__doc__, "decode_knockout_h200.json")
    ap.add_argument("--reps", type=int, default=2, help="graph decode runs per case (the best is the step time)")
    a = ap.parse_args()
    out = gpu_bench.probe_record("decode_knockout", f"{gpu_bench.DECODE} tokens after a {gpu_bench.PROMPT}-token "
                                 "prompt, CUDA graph, as gpu_bench.py", "rows")
    out["rows"] += gpu_bench.probe_formats(a, lambda p, fmt: run_format(p, fmt, a.reps))
    print(f"\n{'format':6s} {'batch':>5s} {'knockout':10s} {'variant':18s} {'step ms':>9s} {'saved ms':>9s}")
    for r in out["rows"]:
        saved = f"{r['saved_ms']:9.4f}" if "saved_ms" in r else f"{'-':>9s}"
        print(f"{r['format']:6s} {r['batch']:5d} {r['knockout']:10s} {r['variant']:18s} {r['step_ms']:9.4f} {saved}")
    gpu_bench._write(out, a.json)                 # and a copy to $OUT when set


if __name__ == "__main__":
    main()
