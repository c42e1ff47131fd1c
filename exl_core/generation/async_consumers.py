"""The Generator's asyncio consumers (aiterate, astream, astream_results): steps run in a worker thread, one driver
task per generator hands each step's results to the queue of the job they belong to, and a step's error goes to the
consumers whose jobs it ended (or to all where it ended none). A mixin of `Generator` (generator.py), which owns the
state it uses: `_lock`, `_events`, `_queues`, `_driver`, `iterate`, `enqueue`, `cancel`, `has_work`, `_job_of`."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional, Union

from .job import Job, JobResult


class AsyncConsumers:
    async def aiterate(self) -> AsyncIterator[JobResult]:
        """Results of every job while there is work; each step runs in a worker thread so the
        event loop stays responsive."""
        while self.has_work():
            for r in await asyncio.to_thread(self.iterate):
                yield r

    async def _drive(self) -> None:
        # One driver per event loop: steps run in a thread, results go to each astream's queue.
        try:
            while self._queues and self.has_work():
                try:
                    results = await asyncio.to_thread(self.iterate)
                except Exception as e:          # noqa: BLE001 - handed to the consumers, not lost in this task
                    if not self._route_step_error(e):
                        return
                    continue
                for r in results:
                    q = self._queues.get(id(r.job))
                    if q is not None:
                        q.put_nowait(r)
        finally:
            self._driver = None

    def _route_step_error(self, e: Exception) -> bool:
        """A step's error for the astream consumers: raised in those whose jobs it ended (their cancelled results
        wait in the events; the other events go out as usual) and the driver goes on for the rest (True); where it
        ended no job (a failed forward), raised in every consumer (False: the driver stops, each consumer's exit
        cancels its job)."""
        with self._lock:
            events, self._events = self._events, []
        ended = {id(r.job) for r in events if r.finish_reason == "cancelled"}
        for r in events:
            q = self._queues.get(id(r.job))
            if q is not None:
                q.put_nowait(e if id(r.job) in ended else r)
        if ended:
            return True
        for q in self._queues.values():
            q.put_nowait(e)
        return False

    async def astream_results(self, job: Job) -> AsyncIterator[JobResult]:
        """Async results of one job; several may run concurrently on one generator."""
        q: asyncio.Queue = asyncio.Queue()
        # enqueue first: a refused job (queued already, perhaps streamed by another consumer) is left as it was, and
        # so is that consumer's queue; no await until the queue is in place, so no result of this job is missed
        self.enqueue(job)
        self._queues[id(job)] = q
        try:
            if self._driver is None:
                self._driver = asyncio.ensure_future(self._drive())
            while True:
                r = await q.get()
                if isinstance(r, BaseException):    # the step that ended this job raised (_route_step_error)
                    raise r
                yield r
                if r.done:
                    break
        finally:
            if self._queues.get(id(job)) is q:
                del self._queues[id(job)]
            if not job.done:
                self.cancel(job)

    async def astream(self, prompt: Union[str, Job], max_new_tokens: Optional[int] = None, chat: bool = False,
                      **job_kwargs) -> AsyncIterator[str]:
        """Async text pieces of one prompt (see `stream`)."""
        job = self._job_of(prompt, max_new_tokens, chat, job_kwargs, "astream")
        async for r in self.astream_results(job):
            if r.text:
                yield r.text
