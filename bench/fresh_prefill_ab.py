"""A fresh prompt's prefill through the Generator on CUDA, by SDPA's causal mask against gathered pages, A/B.

Its attention by SDPA's causal mask over its own slots (cache/paged.py fresh_prefill_on; on by default since this ran in
stop 51, EXL_CORE_FRESH_PREFILL=0 turns it off) against paged attention over gathered pages under an explicit mask, in
one process, rounds alternated; and the two paths' logits of one prefill. Since stop 56 EXL_CORE_FRESH_PREFILL=0 also
turns off a later chunk's lower-right causal mask (chunk_prefill_on), so chunked rows compare both paths together.

    python bench/fresh_prefill_ab.py --model /tmp/exl_bench/gptq [--rounds 3]

Prints a table and writes bench/results/fresh_prefill_ab.json (and $OUT/ when OUT is set)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import gpu_model_cli, print_table, write_results  # noqa: E402
from exl_core.cache import Cache, paged  # noqa: E402
from gpu_generator import prompt_tok_s  # noqa: E402


def set_fresh(on: bool) -> None:
    os.environ["EXL_CORE_FRESH_PREFILL"] = "1" if on else "0"


CALLS = [0]          # sequence_causal_attention's calls: an "on" round in which it never ran would read as no difference


def _count_calls() -> None:
    real = paged.sequence_causal_attention

    def counted(*a):
        CALLS[0] += 1
        return real(*a)
    paged.sequence_causal_attention = counted


def checked(fresh: bool, fn):
    """fn()'s result, after checking that the causal-mask path ran (fresh) or did not."""
    before = CALLS[0]
    out = fn()
    ran = CALLS[0] > before
    if ran != fresh:
        raise SystemExit(f"EXL_CORE_FRESH_PREFILL={int(fresh)} but the causal-mask path {'ran' if ran else 'never ran'}"
                         " (a forced or disabled attention kernel, or a window narrower than the prompt?)")
    return out


@torch.inference_mode()
def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """Every row's logits of one fresh prefill over a paged cache (float32)."""
    cache = Cache(model, max_tokens=len(ids) + 64, page_size=256)
    table = cache.try_admit(ids, len(ids) + 8, len(ids), reuse=False)
    ctx = cache.context([table], [len(ids)])
    assert ctx.fresh
    return model.forward(torch.tensor(ids, device="cuda"), ctx).float()


def main() -> None:
    a, model = gpu_model_cli(__doc__, rounds=(int, 3), tokens=(int, 2048))
    ids = torch.randint(100, model.config.vocab_size, (a.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    _count_calls()
    set_fresh(True)
    on = checked(True, lambda: prefill_logits(model, ids))
    set_fresh(False)
    off = checked(False, lambda: prefill_logits(model, ids))
    diff = (on - off).abs().max().item()
    same_argmax = (on.argmax(-1) == off.argmax(-1)).float().mean().item()
    print(f"logits max |fresh - gathered| {diff:.4e} (max |logit| {off.abs().max().item():.3f}); argmax agree "
          f"{same_argmax:.4f} of {a.tokens} rows")
    rows = []
    for r in range(a.rounds):
        for fresh in ((True, False) if r % 2 == 0 else (False, True)):
            set_fresh(fresh)
            for chunk in (2048, 512):
                tok_s = checked(fresh, lambda: prompt_tok_s(model, a.tokens, chunk))
                rows.append({"round": r, "fresh": fresh, "chunk": chunk, "prompt_tok_s": tok_s})
                print_table(rows[-1:], list(rows[-1]))
    med = {}
    for fresh in (True, False):
        for chunk in (2048, 512):
            v = sorted(x["prompt_tok_s"] for x in rows if x["fresh"] == fresh and x["chunk"] == chunk)
            med[f"{'fresh' if fresh else 'gathered'}_chunk{chunk}_median"] = v[len(v) // 2]
    print(med)
    path = write_results("fresh_prefill_ab", {"model": str(a.model), "tokens": a.tokens, "rows": rows,
                                              "medians": med, "logits_max_abs_diff": diff,
                                              "argmax_agree": same_argmax})
    if os.environ.get("OUT"):
        shutil.copy(path, os.environ["OUT"])


if __name__ == "__main__":
    main()
