"""The per-token sampling pipeline (the settings it applies: sampler_settings.py, re-exported here).

Every job carries a `SamplerSettings`. Each step the generator hands this module the job's
float32 logits row [V], its token history and its own `torch.Generator`; the pipeline below
turns them into one probability distribution and draws from it. The order is fixed:

    1. logit bias (added) and banned tokens (set to -inf)
    2. repetition penalty, HF/CTRL style: on tokens seen in the penalty window, positive
       logits are divided by the penalty and negative ones multiplied by it
    3. frequency / presence penalties, OpenAI style:
       logit -= count * frequency_penalty + (count > 0) * presence_penalty
    4. temperature (unless temperature_last)
    5. top-k   keep the k largest logits (ties broken towards the lowest token id)
    6. top-p   keep the smallest set of most likely tokens whose mass reaches p
    7. min-p   keep tokens with p >= min_p * p_max
    8. typical keep the locally typical set (Meister et al. 2022, as HF TypicalLogitsWarper)
    9. temperature (if temperature_last)
   10. softmax -> draw by inverse CDF with one uniform from the job's generator

Steps 5-8 each see the renormalised distribution left by the previous steps. temperature == 0
means greedy: steps 1-3 still apply, then the distribution is the one-hot of the argmax
(lowest token id on ties) and no random number is consumed.

All arithmetic is float64 internally: it costs little at vocabulary size and keeps the
filters' thresholds (cumulative sums compared with p) stable.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from ..errors import InputError, SamplerError, is_int
from .logprobs import check_row_max, chosen_logprobs, native_lse
from .sampler_settings import History, SamplerSettings


# ----------------------------------------------------------------------------------------
# Pipeline on a batch of rows: x float64 [B, V], one SamplerSettings per row.
# ----------------------------------------------------------------------------------------

def _check_logits(logits: torch.Tensor, batched: bool) -> None:
    want = 2 if batched else 1
    if not isinstance(logits, torch.Tensor) or logits.dim() != want or logits.shape[-1] == 0:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise InputError(f"logits must be a {'[B, V]' if batched else '[V]'} float tensor, got {shape}")
    if not logits.is_floating_point():
        raise InputError(f"logits must be floating point, got {logits.dtype}")


def _window(history: History, prompt_len: int, s: SamplerSettings) -> Optional[torch.Tensor]:
    """Token ids (int64 [n]) the penalties look at: the last `penalty_range` tokens of the
    history, minus the first `prompt_len` when the prompt is not penalised."""
    if history is None or s.penalty_range == 0:
        return None
    n = history.numel() if isinstance(history, torch.Tensor) else len(history)
    start = 0 if s.penalize_prompt else max(0, int(prompt_len))
    if s.penalty_range > 0:
        start = max(start, n - s.penalty_range)
    if isinstance(history, torch.Tensor):
        return history.reshape(-1)[start:]
    return torch.tensor(history[start:] if isinstance(history, list) else list(history)[start:],
                        dtype=torch.int64)


def _adjust(x: torch.Tensor, settings: list[SamplerSettings], histories, prompt_lens) -> None:
    """Steps 1-3 in place on x [B, V], batched over rows as flat (row, token) lists so the
    work is proportional to the biases and histories, not to B * V."""
    B, V = x.shape
    dev = x.device
    br, bt, bv, nr, nt = [], [], [], [], []             # bias rows/tokens/values, ban rows/tokens
    for b, s in enumerate(settings):
        if s.logit_bias:
            br += [b] * len(s.logit_bias)
            bt += list(s.logit_bias.keys())
            bv += list(s.logit_bias.values())
        if s.banned_tokens:
            nr += [b] * len(s.banned_tokens)
            nt += list(s.banned_tokens)
    if br:
        x.index_put_((torch.tensor(br, device=dev), torch.tensor(bt, device=dev)),
                     torch.tensor(bv, dtype=x.dtype, device=dev), accumulate=True)
    if nr:
        x[torch.tensor(nr, device=dev), torch.tensor(nt, device=dev)] = -math.inf

    rows, wins = [], []
    for b, s in enumerate(settings):
        if s.uses_history:
            win = _window(histories[b], prompt_lens[b], s)
            if win is not None and win.numel():
                rows.append(b)
                wins.append(win.to(device=dev, dtype=torch.int64))
    if not rows:
        return
    rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
    lens = torch.tensor([w.numel() for w in wins], dtype=torch.int64, device=dev)
    toks = torch.cat(wins)
    if int(toks.min()) < 0:
        raise InputError(f"token history contains a negative id ({int(toks.min())})")
    keys = torch.repeat_interleave(rows_t, lens) * V + toks                # row * V + token
    # Ids past the head (embedding vocab larger than the output vocab) can never be drawn,
    # so there is nothing to penalise: drop them as HF does.
    keys = keys[toks < V]
    keys, counts = torch.unique(keys, return_counts=True)                  # distinct (row, token)
    r, t = keys // V, keys % V

    def per_pair(getter):                    # a per-row parameter, gathered for every pair
        table = torch.zeros(B, dtype=x.dtype, device=dev)
        table[rows_t] = torch.tensor([getter(settings[b]) for b in rows], dtype=x.dtype, device=dev)
        return table[r]

    rep, freq, pres = (per_pair(lambda s: s.repetition_penalty), per_pair(lambda s: s.frequency_penalty),
                       per_pair(lambda s: s.presence_penalty))
    vals = x[r, t]
    vals = torch.where(vals < 0, vals * rep, vals / rep)      # HF/CTRL: always towards less likely
    x[r, t] = vals - counts.to(x.dtype) * freq - pres


def _on_rows(x: torch.Tensor, active: torch.Tensor, fn) -> None:
    """Run fn(sub [R, V], rows [R]) in place on the active rows of x [B, V]; without a
    gather/scatter copy when every row is active (the common case)."""
    if bool(active.all()):
        fn(x, torch.arange(x.shape[0], device=x.device))
    else:
        rows = active.nonzero().squeeze(1)
        sub = x[rows]
        fn(sub, rows)
        x[rows] = sub


def _temper(sub: torch.Tensor, temps: Union[torch.Tensor, float]) -> None:
    """sub = (sub - max) / T in place (T: a float or per-row [R]). Subtracting the max first
    means a tiny T can only push logits towards -inf, never overflow to +inf."""
    sub.sub_(sub.amax(dim=1, keepdim=True)).div_(temps if isinstance(temps, float) else temps[:, None])


def _top_k(x: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:
    """Keep mask [B, V] of the k largest per row; among values equal to the k-th largest the
    lowest token ids win, so exactly k survive."""
    kmax = int(ks.max())
    thr = torch.topk(x, kmax, dim=1).values.gather(1, (ks - 1)[:, None])   # [B, 1]
    greater = x > thr
    eq = x == thr
    n_eq = ks[:, None] - greater.sum(dim=1, keepdim=True)                 # how many ties survive
    return greater | (eq & (eq.cumsum(dim=1) <= n_eq))


# A full sort of the vocabulary costs ~10 ms on CPU; the sets that top-p and typical keep are
# usually small, so they look at the best `k` candidates (torch.topk) and grow k only when
# the answer might lie beyond them.
_FIRST_K = 64
_GROW = 8


def _top_p(x: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """Keep mask [B, V] of the smallest prefix (logit desc, then token id asc) whose mass
    reaches p."""
    B, V = x.shape
    # Weights relative to the row's max and their total, compared unnormalised: tied tokens weigh exactly 1 each
    # and sum exactly, where probabilities exp(v - lse) carried lse's rounding (a few ulps of |lse|): tied tokens
    # whose mass before is exactly p (two of 0.5 at p = 0.5) read as below p and one too many was kept
    top = x.amax(dim=1, keepdim=True)                                  # [B, 1], finite (a live row)
    total = (x - top).exp().sum(dim=1, keepdim=True)                   # [B, 1]
    k = min(V, _FIRST_K)
    while True:
        vals, idx = torch.topk(x, k, dim=1)                             # [B, k], desc, ties arbitrary
        idx, perm = torch.sort(idx, dim=1)                              # by id, then stable by value:
        vals, perm = torch.sort(vals.gather(1, perm), dim=1, descending=True, stable=True)
        idx = idx.gather(1, perm)                                       # desc value, asc id on ties
        weights = (vals - top).exp()
        before = torch.zeros_like(weights)                              # weight strictly before each
        before[:, 1:] = torch.cumsum(weights, dim=1)[:, :-1]
        slack = (torch.arange(k, device=x.device, dtype=x.dtype) + 2) * torch.finfo(x.dtype).eps   # p * total's
        keep = before < ps[:, None] * total * (1 - slack)               # [B, k], a prefix
        keep[:, 0] = True                                               # the best token always stays
        n = keep.sum(dim=1, keepdim=True)
        # Done when the last kept value is above the smallest candidate: then every token
        # that ties with or beats it is among the candidates, and the prefix is exact.
        if k == V or bool(((n < k) & (vals.gather(1, n - 1) > vals[:, -1:])).all()):
            return torch.zeros(B, V, dtype=torch.bool, device=x.device).scatter_(1, idx, keep)
        k = min(V, k * _GROW)


def _min_p(x: torch.Tensor, ms: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(x, dim=1)
    return probs >= ms[:, None] * probs.amax(dim=1, keepdim=True)


def _typical(x: torch.Tensor, masses: torch.Tensor) -> torch.Tensor:
    """Keep the tokens whose surprise -log p is closest to the entropy H, growing the set in
    that order until its mass reaches `typical`; every token as close as the last one added
    is kept too (HF semantics)."""
    B, V = x.shape
    logp = torch.log_softmax(x, dim=1)
    p = logp.exp()
    ent = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=1, keepdim=True)   # [B, 1]
    dist = (-logp - ent).abs()                                     # +inf for -inf logits
    k = min(V, _FIRST_K)
    while True:
        neg, order = torch.topk(-dist, k, dim=1)                   # k closest, ascending dist
        cum = torch.cumsum(p.gather(1, order), dim=1)
        last = (cum < masses[:, None]).sum(dim=1, keepdim=True)    # [B, 1]
        # The order among equal distances does not change the threshold, so any k closest
        # candidates will do once the mass is reached inside them.
        if k == V or bool((last < k).all()):
            thr = -neg.gather(1, last.clamp_(max=k - 1))     # >= the smallest distance,
            return dist <= thr                                # so the closest token survives
        k = min(V, k * _GROW)


# Once a filter leaves at most V / _COMPACT tokens, the later ones work on those alone.
_COMPACT = 8


def _filter_row(x: torch.Tensor, s: SamplerSettings) -> None:
    """Steps 4-9 in place on one row x [1, V] float64 (not greedy)."""
    V = x.shape[1]
    dev = x.device

    def one(v, dtype=torch.float64):
        return torch.tensor([v], dtype=dtype, device=dev)

    if s.temperature != 1.0 and not s.temperature_last:
        _temper(x, float(s.temperature))
    steps = []
    if 0 < s.top_k < V:
        steps.append(lambda w: _top_k(w, one(s.top_k, torch.int64)))
    if s.top_p < 1.0:
        steps.append(lambda w: _top_p(w, one(s.top_p)))
    if s.min_p > 0.0:
        steps.append(lambda w: _min_p(w, one(s.min_p)))
    if s.typical < 1.0:
        steps.append(lambda w: _typical(w, one(s.typical)))
    work, cand = x, None          # cand: ascending ids of the compacted tokens (keeps id order)
    for i, fn in enumerate(steps):
        keep = fn(work)
        work.masked_fill_(~keep, -math.inf)
        if cand is None and i + 1 < len(steps) and int(keep.sum()) * _COMPACT <= V:
            cand = keep[0].nonzero().squeeze(1)
            work = work[:, cand]                                        # [1, n] copy
    if s.temperature != 1.0 and s.temperature_last:
        _temper(work, float(s.temperature))
    if cand is not None:
        x.fill_(-math.inf)
        x[0, cand] = work[0]


def _filter_batch(x: torch.Tensor, settings: list[SamplerSettings], greedy: torch.Tensor) -> None:
    """Steps 4-9 in place on x [B, V], all rows at once with per-row parameters (for GPUs,
    where one launch per op for the whole batch beats a loop over rows)."""
    V = x.shape[1]
    dev = x.device

    def col(getter, dtype=torch.float64):
        return torch.tensor([getter(s) for s in settings], dtype=dtype, device=dev)

    sampled = ~greedy
    temps = col(lambda s: s.temperature if s.temperature > 0 else 1.0)
    last = col(lambda s: s.temperature_last, torch.bool)
    t_first = sampled & (temps != 1.0) & ~last
    t_last = sampled & (temps != 1.0) & last
    if t_first.any():
        _on_rows(x, t_first, lambda sub, rows: _temper(sub, temps[rows]))
    ks = col(lambda s: min(s.top_k, V), torch.int64)      # top_k >= V keeps every token (any int is valid)
    ps, ms, tys = col(lambda s: s.top_p), col(lambda s: s.min_p), col(lambda s: s.typical)
    filters = (   # (rows where active, keep-mask function), in pipeline order
        (sampled & (ks > 0) & (ks < V), lambda sub, rows: _top_k(sub, ks[rows])),
        (sampled & (ps < 1.0), lambda sub, rows: _top_p(sub, ps[rows])),
        (sampled & (ms > 0.0), lambda sub, rows: _min_p(sub, ms[rows])),
        (sampled & (tys < 1.0), lambda sub, rows: _typical(sub, tys[rows])),
    )
    for active, fn in filters:
        if active.any():
            _on_rows(x, active, lambda sub, rows: sub.masked_fill_(~fn(sub, rows), -math.inf))
    if t_last.any():
        _on_rows(x, t_last, lambda sub, rows: _temper(sub, temps[rows]))


def _row_by_row(x: torch.Tensor) -> bool:
    """Work row by row on CPU when rows are big: a float64 row (V = 49152: 384 KiB) stays in
    cache through the filters' many passes, a [B, V] block does not (about 2x at B = 8).
    Small rows go batched, where the per-row Python overhead would dominate."""
    return x.device.type == "cpu" and x.shape[1] >= 4096


def _filtered_logits(x: torch.Tensor, settings: list[SamplerSettings], histories, prompt_lens
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-9 in place on x [B, V] float64. Returns (x, greedy_rows bool [B]); greedy rows
    are left after step 3 (the caller takes their argmax)."""
    B = x.shape[0]
    _adjust(x, settings, histories, prompt_lens)
    mx = x.amax(dim=1)
    if bool(torch.isnan(mx).any() | torch.isposinf(mx).any()):    # finite logits before: the settings overflowed
        b = int((torch.isnan(mx) | torch.isposinf(mx)).nonzero()[0])
        s = settings[b]
        raise SamplerError(f"row {b}: the penalties or logit bias overflowed the logits to inf / NaN "
                           f"(repetition_penalty={s.repetition_penalty}, frequency_penalty={s.frequency_penalty}, "
                           f"presence_penalty={s.presence_penalty}); use values of a sensible size")
    alive = mx > -math.inf
    if not bool(alive.all()):
        b = int((~alive).nonzero()[0])
        raise SamplerError(f"row {b}: every token is banned or has logit -inf; nothing can be sampled "
                           "(check banned_tokens / logit_bias)")
    greedy = [s.is_greedy for s in settings]
    if B == 1 or _row_by_row(x):
        for b, s in enumerate(settings):
            if not greedy[b]:
                _filter_row(x[b:b + 1], s)
    else:
        _filter_batch(x, settings, torch.tensor(greedy, device=x.device))
    return x, torch.tensor(greedy, device=x.device)


