"""Dynamic generator: many jobs, one ragged forward pass per step over the paged cache.

    enqueue(job) ─► waiting ─(pages promised)─► active ─► done (pages released)
                                                  │
    iterate():  admit → plan (decode tokens + whole prefill chunks within the token budget)
                → one flat forward with a PagedContext → sample the rows that want logits
                → text/stop handling → JobResults (+ callbacks)

The generator never touches the cache's tensors; it hands page tables to `Cache.context`. Its consumers of single
jobs live beside it: routing.py (how results and errors reach them), text_consumers.py (generate, stream),
async_consumers.py (aiterate, astream).
"""
from __future__ import annotations

import numbers
import os
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from ..errors import InputError, is_bool, is_int
from ..model.lora import check_job_loras, lora_manager, lora_rows, register_generator
from .async_consumers import AsyncConsumers
from .job import Job, JobResult
from .logprobs import chosen_logprobs
from .lookahead import Lookahead
from .routing import Routing, _by_end
from .sampling import sample_batch, sample_batch_unchecked
from .scheduler import Scheduler
from .streaming import TextStream
from .text_consumers import TextConsumers


@dataclass
class GeneratorStats:
    forward_passes: int = 0
    forward_tokens: int = 0        # tokens run through the model (prefill + decode)
    reused_tokens: int = 0         # prompt positions served from the prefix index instead
    generated_tokens: int = 0
    jobs_finished: int = 0
    lookahead_used: int = 0        # decode steps launched before the previous step's tokens reached the host
    lookahead_dropped: int = 0     # such steps no plan matched (a job ended or joined): run again


def default_budget(gpu: bool, window: Optional[int], max_batch_tokens: Optional[int], max_chunk_size: Optional[int],
                   max_batch_size: int) -> tuple[int, int]:
    """(max_batch_tokens, max_chunk_size) where the caller left them None (Generator's docstring): a chunk is never cut
    to fit the budget (scheduler.py), so the budget keeps room for it next to max_batch_size decoding jobs, or a
    prompt would wait for every decoding job to finish."""
    chunk = max_chunk_size if max_chunk_size is not None else (2048 if gpu and not window else 512)
    if max_batch_tokens is None:
        max_batch_tokens = max(2048, chunk + max_batch_size) if gpu else 2048
    if max_chunk_size is None:
        room = max_batch_tokens - max_batch_size
        chunk = min(chunk, room) if room >= 512 else min(512, max_batch_tokens)
    return max_batch_tokens, chunk


def _nan_or_posinf(t: torch.Tensor) -> bool:
    m = t.amax()                                       # NaN propagates through max: one pass (-inf is a ban)
    return bool(m.isnan() | m.isposinf())


def _check_filtered(job: Job, out, row: torch.Tensor, model_row: torch.Tensor) -> Optional[torch.Tensor]:
    """A token_filter's return value as the row to use: None (row edited in place) or a replacement of V floats (a
    float tensor of V values, [V] or [1, V], or a list of V floats); anything else would fail in torch's copy (wrong
    size) or be cast silently (ints, bools). NaN or +inf the filter put there is its error (the sampler's check would
    blame the model); `model_row`: the row as the model gave it, scanned only where the filtered one is bad."""
    if out is None:
        if _nan_or_posinf(row) and not _nan_or_posinf(model_row):
            raise InputError(f"Job {job.identifier!r}: its token_filter wrote NaN or +inf into the logits row; write "
                             "finite values (-inf bans a token)")
        return None
    if isinstance(out, (list, tuple)) and len(out) == row.numel() and \
            all(isinstance(v, numbers.Real) and not is_bool(v) for v in out):     # numpy's floats too
        out = torch.tensor([float(v) for v in out], dtype=row.dtype, device=row.device)
    if isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel() == row.numel() and \
            out.dim() <= 2 and out.shape[-1] == row.numel():
        out = out.to(row.device, row.dtype)    # checked as the row holds it: a float64 1e39 is +inf in float32
        if _nan_or_posinf(out):
            raise InputError(f"Job {job.identifier!r}: its token_filter returned NaN or +inf logits; return finite "
                             "values (-inf bans a token)")
        return out.reshape(row.shape)
    got = f"a {out.dtype} tensor of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
    raise InputError(f"Job {job.identifier!r}: token_filter returned {got}; it must return {row.numel()} floats (a "
                     "tensor or a list: the logits row, replaced) or None (the row edited in place)")


