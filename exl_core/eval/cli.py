"""`exl eval ppl | compare | task`: perplexity of a model, quantized variants side by side against a reference, and
multiple-choice task accuracy (eval/perplexity.py, eval/compare.py, eval/tasks.py)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional

from ..errors import ExlError, InputError


def _json(value) -> str:
    """JSON with inf / NaN (a broken variant's perplexity) as null: json.dumps writes Infinity, which is not JSON."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v
    return json.dumps(clean(value), allow_nan=False)


def _positive(text: str) -> int:
    from ..cli import positive_int
    return positive_int(text)


def _windows_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-d", "--data", required=True, help="UTF-8 text file")
    p.add_argument("--ctx", type=int, default=2048, help="tokens per window")
    p.add_argument("--windows", type=int, help="evaluate at most this many windows")
    p.add_argument("--stride", type=int, help="sliding windows advancing by this many tokens (without it, windows do "
                   "not overlap and the text's last partial window is not scored)")


def _common_args(p: argparse.ArgumentParser) -> None:
    from ..cli import positive_int
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=positive_int, help="CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="exl eval", description="Evaluate model folders")
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("ppl", help="perplexity of a model folder on a text file")
    p.add_argument("-m", "--model", required=True, help="model folder (dense, GPTQ or EXL2)")
    _windows_args(p)
    _common_args(p)
    p = sub.add_parser("compare", help="variants side by side against a reference on one text: perplexity, KL, "
                       "top-1 agreement, weight bytes (every model is loaded at once)")
    p.add_argument("-m", "--model", action="append", required=True,
                   help="a model folder; repeat it, the first is the reference (e.g. the dense model)")
    _windows_args(p)
    _common_args(p)
    p = sub.add_parser("task", help="multiple-choice accuracy by log-likelihood on a JSONL task file "
                       '({"context": ..., "choices": [...], "answer": index} a line)')
    p.add_argument("-m", "--model", required=True, help="model folder")
    p.add_argument("-t", "--task", required=True, help="JSONL task file")
    p.add_argument("--limit", type=_positive, help="score at most this many examples")
    _common_args(p)
    return ap


def _warn_ctx(a) -> None:
    """A window longer than the model's positions is scored anyway (rope extrapolates): say so."""
    from ..config import load_config
    for m in a.model if isinstance(a.model, list) else [a.model]:
        try:
            n = load_config(m).max_position_embeddings
        except ExlError:
            continue                                # the load itself reports the folder's problem
        if n and a.ctx > n:
            print(f"exl eval: warning: --ctx {a.ctx} is longer than {m}'s max_position_embeddings {n}",
                  file=sys.stderr)


def eval_main(argv: Optional[list[str]] = None) -> int:
    """`exl eval ...` (argv after 'eval'); returns 0, or 2 on a refused input (message on stderr)."""
    a = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    try:
        if a.what == "task":
            from .tasks import evaluate_task_file
            r = evaluate_task_file(a.model, a.task, a.limit, a.device, progress=not a.json)
            print(_json(r.as_dict()) if a.json else
                  f"examples: {r.examples}\nacc: {r.acc:.4f}\nacc_norm: {r.acc_norm:.4f}")
            return 0
        _warn_ctx(a)
        if a.what == "compare":
            from .compare import compare_folders, format_table
            if len(a.model) < 2:                    # before any model loads
                raise InputError("compare needs a reference and at least one variant: pass -m twice or more")
            rows = compare_folders(a.model, a.data, a.ctx, a.stride, a.windows, a.device, progress=not a.json)
            print(_json([r.as_dict() for r in rows]) if a.json else format_table(rows))
            return 0
        from .perplexity import perplexity_of_folder
        r = perplexity_of_folder(a.model, a.data, a.ctx, a.stride, a.windows, a.device, progress=not a.json)
    except ExlError as e:
        print(f"exl eval {a.what}: error: {e}", file=sys.stderr)
        return 2
    print(_json(r.as_dict()) if a.json else f"tokens: {r.tokens}\nwindows: {r.windows}\nperplexity: {r.ppl:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(eval_main())
