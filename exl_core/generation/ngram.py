"""Prompt-lookup (n-gram) drafting: no draft model, the draft is copied from the context.

If the last n tokens of a sequence occurred earlier in it, the tokens that followed that
earlier occurrence are proposed as the continuation. Longer n-grams are tried first and the
most recent earlier occurrence wins (a tie-break that favours the local topic).
Summaries, code edits and RAG answers repeat their context a lot, so this is a cheap win.
"""
from __future__ import annotations

from typing import Sequence


def ngram_draft(tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1,
                max_lookback: int = 4096) -> list[int]:
    """Up to k proposed next tokens for `tokens` (possibly fewer, or none when no n-gram of
    length min_ngram..max_ngram of its tail occurred before). Only the last `max_lookback`
    tokens are searched, so a step costs O(max_lookback * max_ngram) at most."""
    if k <= 0 or min_ngram < 1 or max_ngram < min_ngram:
        return []
    seq = list(tokens[-max_lookback:])
    L = len(seq)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        tail = seq[L - n:]
        # candidate start positions i with seq[i:i+n] == tail, i + n < L (something follows)
        for i in range(L - n - 1, -1, -1):
            if seq[i:i + n] == tail:
                return seq[i + n:i + n + k]
    return []


__all__ = ["ngram_draft"]
