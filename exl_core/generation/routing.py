"""How a Generator's results reach the consumers of single jobs (stream, astream, generate, the adapters'
SharedEngine), whoever runs the step: a mixin of `Generator` (generator.py), which owns `_lock`, `_events` and
`_stepping`.

A consumer attaches a sink (a non-blocking callable) to its job before enqueueing it. Every JobResult is handed to
its job's sink exactly once, under the generator's lock, in the locked section that made it (a step's results when
the step ends, a job's own before its end; a cancel()'s result at once, or at the end of the step a callback called
it from): a consumer that reads `job.done` under the lock has its job's last piece already. A step's error goes to
the sinks of the jobs it ended (a token filter, a sampler, a callback that raised), or, where it ended none (a
failed forward), to every consumer whose job was running, and those jobs are cancelled. A cancel asked for
where the lock is busy (an event loop must not wait for a step) goes to an inbox, drained by the section holding the
lock or by a pool thread that waits for it."""
from __future__ import annotations

import concurrent.futures
import threading
import traceback
from collections import deque
from typing import Callable, NamedTuple, Optional

from ..errors import InputError
from .job import Job, JobResult

Sink = Callable[[object], None]     # gets a JobResult or an exception; must not block

_POOL: Optional[concurrent.futures.ThreadPoolExecutor] = None
_POOL_LOCK = threading.Lock()


def pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for work that waits for a generator's lock on behalf of callers that must not (event loops)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="exl-generator")
        return _POOL


class _Attached(NamedTuple):
    job: Job
    sink: Sink


def result_or_raise(item) -> JobResult:
    """A consumer's queue item: the result, or the routed error raised -- from this frame, which keeps no reference
    to it (a caller's local would hold the exception whose traceback holds the caller: a cycle). Pass the item
    straight in (`result_or_raise(q.get())`), not through a local."""
    if isinstance(item, BaseException):
        try:
            raise item
        finally:
            del item
    return item


def next_result(items: deque) -> JobResult:
    """A consumer's next item (it has one), as result_or_raise gives it."""
    return result_or_raise(items.popleft())


def _by_end(results: list[JobResult]) -> list[JobResult]:
    """Each job's running results before its final one (a step's callbacks may end a job before its token's
    result is filed)."""
    return sorted(results, key=lambda r: r.finish_reason is not None)


