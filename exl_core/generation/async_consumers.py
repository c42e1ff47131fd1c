"""The Generator's asyncio consumers (aiterate, astream, astream_results). A mixin of `Generator` (generator.py) on
top of its routing (routing.py): an astream attaches a sink that puts its job's results (or the error of the step
that ended it) into its queue thread-safely, whoever runs the steps -- one driver task per event loop, other
loops' drivers, a thread's stream() or generate(). The event loop never waits for a step: the enqueue runs in a
thread when the generator's lock is busy, and a consumer's exit cancels through routing's inbox."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional, Union

from .job import Job, JobResult
from .routing import pool, result_or_raise


class AsyncConsumers:
    async def aiterate(self) -> AsyncIterator[JobResult]:
        """Results of every job while there is work; each step runs in a worker thread so the
        event loop stays responsive."""
        while self.has_work():
            for r in await asyncio.to_thread(self.iterate):
                yield r

    def _has_consumers_on(self, loop) -> bool:
        return any(getattr(e.sink, "loop", None) is loop for e in list(self._sinks.values()))

    async def _drive(self, loop) -> None:
        # This loop's driver: steps run in a thread while its astreams wait; results reach them by routing.
        try:
            while self._has_consumers_on(loop) and self._has_jobs():
                if await asyncio.to_thread(self._driver_step):
                    await asyncio.sleep(0)    # a failed forward: its consumers heard it; one attached since goes on
        finally:
            if self._drivers.get(loop) is asyncio.current_task():
                del self._drivers[loop]

    def _driver_step(self) -> bool:
        """A step for a driver: whether it was a failed forward (the error itself stays in this thread's frame,
        which ends here: a future holding it would keep the Generator in a cycle)."""
        _, err, ended = self._step_routed()
        failed = err is not None and not ended
        del err       # its traceback holds this frame
        return failed

    def _ensure_driver(self, loop) -> None:
        task = self._drivers.get(loop)
        if task is None or task.done():
            self._drivers[loop] = loop.create_task(self._drive(loop))

    async def _enqueue_nowait(self, job: Job) -> None:
        """enqueue() without holding the event loop for a running step; a task cancelled meanwhile leaves no job
        running (the thread's enqueue, once done, is cancelled)."""
        if self._lock.acquire(blocking=False):
            try:
                self.enqueue(job)
                return
            finally:
                self._lock.release()
        fut = pool().submit(self.enqueue, job)   # concurrent.futures: a running one is not cancelled with the task
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or self._cancel_soon(job))
            raise

    async def astream_results(self, job: Job) -> AsyncIterator[JobResult]:
        """Async results of one job; several may run concurrently on one generator, from any event loops."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        sink = LoopSink(loop, q)
        # attached before the enqueue, so no result of this job is missed; a job already queued (perhaps streamed by
        # another consumer) is refused and left as it was, with that consumer's sink
        self._attach(job, sink)
        try:
            await self._enqueue_nowait(job)
        except BaseException:
            self._detach(job, sink)
            raise
        try:
            self._ensure_driver(loop)
            while True:
                r = result_or_raise(await q.get())     # the step that ended this job may have raised (routing.py)
                yield r
                if r.done:
                    break
        finally:
            self._detach(job, sink)
            if not job.done:
                self._cancel_soon(job)

    async def astream(self, prompt: Union[str, Job], max_new_tokens: Optional[int] = None, chat: bool = False,
                      **job_kwargs) -> AsyncIterator[str]:
        """Async text pieces of one prompt (see `stream`)."""
        job = self._job_of(prompt, max_new_tokens, chat, job_kwargs, "astream")
        async for r in self.astream_results(job):
            if r.text:
                yield r.text


class LoopSink:
    """Puts into an asyncio queue from any thread (routing calls sinks on whichever thread ran the step)."""
    __slots__ = ("loop", "queue")

    def __init__(self, loop, queue: asyncio.Queue):
        self.loop, self.queue = loop, queue

    def __call__(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)   # raises once the loop is closed
