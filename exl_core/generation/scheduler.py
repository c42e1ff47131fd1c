"""Token-budget scheduler: which jobs join, and which tokens each feeds in the next forward.

Holds no tensors. Per step:

  1. admit waiting jobs in FIFO order while the cache can promise their pages (a job whose
     pages are not available now waits; later jobs do not overtake it). Only a job waiting
     for a prefix page that an active job is computing right now lets later jobs pass;
  2. every decoding job feeds its last sampled token (1 row, logits wanted);
  3. prefilling jobs, in admission order, feed their next chunk while the token budget lasts.

Batch invariance: a job's chunk boundaries depend only on the job. A chunk runs from the
job's current position to the next multiple of `max_chunk_size` (or the prompt's end), and a
chunk is scheduled whole or not at all, never cut to fit the budget. The first position is 0
or the end of the reused prefix pages, again a property of the job and the cache contents.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from ..errors import InputError
from ..model.lora import prefix_salt
from .job import Job


@dataclass
class WorkItem:
    """Tokens of one job in this forward pass: positions start .. start+len(tokens)-1."""
    job: Job
    start: int
    tokens: list[int]
    wants_logits: bool       # the last row's logits are sampled after the pass


@dataclass
class StepPlan:
    items: list[WorkItem] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(i.tokens) for i in self.items)


def next_work(job: Job, max_chunk_size: int) -> WorkItem:
    """The job's next slice of tokens, independent of everything else that runs."""
    pos = job.fed
    if pos < job.prompt_len:                                     # prefill
        end = min(job.prompt_len, (pos // max_chunk_size + 1) * max_chunk_size)
        return WorkItem(job, pos, job.tokens[pos:end], end == job.prompt_len)
    return WorkItem(job, pos, job.tokens[pos:pos + 1], True)     # decode: the last sampled token


class Scheduler:
    def __init__(self, max_batch_tokens: int = 2048, max_chunk_size: int = 512, max_batch_size: int = 256):
        if max_chunk_size < 1 or max_batch_tokens < 1 or max_batch_size < 1:
            raise InputError(f"Scheduler: max_batch_tokens={max_batch_tokens}, max_chunk_size={max_chunk_size}, "
                             f"max_batch_size={max_batch_size} must all be >= 1")
        if max_chunk_size > max_batch_tokens:
            raise InputError(f"Scheduler: max_chunk_size={max_chunk_size} exceeds max_batch_tokens="
                             f"{max_batch_tokens}; a chunk must fit in one forward pass")
        self.max_batch_tokens = max_batch_tokens
        self.max_chunk_size = max_chunk_size
        # every active job must be able to decode in one pass
        self.max_batch_size = min(max_batch_size, max_batch_tokens)

    def admit(self, waiting: deque, active: list, cache, reuse: bool = True) -> list[Job]:
        """Move jobs from `waiting` to `active` while the cache can promise their pages.

        With `reuse`, a job whose next unmatched prefix page is being computed right now by an
        active job's prefill waits for it instead of computing it again (many jobs sharing a
        system prompt, enqueued together, then compute it once)."""
        admitted, deferred = [], []
        pending: Optional[set] = None
        while waiting and len(active) < self.max_batch_size:
            job = waiting[0]
            if job.salt is None:
                job.salt = prefix_salt(cache.model, job.loras)
            if reuse:
                if job.page_keys is None:
                    job.page_keys = cache.prompt_keys(job.input_ids, job.salt)
                if pending is None:
                    pending = {k for a in active if a.fed < a.prompt_len and a.page_keys
                               for k in a.page_keys[len(a.table.keys):]}
                n = len(cache.index.match(job.page_keys))
                if n < len(job.page_keys) and job.page_keys[n] in pending:
                    deferred.append(waiting.popleft())   # others may pass; it keeps its place
                    continue
            total_len = job.prompt_len + job.limit - 1     # the last sampled token is never fed
            table = cache.try_admit(job.input_ids, total_len, self.max_chunk_size, reuse=reuse,
                                    keys=job.page_keys, salt=job.salt)
            if table is None:
                break
            waiting.popleft()
            job.table = table
            job.reused_tokens = table.num_tokens
            job.status = "active"
            active.append(job)
            admitted.append(job)
            if reuse and pending is not None and job.page_keys:
                pending.update(job.page_keys[len(table.keys):])
        waiting.extendleft(reversed(deferred))      # back at the front, in their order
        return admitted

    def plan(self, active: list[Job]) -> StepPlan:
        plan = StepPlan()
        budget = self.max_batch_tokens
        prefill = []
        for job in active:
            if job.fed >= job.prompt_len:
                plan.items.append(next_work(job, self.max_chunk_size))
                budget -= 1
            else:
                prefill.append(job)
        for job in prefill:
            item = next_work(job, self.max_chunk_size)
            if len(item.tokens) > budget:
                break                    # FIFO: a later, smaller chunk does not overtake
            plan.items.append(item)
            budget -= len(item.tokens)
        return plan