class Generator(Routing, TextConsumers, AsyncConsumers):
    def __init__(self, model, cache, tokenizer=None, max_batch_tokens: Optional[int] = None,
                 max_chunk_size: Optional[int] = None, max_batch_size: int = 256, prefix_reuse: bool = True,
                 draft_model=None, draft_cache=None, num_draft_tokens: int = 4, ngram_draft: bool = False,
                 cuda_graphs: Optional[bool] = None, lookahead: Optional[bool] = None):
        """`cuda_graphs`: replay decode steps from CUDA graphs (cuda_graphs.py); default: on when the model is on a
        CUDA device.  `max_chunk_size` (prompt tokens a job feeds in one forward): default 512 on the CPU, 2048 on a
        GPU, where a 512-token chunk's forward is bound by the host's launches: a 2,048-token prompt reached its first
        token at 8,968.9 / 11,923.2 tok/s in 512-token chunks and 32,704.7 / 37,621.3 in one (H200, 7B-shaped GPTQ,
        stop 30 calls 2 / 3, bench/gpu_generator.py); 512 with a sliding window (its reservations grow with the chunk).
        `max_batch_tokens` (tokens a forward may carry): default the chunk plus max_batch_size on a GPU, 2048 on the
        CPU, so that a chunk, never cut, fits next to a full batch of decoding jobs.  `lookahead`: with graphs
        (and no speculative decoding), launch the next decode step before this step's tokens reach the host, so the
        host's per-step work overlaps the GPU's (lookahead.py; the same tokens); default on (EXL_CORE_GEN_LOOKAHEAD=0:
        off)."""
        from ..cache.paged import Cache, check_model
        check_model(model, "Generator")
        if not isinstance(cache, Cache):
            raise InputError(f"Generator: cache must be a Cache (Cache(model, ...)), got {type(cache).__name__}")
        if tokenizer is not None and not (callable(getattr(tokenizer, "encode", None))
                                          and callable(getattr(tokenizer, "decode", None))):
            # a str here would be taken for one later: str.encode(prompt) fails with "unknown encoding"
            raise InputError(f"Generator: tokenizer must have encode and decode methods (the Tokenizer load_model "
                             f"returns) or be None, got {type(tokenizer).__name__}")
        if cache.model is not model:
            raise InputError("Generator: the cache was built for a different model; use Cache(model, ...)")
        for name, v, optional in (("max_batch_tokens", max_batch_tokens, True),
                                  ("max_chunk_size", max_chunk_size, True), ("max_batch_size", max_batch_size, False)):
            # only None means the default: 0 must not pass for it, nor 2.5 reach the scheduler's arithmetic
            if (v is not None or not optional) and (not is_int(v) or v < 1):
                raise InputError(f"Generator: {name}={v!r} must be an int >= 1"
                                 + (" (or None for the default)" if optional else ""))
        # speculative decoding (speculative.py): a draft model or n-gram lookup proposes tokens
        self.spec = None
        if draft_model is not None or ngram_draft:
            from .speculative import SpeculativeDecoder
            self.spec = SpeculativeDecoder(num_draft_tokens, draft_model, draft_cache, ngram=ngram_draft,
                                           vocab_size=model.config.vocab_size,
                                           tp=getattr(model, "tensor_parallel", None))
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        max_batch_tokens, max_chunk_size = default_budget(torch.device(model.device).type == "cuda", cache.window,
                                                          max_batch_tokens, max_chunk_size, max_batch_size)
        self.scheduler = Scheduler(max_batch_tokens, max_chunk_size, max_batch_size)
        self.prefix_reuse = prefix_reuse
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []
        self.stats = GeneratorStats()
        self._events: list[JobResult] = []        # results produced outside iterate (cancel)
        self._lock = threading.RLock()
        self._stepping = False                    # inside iterate's step (its lock is re-entrant for callbacks)
        self._init_routing()                         # stream / astream consumers (routing.py)
        self._drivers: dict = {}                     # event loop -> its astream driver task (async_consumers.py)
        self.vocab_size = model.config.vocab_size
        if tokenizer is not None and type(tokenizer).__module__.split(".")[0] in ("transformers", "tokenizers"):
            raise InputError(f"Generator: tokenizer is a {type(tokenizer).__module__}.{type(tokenizer).__name__}; "
                             "pass exl_core's Tokenizer (the second value load_model returns)")
        eos = getattr(tokenizer, "eos_token_ids", None) or ()
        eos = {eos} if isinstance(eos, int) else set(eos)
        self.eos_ids = eos | set(getattr(model.config, "eos_token_ids", None) or ())
        self.graphs = None
        if cuda_graphs or (cuda_graphs is None and torch.device(model.device).type == "cuda"):
            from .cuda_graphs import GraphedDecoder
            self.graphs = GraphedDecoder(model, cache)
        if lookahead is None:
            lookahead = os.environ.get("EXL_CORE_GEN_LOOKAHEAD", "1") != "0"
        self.lookahead = Lookahead(self) if lookahead and self.graphs is not None and self.spec is None else None
        register_generator(model, self)   # no adapter is merged, unloaded or (de)activated under its jobs

    # -- queue ------------------------------------------------------------------------------
    def enqueue(self, job: Union[Job, Sequence[Job]]) -> Union[Job, list[Job]]:
        """Queue a job (or several). Raises InputError for a bad job and CacheFullError when
        its prompt can never fit in the cache."""
        if not isinstance(job, Job):
            jobs = list(job)
            for j in jobs:                 # all or nothing: validate every job first
                self._validate(j)
            if len({id(j) for j in jobs}) != len(jobs):
                raise InputError("Generator.enqueue: the same Job appears twice in the list; create one Job each")
            return [self.enqueue(j) for j in jobs]
        self._validate(job)
        # Clipped to what the cache can hold where the job's pages could never all be promised: always without a
        # window (every position keeps its page); with one where the window plus a chunk exceeds the cache (else
        # such a job stayed queued for ever)
        total = job.prompt_len + job.max_new_tokens - 1
        if self.cache.pages_to_reserve(total, 0, self.scheduler.max_chunk_size) > self.cache.num_pages:
            room = self.cache.max_tokens - job.prompt_len + 1
            job.limit = max(1, min(job.max_new_tokens, room))
        job.stream = TextStream(self.tokenizer, job.stop_strings, skip_special=not job.decode_special,
                                context=job.input_ids)
        with self._lock:
            if job.loras:   # again under the lock: an adapter merged or unloaded since _validate (lora.jobs_frozen)
                check_job_loras(self.model, job.loras, f"Job {job.identifier!r}")
            job.status = "queued"
            job.owner = weakref.ref(self)
            entry = self._sinks.get(id(job))
            job._consumed = entry is not None and entry.job is job    # its errors are its consumer's (routing.py)
            self.waiting.append(job)
        return job

    def _validate(self, job: Job) -> None:
        if not isinstance(job, Job):
            raise InputError(f"Generator.enqueue: expected a Job, got {type(job).__name__}")
        if job.status != "new":
            raise InputError(f"Generator.enqueue: {job!r} was already enqueued; create a new Job")
        if job.stop_strings:
            self._stop_strings_to_ids(job)
        for what, ids in (("input_ids", job.input_ids), ("stop", sorted(job.stop_tokens))):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:     # a stop id past the vocabulary could never be sampled: the stop would silently never fire
                raise InputError(f"Job {job.identifier!r}: {what} token ids {bad[:5]} are outside the vocabulary "
                                 f"(size {self.vocab_size})")
        job.sampler.validate(self.vocab_size)
        tp = getattr(self.model, "tensor_parallel", None)
        if tp is not None and job.seed is None:     # every rank must sample the same tokens (TPGroup.shared_seed)
            job.seed = tp.shared_seed()
            job.rng = torch.Generator().manual_seed(job.seed)
        if job.loras:
            check_job_loras(self.model, job.loras, f"Job {job.identifier!r}")
        self.cache.check_fits(job.prompt_len, self.scheduler.max_chunk_size, what=f"prompt of job {job.identifier!r}")

    def _stop_strings_to_ids(self, job: Job) -> None:
        """Stop strings are matched in the decoded text: without a tokenizer there is none (they would never fire),
        and a special token (e.g. "<|im_end|>") is left out of it unless the job decodes specials, so such a string
        also stops the job as its token id."""
        if self.tokenizer is None:
            raise InputError(f"Job {job.identifier!r}: stop strings {job.stop_strings!r} need a tokenizer to match "
                             "the decoded text; pass Generator(..., tokenizer) or stop token ids")
        special = getattr(self.tokenizer, "special_ids", ())
        pieces = () if job.decode_special else getattr(self.tokenizer, "special_pieces", ())
        for text in job.stop_strings:
            tid = self.tokenizer.piece_to_id(text) if hasattr(self.tokenizer, "piece_to_id") else None
            if tid is not None and tid in special and not job.decode_special:
                job.stop_tokens.add(tid)
                continue
            inside = next((p for p in pieces if p in text), None)
            if inside is not None:      # "<|im_end|>\n": the text never holds the special token, so never this
                raise InputError(f"Job {job.identifier!r}: stop string {text!r} holds the special token {inside!r}, "
                                 "which is not decoded into the text (decode_special=False), so it could never "
                                 f"match; stop on {inside!r} alone, or decode specials")

    def cancel(self, job: Job) -> bool:
        """Stop a queued or running job now (pages freed); its final JobResult (finish reason "cancelled") goes to
        the job's consumer where it has one (stream, astream, generate, the adapters' engine: at once, or from a
        callback at the end of that step), else comes with the next iterate(). False if it had already finished (or
        was never queued); InputError for a job another generator runs."""
        with self._lock:
            if job.status in ("queued", "active") and (job.owner is None or job.owner() is not self):
                raise InputError(f"Generator.cancel: {job!r} was queued on another Generator; cancel it there")
            if job.status == "queued":
                self.waiting.remove(job)
            elif job.status != "active":
                return False
            res = self._cancelled(job)
            # its consumer has the tail before anyone reads job.done -- from a callback inside a step, at the step's
            # end, after the job's result of that step (routing.py)
            if self._stepping:
                self._events.append(res)    # routed at the step's end, after the job's result of that step
            elif not self._route([res]) and not job._consumed:
                self._events.append(res)    # a plain job's, for the next iterate() (a consumer's, even one gone, not)
            if job.callback is not None:
                job.callback(res)
            return True

    def pending_jobs(self) -> list[Job]:
        """The queued and running jobs, read under the lock (the scheduler moves jobs between the lists inside it)."""
        with self._lock:
            return [*self.waiting, *self.active]

    def has_work(self) -> bool:
        """Jobs to step or results to hand out -- or an error a stream's step left for the next iterate()."""
        return self._has_jobs() or self._orphan_error is not None

    def _has_jobs(self) -> bool:
        """has_work for the consumers' own loops (routing.py), which do not take the errors left for iterate()."""
        return bool(self.waiting or self.active or self._events)

    @property
    def num_active(self) -> int:
        return len(self.active)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step ---------------------------------------------------------------------------
    def iterate(self) -> list[JobResult]:
        """Run one forward pass over everything schedulable; return this step's results."""
        results, err, _ = self._step_routed(consumer=False)   # or a consumer's step's error for this caller's jobs
        if err is not None:
            try:
                raise err
            finally:
                del err           # no cycle through this frame
        return results

    @torch.inference_mode()
    def _step_locked(self) -> list[JobResult]:
        """iterate's step, under its lock (routing.py checks it is not inside a step)."""
        results, self._events = self._events, []
        self._stepping = True
        try:
            return self._step(results)
        except BaseException:
            # results made before this step (cancels, a failed step's other jobs) go out with the next one, each
            # job's end after its other results
            self._events[:0] = results
            self._events = _by_end(self._events)
            raise
        finally:
            self._stepping = False

    def _step(self, results: list[JobResult]) -> list[JobResult]:
        """iterate's work, under its lock: admit, plan, one forward, sample; this step's results after `results`."""
        for job in self.scheduler.admit(self.waiting, self.active, self.cache, reuse=self.prefix_reuse):
            self.stats.reused_tokens += job.reused_tokens
        plan = self.scheduler.plan(self.active)
        if not plan.items:
            return results
        if self.spec is not None:
            from .speculative import speculative_step
            results.extend(speculative_step(self, plan))
            return results
        ids, lens, rows, r = [], [], [], -1
        for item in plan.items:
            ids.extend(item.tokens)
            lens.append(len(item.tokens))
            r += len(item.tokens)
            if item.wants_logits:
                rows.append(r)
        dev = self.model.device
        tables = [i.job.table for i in plan.items]
        logits = self.lookahead.take(plan) if self.lookahead is not None else None
        if logits is not None:
            pass                                     # launched last step (lookahead.py): this very plan
        elif self._graphable(lens, [i.wants_logits for i in plan.items], max(len(i.job.tokens) for i in plan.items)):
            logits = self._graph_step(ids, tables)                                         # (S, V)
        else:
            ctx = self.cache.context(tables, lens, torch.tensor(rows, dtype=torch.int64, device=dev))
            with lora_rows(self.model, [(i.job, len(i.tokens)) for i in plan.items]):
                logits = self.model.forward(torch.tensor(ids, dtype=torch.int64, device=dev), ctx)  # (R, V)
        self.stats.forward_passes += 1
        self.stats.forward_tokens += len(ids)
        for item in plan.items:
            self.cache.after_forward(item.job.table, item.job.tokens, len(item.tokens), more_to_come=True)
        sampled = [i.job for i in plan.items if i.wants_logits]
        if sampled:
            results.extend(self._sample_and_emit(sampled, logits))
        return results

    def _graphable(self, lens: list[int], wants_logits: list[bool], positions: int) -> bool:
        """Whether a step of these rows, `positions` long at most, runs from the CUDA graphs (LoRA models stay eager:
        adapters change weights and per-row plans the recorded kernels would not see)."""
        return (self.graphs is not None and lora_manager(self.model) is None
                and self.graphs.accepts(lens, wants_logits, positions))

    def _graph_step(self, ids: list[int], tables: list, device_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A decode step's logits from the graphs (GraphedDecoder.run), its pages taken first."""
        self.cache.prepare(tables, [1] * len(tables))
        return self.graphs.run(ids, tables, device_ids=device_ids)

    def _sample_and_emit(self, jobs: list[Job], logits: torch.Tensor) -> list[JobResult]:
        errors: list[BaseException] = []
        raw: dict[int, torch.Tensor] = {}     # rows a filter may edit whose logprobs the job reports: the model's
        for r, job in enumerate(jobs):
            if job.token_filter is not None:
                raw[r] = logits[r].clone()    # job.logprobs is kept with or without return_logprobs
                try:
                    out = _check_filtered(job, job.token_filter(list(job.tokens), logits[r]), logits[r], raw[r])
                except Exception as e:   # the job ends; the error reaches the caller below
                    errors.append(e)
                    self._events.append(self._error_cancelled(job))
                    continue
                if out is not None:
                    logits[r] = out
        drawn = self._draw(jobs, logits, errors)
        for r, row in raw.items():            # logprobs under the model, not the filtered row (docs/sampling.md)
            if drawn[r][0] >= 0:
                drawn[r] = (drawn[r][0], float(chosen_logprobs(row[None].float(), torch.tensor([drawn[r][0]],
                                                                                               device=row.device))[0]))
        results = []
        for job, (t, p) in zip(jobs, drawn):
            if job.status != "active":   # ended by its filter, its sampler or another job's callback
                continue
            try:
                results.append(self._accept(job, t, p))
            except Exception as e:
                errors.append(e)
        if errors:
            # Accounting is consistent (failed jobs finished, pages freed); deliver the other
            # results with the next iterate() and let the caller see the first error.
            self._events.extend(results)
            err = errors[0]
            errors.clear()        # an error held here would reach this frame (and self) through its own traceback:
            try:                  # a cycle, leaving the Generator to the cycle collector (cuda_graphs._record)
                raise err
            finally:
                del err
        return results

    def _draw(self, jobs: list[Job], logits: torch.Tensor, errors: list) -> list[tuple[int, float]]:
        """One token per row. The K/V of these rows are already stored, so a row that cannot be
        sampled (e.g. a job banned every token) must end its job, not leave it half-stepped:
        on failure rows are retried one by one and only the failing jobs are cancelled."""
        args = lambda js: ([j.sampler for j in js], [j.tokens for j in js], [j.rng for j in js],  # noqa: E731
                           [j.prompt_len for j in js])
        bad = None
        try:
            if self.lookahead is None:
                tok, lp = sample_batch(logits, *args(jobs))
                return list(zip(tok.tolist(), lp.tolist()))
            # may launch the next step before reading (and checking) these
            toks, lps, bad = self.lookahead.draw(jobs, *sample_batch_unchecked(logits, *args(jobs)))
            if bad is None:
                return list(zip(toks, lps))

            def row(r, job):                     # the next step ran: `logits` may hold its values; keep what was read
                if bad[r] is not None:
                    raise bad[r]
                return toks[r], lps[r]
        except Exception:   # noqa: BLE001 - find the failing rows below
            def row(r, job):
                tok, lp = sample_batch(logits[r:r + 1], *args([job]))
                return int(tok[0]), float(lp[0])
        out = []
        for r, job in enumerate(jobs):
            try:
                out.append(row(r, job))
            except Exception as e:
                errors.append(e)
                if job.status != "done":
                    self._events.append(self._error_cancelled(job))
                out.append((-1, 0.0))
        bad = None                # its errors' tracebacks hold this frame: no cycle through the closure's cell
        return out

    def _accept(self, job: Job, token: int, logprob: float) -> JobResult:
        """Append a sampled token, apply the stop conditions, run the callback."""
        job.generated.append(token)
        job.tokens.append(token)
        job.logprobs.append(logprob)
        self.stats.generated_tokens += 1
        reason = None
        if job.stop_on_eos and token in self.eos_ids:
            reason = "eos"
        elif token in job.stop_tokens:
            reason = "stop"
        if reason is None:
            text, stopped = job.stream.push(token)
            if stopped:
                reason = "stop"
            elif len(job.generated) >= job.limit:
                tail, stopped = job.stream.finish()
                text += tail
                reason = "stop" if stopped else "length"
        else:
            text, stopped = job.stream.finish()   # held-back text was no stop string after all
            if stopped:
                reason = "stop"
        job.text += text
        res = JobResult(job, text, [token], reason, [logprob] if job.return_logprobs else None)
        if reason is not None:
            self._finish(job, reason)
        if job.callback is not None:
            try:
                keep = job.callback(res)
            except Exception:
                # an error in its callback ends the job (docs/sampling.md); its result comes with the next step, as
                # a cancel()'s does (it was lost, and astream could not tell which job the error ended)
                self._finish(job, "cancelled")
                res.finish_reason = job.finish_reason = "cancelled"
                res._by_error = True
                self._events.append(res)
                raise
            if keep is False and job.status != "done":
                # ended by its callback, which has seen every piece it will get: held-back text is not released
                # (docs/sampling.md), so the callback's pieces and iterate's add up to the same job.text
                res.finish_reason = "callback"
                self._finish(job, "callback")
        return res

    @staticmethod
    def _flush_text(job: Job) -> str:
        """The text a running job's stream still holds back (docs/sampling.md: released when the job ends other than
        by a stop string), added to job.text."""
        if job.status == "done" or job.stream is None:
            return ""
        tail, _ = job.stream.finish()   # a stop string it completes is cut, as at a normal end
        job.text += tail
        return tail

    def _cancelled(self, job: Job) -> JobResult:
        """End a job now (pages freed) and return its final result, with the text it held back: the caller queues
        it where it belongs."""
        tail = self._flush_text(job)
        self._finish(job, "cancelled")
        return JobResult(job, tail, [], "cancelled")

    def _error_cancelled(self, job: Job) -> JobResult:
        """_cancelled for a job the step's error ends (its filter, its sampler): its callback hears the end too (a
        consumer driven by callbacks only would wait for ever), whatever it does with it."""
        res = self._cancelled(job)
        res._by_error = True
        if job.callback is not None:
            try:
                job.callback(res)
            except Exception:  # noqa: BLE001 - the job has ended already; the step's own error is the one raised
                pass
        return res

    def _finish(self, job: Job, reason: str) -> None:
        if job.status == "done":
            return
        if job.table is not None:
            self.cache.release(job.table)
            job.table = None
        if self.spec is not None:
            self.spec.forget(job)
        if job in self.active:
            self.active.remove(job)
        job.owner = None            # a finished job is no generator's (and pickles again)
        job.status = "done"
        job.finish_reason = reason
        self.stats.jobs_finished += 1
