"""Perplexity of a model on a token stream (`exl eval ppl`: eval/cli.py).

Windows of `ctx` tokens. Without a stride they do not overlap and every window scores its
ctx-1 next-token predictions. With `stride` S the window start advances by S and each window
scores only the targets no earlier window scored (each token predicted once, with up to ctx-1
tokens of context: the sliding evaluation of HF's perplexity guide).

    ppl = exp( Σ −log p(t_i | t_<i) / #scored )
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..errors import InputError
from ..textfiles import read_utf8


@dataclass
class PplResult:
    ppl: float
    tokens: int          # scored predictions
    windows: int
    nll: float           # Σ negative log-likelihood (nats)

    def as_dict(self) -> dict:
        return {"ppl": self.ppl, "tokens": self.tokens, "windows": self.windows}


def window_spans(n_tokens: int, ctx: int, stride: Optional[int] = None,
                 max_windows: Optional[int] = None) -> list[tuple[int, int, int]]:
    """[(begin, end, first_target)]: feed tokens[begin:end], score targets first_target..end-1."""
    if ctx < 2:
        raise InputError(f"--ctx must be at least 2, got {ctx}")
    if n_tokens < 2:
        raise InputError(f"perplexity needs at least 2 tokens, the text has {n_tokens}")
    spans = []
    if stride is None:
        if n_tokens <= ctx:
            spans = [(0, n_tokens, 1)]
        else:
            spans = [(b, b + ctx, b + 1) for b in range(0, n_tokens - ctx + 1, ctx)]
    else:
        if stride < 1 or stride > ctx:
            raise InputError(f"--stride must be in 1..ctx ({ctx}), got {stride}")
        scored_to = 1                                   # next target not yet scored
        b = 0
        while scored_to < n_tokens:
            end = min(b + ctx, n_tokens)
            spans.append((b, end, max(scored_to, b + 1)))
            scored_to = end
            if end == n_tokens:
                break
            b += stride
    if max_windows is not None:
        if max_windows < 1:
            raise InputError(f"--windows must be ≥ 1, got {max_windows}")
        spans = spans[:max_windows]
    return spans


LogitsFn = Callable[[torch.Tensor], torch.Tensor]     # ids int64 [T] -> logits float [T, vocab]


@torch.inference_mode()
def perplexity_from_logits_fn(logits_fn: LogitsFn, ids: Sequence[int], ctx: int = 2048,
                              stride: Optional[int] = None, max_windows: Optional[int] = None,
                              progress: bool = False) -> PplResult:
    ids_t = torch.as_tensor(list(ids), dtype=torch.int64)
    spans = window_spans(len(ids_t), ctx, stride, max_windows)
    nll, count = 0.0, 0
    it = spans
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(spans, desc="perplexity", unit="window")
    for b, e, first in it:
        logits = logits_fn(ids_t[b:e]).float()                     # (e-b, vocab)
        pred = logits[first - 1 - b:e - 1 - b]                     # rows predicting targets first..e-1
        tgt = ids_t[first:e].to(pred.device)                       # the model's logits may be on a GPU
        lp = torch.log_softmax(pred, -1).gather(-1, tgt[:, None])[:, 0]
        nll -= lp.double().sum().item()
        count += len(tgt)
    return PplResult(ppl_from_nll(nll, count), count, len(spans), nll)


def ppl_from_nll(nll: float, count: int) -> float:
    """exp(mean NLL), inf past float range: a broken variant's logits give mean losses over ~709.78 nats, where
    math.exp raises OverflowError (it ended `exl eval compare` with a traceback, every row lost)."""
    try:
        return math.exp(nll / count)          # NaN stays NaN (a model with NaN logits)
    except OverflowError:
        return math.inf


def require_in_vocab(ids: Sequence[int], vocab_size: int, what: str) -> None:
    """An InputError where a token id has no row in the model's embedding: a tokenizer that does not belong to the
    model (the forward pass would fail deep inside with an IndexError)."""
    t = torch.as_tensor(ids, dtype=torch.int64)
    if not t.numel():
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= vocab_size:
        raise InputError(f"{what}: token id {hi if hi >= vocab_size else lo} is outside the model's vocabulary "
                         f"(size {vocab_size}); the tokenizer does not match the model")


def perplexity(model, ids: Sequence[int], ctx: int = 2048, stride: Optional[int] = None,
               max_windows: Optional[int] = None, progress: bool = False) -> PplResult:
    """Perplexity of an exl_core `Model` (dense, GPTQ or EXL2) on token ids."""
    require_in_vocab(ids, model.config.vocab_size, "perplexity")
    def logits_fn(window: torch.Tensor) -> torch.Tensor:
        return model.forward_batch(window[None].to(model.device))[0]
    return perplexity_from_logits_fn(logits_fn, ids, ctx, stride, max_windows, progress)


def perplexity_of_folder(model_dir, text_file, ctx: int = 2048, stride: Optional[int] = None,
                         max_windows: Optional[int] = None, device: str = "cpu", progress: bool = False) -> PplResult:
    from ..loader import load_model
    text = read_utf8(text_file)
    model, tok = load_model(model_dir, device=device)
    ids = tok.encode(text, add_bos=False, special=False)
    return perplexity(model, ids, ctx, stride, max_windows, progress)