class Routing:
    def _init_routing(self) -> None:
        self._sinks: dict[int, _Attached] = {}      # id(job) -> its consumer
        self._cancel_inbox: deque = deque()          # jobs to cancel at the next locked section
        self._orphan_error: Optional[BaseException] = None   # ended never-consumed jobs in a consumer's step

    def _attach(self, job: Job, sink: Sink) -> None:
        """Give `job` a consumer (before it is enqueued: none of its results can be missed). One consumer a job."""
        entry = _Attached(job, sink)
        if self._sinks.setdefault(id(job), entry) is not entry:   # atomic: two consumers racing for one job
            raise InputError(f"Generator: {job!r} was already enqueued and is streamed by another consumer; "
                             "create a new Job")

    def _detach(self, job: Job, sink: Sink) -> None:
        entry = self._sinks.get(id(job))
        if entry is not None and entry.job is job and entry.sink is sink:
            self._sinks.pop(id(job), None)

    def _tell(self, entry: _Attached, item) -> bool:
        try:
            entry.sink(item)
            return True
        except Exception:  # noqa: BLE001 - the consumer is gone (its event loop closed): its job has no reader left
            self._sinks.pop(id(entry.job), None)
            if not entry.job.done:
                self._cancel_inbox.append(entry.job)
            return False

    def _route(self, results: list[JobResult]) -> bool:
        """Hands each result not handed yet to its job's sink (under the lock); whether any had one."""
        told = False
        for r in results:            # each job's end after its other results (_step_locked orders a failed step's)
            if r._routed:
                continue
            r._routed = True
            entry = self._sinks.get(id(r.job))
            if entry is not None and entry.job is r.job:
                told = self._tell(entry, r) or told
        return told

    def _route_error(self, error: BaseException, ended: set) -> None:
        """A failed step's error: to the consumers of the jobs it ended (`ended`: their ids) instead of their
        cancelled results; the other pending results as usual. Where it ended none: to every consumer of a running
        job (not of one still queued, which the next step may run), and those jobs end."""
        for r in self._events:
            if r._routed:
                continue
            r._routed = True
            entry = self._sinks.get(id(r.job))
            if entry is not None and entry.job is r.job:
                self._tell(entry, error if id(r.job) in ended else r)
        if not ended:
            for entry in list(self._sinks.values()):
                if entry.job.status == "active":
                    self._tell(entry, error)
                    self._cancel_inbox.append(entry.job)   # after its error: the consumer stops there

    def _cancel_soon(self, job: Job) -> None:
        """Cancel now where the lock is free, else once it is (never waits for a step)."""
        if self._lock.acquire(blocking=False):
            try:
                self._cancel_quiet(job)
            finally:
                self._lock.release()
        else:
            self._cancel_inbox.append(job)
            # a step drains the inbox before it lets the lock go (its flag is read after the append); another holder
            # (an enqueue, a LoRA change) may not, so a pool thread waits for the lock then
            if not self._stepping:
                pool().submit(self._drain_cancels_now)

    def _drain_cancels_now(self) -> None:
        """The inbox drained by a caller that may wait for the lock (a pool thread, the adapters' engine worker)."""
        if self._cancel_inbox:
            with self._lock:
                self._drain_cancels()

    def _drain_cancels(self) -> None:
        while self._cancel_inbox:
            self._cancel_quiet(self._cancel_inbox.popleft())

    def _cancel_quiet(self, job: Job) -> None:
        """cancel(), whose only caller is gone: the job's own callback raising on its result must not reach here."""
        try:
            self.cancel(job)
        except Exception:  # noqa: BLE001 - that job's callback; its consumer was told before it ran
            pass

    def _step_routed(self, consumer: bool = True) -> tuple[list[JobResult], Optional[BaseException], bool]:
        """One iterate() step whose results and errors reach the attached consumers: (results, the step's error or
        None, whether that error ended a job). Errors raised before a step (a step inside a step) are raised. A
        consumer's step (a stream, a driver) that ends a job no consumer ever had keeps the error for the next plain
        iterate() (consumer=False), whose caller owns such jobs; that one takes it instead of stepping."""
        with self._lock:
            if self._stepping:   # a callback or token filter stepping its own generator: jobs sit mid-step there
                raise InputError("Generator.iterate: called from inside a step (a job's callback or token_filter); "
                                 "enqueue or cancel jobs there, and step the generator from outside")
            if not consumer and self._orphan_error is not None:
                err, self._orphan_error = self._orphan_error, None
                return [], err, True
            self._drain_cancels()
            try:
                results = self._step_locked()
            except Exception as e:     # noqa: BLE001 - _step_locked left the pending results in _events
                ended = {id(r.job): r.job for r in self._events if not r._routed and r._by_error}
                if consumer and self._orphan_error is None and \
                        not all(j._consumed for j in ended.values()):
                    self._orphan_error = _detached(e)
                self._route_error(e, set(ended))
                self._drain_cancels()
                return [], e, bool(ended)
            self._route(results)
            self._route(self._events)     # cancels a callback made during the step: after the step's own results
            self._drain_cancels()
            return results, None, False


def _detached(e: BaseException) -> BaseException:
    """`e` kept past its step for another caller: without its traceback, whose frames hold the Generator (a cycle
    through this attribute the collector would have to find); the traceback's text goes in a note."""
    if hasattr(e, "add_note"):      # Python 3.11+
        e.add_note("raised in a step another consumer of this generator ran:\n"
                   + "".join(traceback.format_tb(e.__traceback__)).rstrip())
    return e.with_traceback(None)
