"""Speculative decoding: a cheap drafter proposes k tokens, the main model scores them all in
one forward pass, and a rejection rule keeps the output distribution exactly the main
model's (Leviathan et al. 2023; Chen et al. 2023).

    per decoding job, one generator step:
      draft   d_1..d_n ~ q_i      (draft model, sampled with the job's own sampler settings,
                                   or n-gram lookup: q_i = one-hot of the proposed token)
      verify  main forward over [last token, d_1..d_n]   -> p_1..p_{n+1}   (n+1 rows)
      accept  d_i with probability min(1, p_i(d_i) / q_i(d_i)), in order; at the first
              rejection draw from norm(max(0, p_i - q_i)) and stop; if all n pass, draw a
              bonus token from p_{n+1}
      rollback the main cache keeps only the positions of accepted tokens (the rejected
              slots stay owned by the job and are overwritten next step); the draft cache
              is cut back to the positions that still match the sequence

p and q both come from `sampling.processed_probs` (every filter and penalty applied, with
the history each position would see), so the result is exact for any sampler settings.
Greedy settings make p and q one-hot: the rule then accepts the longest prefix agreeing with
the main model's argmax and consumes no random numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..errors import CacheFullError, InputError
from .logprobs import chosen_logprobs
from .ngram import ngram_draft
from .sampling import _uniform, processed_probs_batch   # one uniform from a job's generator


# -- the acceptance rule ---------------------------------------------------------------------

def draw_from(probs: torch.Tensor, rng: Optional[torch.Generator]) -> int:
    """One token from a distribution [V] (any non-negative weights) by inverse CDF. A one-hot
    distribution returns its token without consuming a random number (greedy stays free)."""
    probs = probs.to(torch.float64)
    top = int(torch.argmax(probs))
    total = float(probs.sum())
    if total <= 0:
        raise InputError("speculative: cannot draw from an all-zero distribution")
    if float(probs[top]) >= total:                 # one-hot
        return top
    cdf = torch.cumsum(probs, 0)
    idx = int(torch.searchsorted(cdf, torch.tensor([_uniform(rng) * float(cdf[-1])], dtype=torch.float64),
                                 right=True)[0])
    if idx >= probs.numel() or float(probs[idx]) <= 0:   # rounding at the top end: last non-zero token
        idx = int(probs.numel() - 1 - int((probs.flip(0) > 0).to(torch.int8).argmax()))
    return idx


def accept_draft(p: torch.Tensor, q: Optional[torch.Tensor], draft: Sequence[int],
                 rng: Optional[torch.Generator] = None) -> tuple[list[int], int]:
    """The rejection rule. p [n+1, V]: main-model distributions at the n+1 verified positions;
    q [n, V]: the distributions the drafts were drawn from (None: deterministic drafter, q_i =
    one-hot(d_i)); draft: the n proposed tokens. Returns (tokens, accepted): the accepted
    drafts followed by one corrected or bonus token (1..n+1 tokens), and how many drafts
    were accepted."""
    n = len(draft)
    if p.dim() != 2 or p.shape[0] != n + 1 or (q is not None and tuple(q.shape) != (n, p.shape[1])):
        raise InputError(f"accept_draft: p must be [n+1, V] and q [n, V] for n={n} drafts, got "
                         f"{list(p.shape)} and {None if q is None else list(q.shape)}")
    p = p.to(torch.float64)
    out: list[int] = []
    for i, d in enumerate(draft):
        pd = float(p[i, d])
        qd = 1.0 if q is None else float(q[i, d])
        if pd >= qd and qd > 0:
            ok = True                                  # ratio >= 1: always accepted, no draw
        elif pd <= 0 or qd <= 0:
            ok = False
        else:
            ok = _uniform(rng) < pd / qd
        if ok:
            out.append(int(d))
            continue
        if q is None:
            resid = p[i].clone()
            resid[d] = 0.0                                 # max(0, p - onehot(d))
        else:
            resid = (p[i] - q[i].to(torch.float64)).clamp_min(0.0)
        if float(resid.sum()) <= 0:                       # p == q up to rounding: p itself
            resid = p[i]
        out.append(draw_from(resid, rng))
        return out, i
    out.append(draw_from(p[n], rng))
    return out, n


# -- drafting inside the generator ------------------------------------------------------------
@dataclass
class SpecStats:
    steps: int = 0               # job-steps that verified at least one draft
    drafted: int = 0             # draft tokens proposed
    accepted: int = 0            # draft tokens accepted
    draft_forward_passes: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class SpeculativeDecoder:
    """Owns the drafter (draft model + its paged cache, or n-gram lookup) for a Generator."""

    def __init__(self, num_draft_tokens: int = 4, draft_model=None, draft_cache=None, ngram: bool = False,
                 max_ngram: int = 3, min_ngram: int = 2, vocab_size: Optional[int] = None, tp=None):
        """`tp`: the main model's TPGroup where it is tensor-parallel (the draft may be a whole model on each rank)."""
        if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
            raise InputError(f"speculative decoding: num_draft_tokens={num_draft_tokens!r} must be an int >= 1")
        if (draft_model is None) == (not ngram):
            raise InputError("speculative decoding: pass either draft_model (with draft_cache) or ngram_draft=True")
        if draft_model is not None:
            if draft_cache is None:
                from ..cache import Cache
                # sized alike on every rank of a tensor-parallel main model: the ranks must draft alike, also where
                # the draft is a whole (unsharded) model on each
                draft_cache = Cache(draft_model, max_tokens=None,
                                    tp_group=getattr(draft_model, "tensor_parallel", None) or tp)
            if draft_cache.model is not draft_model:
                raise InputError("speculative decoding: draft_cache was built for a different model than "
                                 "draft_model; use Cache(draft_model, ...)")
            if vocab_size is not None and draft_model.config.vocab_size != vocab_size:
                raise InputError(f"speculative decoding: the draft model's vocabulary "
                                 f"({draft_model.config.vocab_size}) differs from the main model's ({vocab_size}); "
                                 "both must share one tokenizer")
        self.k = num_draft_tokens
        self.draft_model, self.draft_cache = draft_model, draft_cache
        self.ngram, self.max_ngram, self.min_ngram = ngram, max_ngram, min_ngram
        self.stats = SpecStats()
        # Per job draft length, adapted to how much was accepted lately: every rejected draft
        # costs a verified row (and a draft forward), so a job whose drafts keep failing drafts
        # less. Depends only on the job's past, so the output law is unchanged.
        self._klen: dict[int, int] = {}
        self._tables: dict[int, object] = {}        # id(job) -> draft-cache PageTable
        self._rngs: dict[int, Optional[torch.Generator]] = {}
        self._failed: set[int] = set()              # jobs the draft cache could not admit

    # -- per job state --------------------------------------------------------------------
    def forget(self, job) -> None:
        """The job ended: give its draft-cache pages back."""
        t = self._tables.pop(id(job), None)
        if t is not None:
            self.draft_cache.release(t)
        self._rngs.pop(id(job), None)
        self._failed.discard(id(job))
        self._klen.pop(id(job), None)

    def _drop(self, job) -> None:
        """Stop drafting for a job: its draft-cache pages go back, it decodes plainly."""
        t = self._tables.pop(id(job), None)
        if t is not None:
            self.draft_cache.release(t)
        self._failed.add(id(job))

    def record(self, job, drafted: int, accepted: int) -> None:
        """Grow the job's draft length after a fully accepted run, shrink it after a miss."""
        k = self._klen.get(id(job), self.k)
        if accepted == drafted:
            k = min(self.k, k + 1)
        elif accepted == 0:
            k = max(1, k // 2)
        self._klen[id(job)] = k
        self.stats.steps += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted

    def _draft_table(self, job, max_chunk: int):
        key = id(job)
        if key in self._failed:
            return None
        t = self._tables.get(key)
        if t is None:
            # every position the job may ever store, plus the drafts beyond them; with a window
            # the held span is the window plus one chunk or one step's drafts, whichever is longer
            t = self.draft_cache.try_admit(job.input_ids, job.prompt_len + job.limit + self.k,
                                           max(max_chunk, self.k), reuse=False)
            if t is None:               # draft cache full: this job decodes plainly
                self._failed.add(key)
                return None
            self._tables[key] = t
            self._rngs[key] = (torch.Generator().manual_seed(int(job.seed) ^ 0x5EED5EED)
                               if job.seed is not None else None)
        return t

    # -- drafting ---------------------------------------------------------------------------
    def budget(self, job, max_drafts: Optional[int] = None) -> int:
        """Drafts this job may verify now: the main cache holds prompt + limit - 1 positions, so
        a step that feeds 1 + n tokens needs n <= limit - generated - 1 (and n <= max_drafts)."""
        n = min(self._klen.get(id(job), self.k), job.limit - len(job.generated) - 1)
        return max(0, n if max_drafts is None else min(n, max_drafts))

    def propose(self, jobs: list, max_chunk: int, max_drafts: Optional[int] = None
                ) -> dict[int, tuple[list[int], Optional[torch.Tensor]]]:
        """id(job) -> (drafts, q [n, V] or None) for the decoding jobs given (n may be 0)."""
        out: dict[int, tuple[list[int], Optional[torch.Tensor]]] = {}
        if self.ngram:
            for job in jobs:
                out[id(job)] = (ngram_draft(job.tokens, self.budget(job, max_drafts), self.max_ngram,
                                            self.min_ngram), None)
            return out
        return self._propose_model(jobs, max_chunk, max_drafts)

    @torch.inference_mode()
    def _propose_model(self, jobs: list, max_chunk: int, max_drafts: Optional[int] = None):
        out = {id(j): ([], None) for j in jobs}
        live = []                              # (job, table, n_wanted)
        for job in jobs:
            n = self.budget(job, max_drafts)
            if n > 0:
                t = self._draft_table(job, max_chunk)
                if t is not None:
                    live.append((job, t, n))
        drafts = {id(j): [] for j, _, _ in live}
        qs = {id(j): [] for j, _, _ in live}
        window = self.draft_cache.window
        while live:
            # first catch the draft cache up with the sequence, in chunks like the scheduler's
            # prefill (a windowed table only has pages for one chunk past the window); then
            # feed one draft at a time
            feeds = []
            for job, t, _ in live:
                pos = t.num_tokens
                if pos < len(job.tokens):
                    feeds.append(job.tokens[pos:(pos // max_chunk + 1) * max_chunk])
                else:
                    feeds.append(drafts[id(job)][-1:])
            lens = [len(f) for f in feeds]
            rows = torch.tensor(list(_cumsum(lens)), dtype=torch.int64) - 1
            try:
                ctx = self.draft_cache.context([t for _, t, _ in live], lens, rows)
            except CacheFullError:   # past the pages promised (should not happen): these jobs decode plainly
                for job, _, _ in live:
                    self._drop(job)
                    drafts[id(job)], qs[id(job)] = [], []
                break
            dev = self.draft_model.device
            logits = self.draft_model.forward(torch.tensor([x for f in feeds for x in f], dtype=torch.int64,
                                                           device=dev), ctx)   # (S, V)
            self.stats.draft_forward_passes += 1
            for (job, t, _), n_fed in zip(live, lens):
                t.num_tokens += n_fed      # draft pages are private: no prefix index
                # slide only over the sequence's own tokens: a rollback returns to them, never
                # before, so no query after it looks below what was released
                if window and t.num_tokens <= len(job.tokens):
                    t.release_window(self.draft_cache.pool, window, keep_reservation=True)
            ready = [r for r, (job, t, _) in enumerate(live) if t.num_tokens >= len(job.tokens)]
            if not ready:              # all still catching up: nothing to draw yet
                continue
            rl = [live[r] for r in ready]
            hist = [job.tokens + drafts[id(job)] for job, _, _ in rl]
            try:
                q = processed_probs_batch(logits[ready].float(), [j.sampler for j, _, _ in rl], hist,
                                          [j.prompt_len for j, _, _ in rl], dtype=torch.float64)
            except Exception:   # noqa: BLE001 - e.g. every token banned: these jobs just decode plainly
                for job, t, _ in live:
                    t.num_tokens = min(t.num_tokens, len(job.tokens))   # no drafts' K/V kept past the sequence
                    drafts[id(job)], qs[id(job)] = [], []
                break
            qrow = {r: i for i, r in enumerate(ready)}
            keep = []
            for r, (job, t, n) in enumerate(live):
                if r in qrow:
                    d = draw_from(q[qrow[r]], self._rngs.get(id(job)))
                    drafts[id(job)].append(d)
                    qs[id(job)].append(q[qrow[r]])
                if len(drafts[id(job)]) < n:
                    keep.append((job, t, n))
            live = keep
        for key, ds in drafts.items():
            if ds:
                out[key] = (ds, torch.stack(qs[key]))
        return out

    def rollback(self, job, kept_len: int) -> None:
        """After verification: the draft cache keeps at most `kept_len` positions (those whose
        tokens are still the sequence's)."""
        t = self._tables.get(id(job))
        if t is not None and t.num_tokens > kept_len:
            t.num_tokens = kept_len


# -- one generator step with verification --------------------------------------------------------
@torch.inference_mode()
def speculative_step(gen, plan) -> list:
    """Like Generator.iterate's forward + sampling, but decoding jobs also feed their drafts and
    may advance by several tokens. Prefill chunks and jobs without drafts (no proposal, a
    token_filter, one token left) run exactly as in the plain step, in the same forward."""
    from ..model.lora import lora_rows
    spec: SpeculativeDecoder = gen.spec
    decoding = [i.job for i in plan.items if i.job.fed >= i.job.prompt_len and i.job.token_filter is None]
    # a windowed main cache promises each job pages for one chunk past the window: drafts stay within it; and the
    # forward stays within max_batch_tokens: the plan's tokens plus an equal share of the rest for each job's drafts
    cap = gen.scheduler.max_chunk_size if gen.cache.window else None
    if decoding:
        share = (gen.scheduler.max_batch_tokens - sum(len(i.tokens) for i in plan.items)) // len(decoding)
        cap = max(0, share) if cap is None else min(cap, max(0, share))
    proposals = spec.propose(decoding, gen.scheduler.max_chunk_size, cap) if decoding else {}

    ids, lens, rows = [], [], []
    work = []          # (item, drafts, q, first logits row of the item)
    r = 0
    for item in plan.items:
        drafts, q = proposals.get(id(item.job), ([], None))
        toks = item.tokens + drafts
        first = len(rows)
        if drafts:
            rows.extend(range(r, r + len(toks)))      # every verified position
        elif item.wants_logits:
            rows.append(r + len(toks) - 1)
        work.append((item, drafts, q, first))
        ids.extend(toks)
        lens.append(len(toks))
        r += len(toks)
    dev = gen.model.device
    ctx = gen.cache.context([i.job.table for i in plan.items], lens, torch.tensor(rows, dtype=torch.int64))
    with lora_rows(gen.model, [(i.job, n) for i, n in zip(plan.items, lens)]):
        logits = gen.model.forward(torch.tensor(ids, dtype=torch.int64, device=dev), ctx)   # (R, V)
    gen.stats.forward_passes += 1
    gen.stats.forward_tokens += len(ids)

    # decide acceptance first (pure), then account the cache, then emit
    verdicts = []      # (job, tokens, logprobs)
    plain_jobs, plain_rows = [], []
    errors: list[Exception] = []
    failed: dict[int, Exception] = {}    # jobs whose accepted drafts reach a row that cannot be sampled
    for item, drafts, q, first in work:
        job = item.job
        if not drafts:
            gen.cache.after_forward(job.table, job.tokens, len(item.tokens), more_to_come=True)
            if item.wants_logits:
                plain_jobs.append(job)
                plain_rows.append(first)
            continue
        n = len(drafts)
        lg = logits[first:first + n + 1]                                    # (n+1, V)
        p, bad = _verified_probs(job, drafts, lg)
        if bad is not None and bad[0] == 0:      # the row plain decoding samples from: the job ends as it would
            errors.append(bad[1])
            gen._events.append(gen._error_cancelled(job))
            continue
        if bad is not None:
            drafts, q = drafts[:bad[0]], (None if q is None else q[:bad[0]])
        toks, a = accept_draft(p, q, drafts, job.rng)
        if bad is not None and a == len(drafts):  # all accepted: the next token needs the bad row, as it would plain
            toks = toks[:a]
            failed[id(job)] = bad[1]
        spec.record(job, n, a)
        # main cache: keep the last fed token and the accepted drafts; rejected slots are
        # overwritten next step (their pages stay with the job, inside its reservation)
        gen.cache.after_forward(job.table, job.tokens + drafts[:a], 1 + a, more_to_come=True)
        if spec.draft_model is not None:
            spec.rollback(job, len(job.tokens) + min(a, n - 1))
        # the plain sampler's logprobs (float64 log-sum-exp), so speculation changes no reported value
        lps = chosen_logprobs(lg[:len(toks)].float(), torch.tensor(toks, device=lg.device)).tolist()
        verdicts.append((job, toks, lps))

    results = []
    for job, toks, lps in verdicts:
        for t, lp in zip(toks, lps):
            if job.status != "active":       # stopped (eos, stop string, limit, callback)
                break
            try:
                results.append(gen._accept(job, t, lp))
            except Exception as e:   # noqa: BLE001 - delivered like the plain path does
                errors.append(e)
                break
        if id(job) in failed and job.status == "active":
            errors.append(failed[id(job)])
            results.append(gen._error_cancelled(job))    # after the job's accepted tokens
    if plain_jobs:
        try:
            results.extend(gen._sample_and_emit(plain_jobs, logits[plain_rows]))
        except Exception as e:   # noqa: BLE001
            errors.append(e)
    if errors:
        gen._events.extend(results)
        raise errors[0]
    return results


def _verified_probs(job, drafts: list[int], lg: torch.Tensor) -> tuple[torch.Tensor, Optional[tuple]]:
    """The main model's distributions at a job's n+1 verified rows, and (b, error) for the first row b that cannot
    be sampled (NaN / inf logits, every token filtered), else None.  Acceptance at rows before b never reads row b,
    so the caller verifies drafts[:b] with a stand-in row b and ends the job only where all b are accepted (plain
    decoding would sample from row b there): the same law as without the bad row, and no step that raises for
    every job of the batch."""
    n = len(drafts)
    args = lambda rows: ([job.sampler] * len(rows), [job.tokens + drafts[:i] for i in rows],  # noqa: E731
                         [job.prompt_len] * len(rows))
    try:
        return processed_probs_batch(lg, *args(range(n + 1)), dtype=torch.float64), None
    except Exception as e:   # noqa: BLE001 - find the first bad row below
        whole = e
    good = []
    stand_in = torch.full((1, lg.shape[1]), 1.0 / lg.shape[1], dtype=torch.float64, device=lg.device)
    for i in range(n + 1):
        try:
            good.append(processed_probs_batch(lg[i:i + 1], *args([i]), dtype=torch.float64))
        except Exception as e:   # noqa: BLE001 - the job's error, delivered by the caller
            return torch.cat(good + [stand_in]), (i, e)
    return stand_in, (0, whole)    # no row fails alone: the job ends on the batch's error, as at its first row


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


__all__ = ["SpecStats", "SpeculativeDecoder", "accept_draft", "draw_from", "speculative_step"]
