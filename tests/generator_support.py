"""Shared by the Generator tests: `TinyLM` (a small stand-in model with the
`forward(input_ids, ctx)` protocol of exl_core.model.llama.Model, so scheduler, cache and
streaming logic are tested independently of the model code), a character tokenizer, the
cacheless greedy reference and pool checks."""
from __future__ import annotations

import random
import types

import pytest
import torch

from exl_core.generation.sampling import SamplerSettings
from exl_core.model.context import ContiguousContext

GREEDY = SamplerSettings(temperature=0.0)


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: one thread avoids OpenMP spin-waits when the cores are shared
    (2 threads ran these tests ~50x slower on a loaded 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class TinyLM(torch.nn.Module):
    """Random attention-only LM: embed -> N x [rope attention, normalise] -> head."""

    def __init__(self, vocab=300, hidden=64, layers=2, heads=4, kv=2, window=None, seed=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed if seed is not None else random.randrange(1 << 30))
        d = hidden // heads
        self.config = types.SimpleNamespace(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=kv, head_dim=d, sliding_window=window, max_position_embeddings=4096,
            eos_token_ids=[])

        def r(*s):
            return torch.randn(*s, generator=g) * 0.3
        self.emb = r(vocab, hidden)
        self.w = [dict(q=r(hidden, heads * d), k=r(hidden, kv * d), v=r(hidden, kv * d), o=r(heads * d, hidden))
                  for _ in range(layers)]
        self.head = r(hidden, vocab) * 3
        self.h, self.kv, self.d, self.window = heads, kv, d, window

    device = property(lambda self: torch.device("cpu"))
    dtype = property(lambda self: torch.float32)

    def _rope(self, x, pos):                       # x (T, H, D)
        d = self.d
        f = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        a = pos[:, None].float() * f[None]
        c, s = a.cos()[:, None], a.sin()[:, None]
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)

    def forward(self, ids, ctx):
        x = self.emb[ids]                          # (T, hidden)
        t = x.shape[0]
        for i, w in enumerate(self.w):
            q = self._rope((x @ w["q"]).view(t, self.h, self.d), ctx.positions)
            k = self._rope((x @ w["k"]).view(t, self.kv, self.d), ctx.positions)
            v = (x @ w["v"]).view(t, self.kv, self.d)
            x = x + ctx.attend(i, q, k, v, self.d ** -0.5, self.window).reshape(t, -1) @ w["o"]
            x = x / x.norm(dim=-1, keepdim=True) * 4
        if ctx.logit_rows is not None:
            x = x[ctx.logit_rows]
        return (x @ self.head).float()


class CharTokenizer:
    """Stand-in tokenizer: id i <-> PIECES[i]; text encodes one character per token."""
    PIECES = [chr(ord("a") + i % 26) for i in range(260)] + [" ", "S", "T", "OP", "xx ", "OP yy", "é"[0]] + \
        [f"<{i}>" for i in range(267, 299)] + ["</s>"]
    eos_token_ids = {299}
    bos_token_id = None
    byte_fallback_ids = frozenset()
    special_ids = frozenset({299})

    def decode(self, ids, skip_special=True):
        return "".join("" if (skip_special and i == 299) else self.PIECES[i] for i in ids)

    def encode(self, text, add_bos=None, special=True):
        return [ord(c) - ord("a") if "a" <= c <= "z" else 260 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(m["content"] for m in messages) + "z"


def reference_greedy(model, prompt, n, window=None):
    """Greedy continuation by recomputing the whole sequence each step (no cache)."""
    ids, out = list(prompt), []
    for _ in range(n):
        logits = model.forward(torch.tensor(ids), ContiguousContext([len(ids)], [None]))
        t = int(logits[-1].argmax())
        out.append(t)
        ids.append(t)
    return out


def assert_greedy(model, prompt, generated):
    """Teacher-forced check in one cacheless pass: token k must be the argmax after
    prompt + generated[:k]."""
    ids = list(prompt) + list(generated[:-1])
    logits = model.forward(torch.tensor(ids), ContiguousContext([len(ids)], [None]))
    want = logits[len(prompt) - 1:].argmax(-1).tolist()
    assert list(generated) == want


def run_all(gen):
    results = []
    while gen.has_work():
        results.extend(gen.iterate())
    return results


def assert_pool_idle(cache):
    pool = cache.pool
    pool.check()
    assert pool.reserved == 0
    assert all(pool.ref(p) == 0 for p in range(pool.num_pages))
    assert pool.num_free + pool.num_cached_unreferenced == pool.num_pages


def rand_prompt(n, vocab=260):
    return [random.randrange(vocab) for _ in range(n)]
