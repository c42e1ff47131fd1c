"""Side by side: quantized variants of one model against a reference on the same text (`exl eval compare`).

Every model is loaded at once and fed the same windows (perplexity.window_spans), so no logits are stored: per
scored token, each variant's log-probabilities are set against the reference's (the first model, usually the dense
one). Per variant:

    ppl         its own perplexity on the windows' targets
    kl          mean KL(reference || variant) over the scored positions, nats (how far its next-token distribution
                moved; 0 for the reference)
    top1        fraction of scored positions where its argmax equals the reference's
    weight_gb   bytes of its safetensors files
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..errors import InputError
from ..textfiles import read_utf8
from .perplexity import ppl_from_nll, require_in_vocab, window_spans


_KL_ROWS = 128      # rows of a window's log-probabilities taken to float64 at once for the KL


@dataclass
class VariantResult:
    model: str
    weight_gb: float
    ppl: float
    kl: float
    top1: float
    tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


def weight_bytes(folder) -> int:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


@torch.inference_mode()
def compare_models(models: Sequence, ids: Sequence[int], ctx: int = 2048, stride: Optional[int] = None,
                   max_windows: Optional[int] = None, names: Optional[Sequence[str]] = None,
                   progress: bool = False) -> list[VariantResult]:
    """models[0] is the reference; each an exl_core Model on its own device. Returns one result a model."""
    if len(models) < 2:
        raise InputError("compare needs a reference and at least one variant (two models or more)")
    names = list(names) if names is not None else [f"model {i}" for i in range(len(models))]
    vocab = {m.config.vocab_size for m in models}
    if len(vocab) != 1:
        raise InputError(f"compare: the models' vocabularies differ ({sorted(vocab)}); variants of one model share one")
    require_in_vocab(ids, vocab.pop(), "compare")
    ids_t = torch.as_tensor(list(ids), dtype=torch.int64)
    spans = window_spans(len(ids_t), ctx, stride, max_windows)
    nll = [0.0] * len(models)
    kl = [0.0] * len(models)
    agree = [0] * len(models)
    count = 0
    it = spans
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(spans, desc="compare", unit="window")
    for b, e, first in it:
        window, tgt = ids_t[b:e], ids_t[first:e]
        ref_lp = None
        for i, m in enumerate(models):
            logits = m.forward_batch(window[None].to(m.device))[0]
            lp = torch.log_softmax(logits[first - 1 - b:e - 1 - b].float(), -1).cpu()   # rows predicting the targets
            nll[i] -= lp.gather(-1, tgt[:, None])[:, 0].double().sum().item()
            if ref_lp is None:
                ref_lp = lp
            for r in range(0, len(tgt), _KL_ROWS):      # float64 a slice of rows at a time: T x vocab stays small
                a, v = ref_lp[r:r + _KL_ROWS].double(), lp[r:r + _KL_ROWS].double()
                kl[i] += torch.nn.functional.kl_div(v, a, log_target=True, reduction="sum").item()
            agree[i] += int((lp.argmax(-1) == ref_lp.argmax(-1)).sum())
        count += len(tgt)
    return [VariantResult(names[i], 0.0, ppl_from_nll(nll[i], count), kl[i] / count, agree[i] / count, count)
            for i in range(len(models))]


def compare_folders(folders: Sequence, text_file, ctx: int = 2048, stride: Optional[int] = None,
                    max_windows: Optional[int] = None, device: str = "cpu",
                    progress: bool = False) -> list[VariantResult]:
    """compare_models on model folders (the first the reference), the text tokenized by the first one's tokenizer."""
    from ..loader import load_model
    text = read_utf8(text_file)
    models, tok = [], None
    for f in folders:
        m, t = load_model(f, device=device, load_tokenizer=tok is None)
        models.append(m)
        tok = tok or t
    ids = tok.encode(text, add_bos=False, special=False)
    out = compare_models(models, ids, ctx, stride, max_windows, [str(f) for f in folders], progress)
    for r, f in zip(out, folders):
        r.weight_gb = weight_bytes(f) / 1e9
    return out


def format_table(rows: Sequence[VariantResult]) -> str:
    ref = rows[0].ppl
    head = f"{'model':<40} {'weights GB':>10} {'ppl':>10} {'vs ref':>8} {'KL nats':>9} {'top-1':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        name = r.model if len(r.model) <= 40 else "..." + r.model[-37:]
        lines.append(f"{name:<40} {r.weight_gb:>10.3f} {r.ppl:>10.4f} {100 * (r.ppl / ref - 1):>+7.2f}% "
                     f"{r.kl:>9.5f} {100 * r.top1:>6.2f}%")
    return "\n".join(lines)