def _prepare(logits: torch.Tensor, settings, histories, prompt_lens) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the arguments; return the filtered float64 logits [B, V] and the greedy mask [B]."""
    _check_logits(logits, batched=True)
    B, V = logits.shape
    if isinstance(settings, SamplerSettings):
        settings = [settings] * B
    if len(settings) != B:
        raise InputError(f"got {len(settings)} SamplerSettings for {B} logit rows")
    histories = [None] * B if histories is None else list(histories)
    prompt_lens = [0] * B if prompt_lens is None else list(prompt_lens)
    if len(histories) != B or len(prompt_lens) != B:
        raise InputError(f"got {len(histories)} histories / {len(prompt_lens)} prompt lengths for {B} rows")
    for s in {id(s): s for s in settings}.values():        # each distinct object once
        if not isinstance(s, SamplerSettings):
            raise InputError(f"expected SamplerSettings, got {type(s).__name__}")
        s.validate(V)
    x = logits.to(torch.float64, copy=True)
    mx = x.amax(dim=1)                     # NaN propagates through max: one pass checks both
    if bool(torch.isnan(mx).any() | torch.isposinf(mx).any()):
        raise InputError("logits contain NaN or +inf; the model output is corrupt")
    return _filtered_logits(x, settings, histories, prompt_lens)


def processed_probs_batch(logits: torch.Tensor, settings: Union[SamplerSettings, Sequence[SamplerSettings]],
                          histories: Optional[Sequence[History]] = None,
                          prompt_lens: Optional[Sequence[int]] = None,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """logits [B, V] -> the exact distributions [B, V] `sample_batch` draws from."""
    x, greedy = _prepare(logits, settings, histories, prompt_lens)
    probs = torch.softmax(x, dim=1)
    if greedy.any():
        rows = greedy.nonzero().squeeze(1)
        onehot = torch.zeros(rows.numel(), x.shape[1], dtype=probs.dtype, device=probs.device)
        onehot.scatter_(1, x[rows].argmax(dim=1, keepdim=True), 1.0)   # argmax: first max on ties
        probs[rows] = onehot
    return probs.to(dtype)


def processed_probs(logits: torch.Tensor, settings: SamplerSettings, history: History = None, *,
                    prompt_len: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """logits [V] -> the distribution [V] that `sample` draws from: every filter applied,
    renormalised; greedy gives the one-hot of the argmax (lowest id on ties). Pure: the same
    arguments always give the same result (speculative decoding uses it for p and q).

    history: token ids so far (prompt + generated); prompt_len: how many of them are prompt
    (only used when settings.penalize_prompt is False)."""
    _check_logits(logits, batched=False)
    return processed_probs_batch(logits[None], [settings], [history], [prompt_len], dtype)[0]


def _draw(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over token ids: filtered logits [B, V] float64, u [B] in [0, 1) -> ids [B]:
    the first token whose cumulative mass exceeds u * total (total ~ 1, exactly the last cdf
    value). A token with zero mass is never the first to exceed, so it is never chosen."""
    w = torch.softmax(x, dim=1)
    cdf = torch.cumsum(w, dim=1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    over = idx >= x.shape[1]                # u * total rounded up to total
    if bool(over.any()):
        last_nz = x.shape[1] - 1 - (w.flip(1) > 0).to(torch.int8).argmax(dim=1)
        idx = torch.where(over, last_nz, idx)
    return idx


def _uniform(rng: Optional[torch.Generator]) -> float:
    if rng is None:
        return float(torch.rand((), dtype=torch.float64))
    return float(torch.rand((), generator=rng, dtype=torch.float64, device=rng.device))


def _plain_greedy(logits, settings, histories, rngs, prompt_lens) -> Optional[tuple]:
    """sample_batch's result for the common decode case, every row greedy with no bias, ban or
    penalty (steps 1-3 change nothing), or None. Same checks and same answer as the general
    path without its float64 copy of the logits: argmax of the exactly widened values is the
    argmax of the originals (first max on ties either way), and one max serves the NaN/+inf
    check, the all -inf check and the logprob: (ids, logprobs, row maxima), the maxima still to be
    checked (logprobs.check_row_max) by the caller."""
    if not (isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.dtype == torch.float32):
        return None
    B, V = logits.shape
    if V == 0:
        return None
    one = isinstance(settings, SamplerSettings)
    distinct = [settings] if one else list({id(s): s for s in settings}.values())
    if (not one and len(settings) != B) or not all(
            isinstance(s, SamplerSettings) and s.is_greedy and not s.logit_bias and not s.banned_tokens
            and not s.uses_history for s in distinct):
        return None
    for arg in (histories, rngs, prompt_lens):
        if arg is not None and len(arg) != B:
            return None           # the general path raises the right error
    for s in distinct:
        s.validate(V)
    if native_lse(logits):
        ids, _, m, logprobs = torch.ops.exl_core.greedy_pick(logits)  # argmax and lse: two C++ passes
        return ids, logprobs, m                                       # = chosen_logprobs(logits, ids, lse)
    m = logits.amax(dim=1)                                            # [B]
    ids = logits.argmax(dim=1)
    mc = m[:, None]
    lse = mc + (logits - mc).exp_().sum(dim=1, keepdim=True).log_()   # lse_rows with the max known
    return ids, (logits.gather(1, ids[:, None]) - lse).squeeze(1), m


def sample_batch_unchecked(logits: torch.Tensor, settings, histories=None, rngs=None, prompt_lens=None
                           ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """sample_batch's (ids, logprobs) and, where its common greedy path would read the row maxima back to check them
    (a wait for the device), those maxima unchecked: the caller passes them to logprobs.check_row_max once it reads
    the ids (generation/lookahead.py reads them together and launches the next step before that).  Elsewhere the
    maxima are None: sample_batch checked."""
    fast = _plain_greedy(logits, settings, histories, rngs, prompt_lens)
    if fast is not None:
        return fast
    return (*sample_batch(logits, settings, histories, rngs, prompt_lens), None)


def sample_batch(logits: torch.Tensor, settings: Union[SamplerSettings, Sequence[SamplerSettings]],
                 histories: Optional[Sequence[History]] = None,
                 rngs: Optional[Sequence[Optional[torch.Generator]]] = None,
                 prompt_lens: Optional[Sequence[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (token ids int64 [B], logprobs float32 [B]).

    Row b draws one uniform from rngs[b] (None: torch's global generator); greedy rows draw
    nothing. A seeded row is therefore reproducible whatever else shares the batch. The
    logprob is the model's own log-softmax of the chosen token (before any sampling
    transform), the same scale as `top_logprobs`."""
    fast = _plain_greedy(logits, settings, histories, rngs, prompt_lens)
    if fast is not None:
        check_row_max(fast[2])
        return fast[0], fast[1]
    x, greedy = _prepare(logits, settings, histories, prompt_lens)
    B = x.shape[0]
    rngs = [None] * B if rngs is None else list(rngs)
    if len(rngs) != B:
        raise InputError(f"got {len(rngs)} generators for {B} logit rows")
    ids = x.argmax(dim=1)                                   # greedy rows: first max on ties
    sampled = (~greedy).nonzero().squeeze(1)
    if sampled.numel():
        u = torch.tensor([_uniform(rngs[b]) for b in sampled.tolist()], dtype=torch.float64, device=x.device)
        if _row_by_row(x):               # softmax and cumsum share a cached row
            for i, b in enumerate(sampled.tolist()):
                ids[b] = _draw(x[b:b + 1], u[i:i + 1])[0]
        elif sampled.numel() == B:
            ids = _draw(x, u)
        else:
            ids[sampled] = _draw(x[sampled], u)
    return ids, chosen_logprobs(logits.to(torch.float32), ids)


def sample(logits: torch.Tensor, settings: SamplerSettings, history: History = None,
           rng: Optional[torch.Generator] = None, *, prompt_len: int = 0) -> tuple[int, float]:
    """logits [V] -> (token id, model logprob of that token). See `sample_batch`."""
    _check_logits(logits, batched=False)
    ids, lps = sample_batch(logits[None], [settings], [history], [rng], [prompt_len])
    return int(ids[0]), float(lps[0])


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens under the model: logits [..., V] -> (logprobs float32 [..., k],
    ids int64 [..., k]), most likely first, lowest id first among ties."""
    if not is_int(k) or k < 0:
        raise InputError(f"top_logprobs: k={k!r} must be an int >= 0")
    if not isinstance(logits, torch.Tensor) or logits.dim() == 0 or not logits.is_floating_point():
        raise InputError("top_logprobs: logits must be a floating tensor [..., V]")
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    k = min(k, lp.shape[-1])
    if k == 0:
        return lp[..., :0].to(torch.float32), torch.zeros(lp.shape[:-1] + (0,), dtype=torch.int64)
    if not torch.isfinite(logits.detach().amax(dim=-1)).all():   # amax keeps a NaN; log_softmax NaNs the row
        raise InputError("top_logprobs: a logits row holds NaN or +inf, or is all -inf: it is no distribution")
    # topk picks an arbitrary member among ties at the k-th value; re-pick those by lowest id.
    thr = torch.topk(lp, k, dim=-1).values[..., -1:]
    greater = lp > thr
    eq = lp == thr
    keep = greater | (eq & (eq.cumsum(dim=-1) <= k - greater.sum(dim=-1, keepdim=True)))
    ids = keep.nonzero()[:, -1].view(*lp.shape[:-1], k)      # exactly k per row, ascending id
    vals, perm = torch.sort(lp.gather(-1, ids), dim=-1, descending=True, stable=True)
    return vals.to(torch.float32), ids.gather(-1, perm)


__all__ = ["SamplerSettings", "processed_probs", "processed_probs_batch", "sample", "sample_batch",
           "top_logprobs"]
