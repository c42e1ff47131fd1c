"""Where a graphed decode step's time goes: the bench's decode (bench/gpu_bench.py) with parts of the step
knocked out, one at a time, on the same loaded model and in the same process (run by bench/gpu.sh phase `knockout`).

Question: how much of the step do the small kernels between the projections cost on the critical path (and so what
could fusing them into the projections gain), against the projections themselves?

A knocked-out part returns its input instead of its result, so the numbers the step computes are garbage; only its
time is measured. Knock-outs: `norm` (every RMSNorm, and the residual add it carries), `attn` (the paged attention;
rope and the K/V write still run), `rope_attn` (both), `head` (the fp16 lm_head: a memset of the logits instead),
and `all` (the three, leaving the projections, the embedding and the argmax). Also, for EXL2 at batch 8, the
dispatcher's rule that sends a mixed-width launch of at most one column tile per SM to qgemm_kslice
(`KSLICE_MIXED_ONE_WAVE`) on and off.

    python bench/decode_knockout.py --gptq /tmp/exl_bench/gptq --exl2 /tmp/exl_bench/exl2
"""
from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import gpu_bench
from exl_core.model import llama
from exl_core.ops import cuda_candidates

KNOCKOUTS = ("none", "norm", "attn", "rope_attn", "head", "all")


def _norm_passthrough(self, x, residual=None):
    return x if residual is None else (x, residual)


@contextmanager
def knocked_out(model, what: str):
    """Patches the parts `what` names for the duration (class attributes of the bench's context and RMSNorm, the
    model's head instance)."""
    parts = {"all": ("norm", "rope_attn", "head")}.get(what, (what,))
    saved = []
    if "norm" in parts:
        saved.append((llama.RMSNorm, "forward", llama.RMSNorm.forward))
        llama.RMSNorm.forward = _norm_passthrough
    if "attn" in parts or "rope_attn" in parts:
        ctx = gpu_bench.DecodeContext
        saved.append((ctx, "attend_rope", ctx.attend_rope))
        if "attn" in parts:
            def attend_rope(self, layer, q, k, v, cos_sin, scale, window):
                kc, vc = self._paged(layer)
                return gpu_bench.rope_write_kv(q, k, v, self.positions, cos_sin, kc, vc, self.slots)
        else:
            def attend_rope(self, layer, q, k, v, cos_sin, scale, window):
                self._paged(layer)
                return q
        ctx.attend_rope = attend_rope
    head_forward = None
    if "head" in parts:
        vocab = model.config.vocab_size
        head_forward = model.lm_head.forward
        model.lm_head.forward = lambda h: h.new_zeros(h.shape[0], vocab)
    try:
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        if head_forward is not None:
            model.lm_head.forward = head_forward


def run_format(path: Path, fmt: str, reps: int) -> list[dict]:
    from exl_core.loader import load_model
    model, _ = load_model(path, device="cuda", dtype=torch.float16, load_tokenizer=False)
    rows = []
    cases = [(B, k, True) for B in (1, 32) for k in KNOCKOUTS]
    if fmt == "exl2":
        cases += [(8, "none", True), (8, "none", False)]
    for B, what, one_wave in cases:
        cuda_candidates.KSLICE_MIXED_ONE_WAVE = one_wave
        with knocked_out(model, what):
            tok_s = [gpu_bench.decode_tok_s(model, B, True) for _ in range(reps)]
        cuda_candidates.KSLICE_MIXED_ONE_WAVE = True
        best = max(tok_s)
        row = {"format": fmt, "batch": B, "knockout": what, "kslice_mixed_one_wave": one_wave, "tok_s": tok_s,
               "step_ms": B / best * 1e3}
        rows.append(row)
        print(f"{fmt} bs{B:<3d} {what:10s} one_wave={int(one_wave)}: {' '.join(f'{t:9.1f}' for t in tok_s)} tok/s, "
              f"step {row['step_ms']:.4f} ms", flush=True)
    for B in (1, 32):
        base = next(r["step_ms"] for r in rows if r["batch"] == B and r["knockout"] == "none")
        for r in rows:
            if r["batch"] == B and r["knockout"] != "none":
                r["saved_ms"] = base - r["step_ms"]
    del model
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gptq", type=Path)
    ap.add_argument("--exl2", type=Path)
    ap.add_argument("--reps", type=int, default=2, help="graph decode runs per case (the best is the step time)")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "decode_knockout_h200.json")
    a = ap.parse_args()
    gpu_bench.TOKEN_MAJOR, gpu_bench.PAGED_DECODE = True, True
    out = {"benchmark": "decode_knockout", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "decode": f"{gpu_bench.DECODE} tokens after a {gpu_bench.PROMPT}-token prompt, CUDA graph, as gpu_bench.py",
           "rows": []}
    for fmt in ("gptq", "exl2"):
        p = getattr(a, fmt)
        if p is not None:
            out["rows"] += run_format(p, fmt, a.reps)
    print(f"\n{'format':6s} {'batch':>5s} {'knockout':10s} {'step ms':>9s} {'saved ms':>9s}")
    for r in out["rows"]:
        saved = f"{r['saved_ms']:9.4f}" if "saved_ms" in r else f"{'-':>9s}"
        print(f"{r['format']:6s} {r['batch']:5d} {r['knockout']:10s} {r['step_ms']:9.4f} {saved}"
              + ("" if r["kslice_mixed_one_wave"] else "  (KSLICE_MIXED_ONE_WAVE off)"))
    text = json.dumps(out, indent=1) + "\n"
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], a.json.name).write_text(text)


if __name__ == "__main__":
    main()
