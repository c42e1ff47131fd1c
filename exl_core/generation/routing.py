"""How a Generator's results reach the consumers of single jobs (stream, astream, the adapters' SharedEngine),
whoever runs the step: a mixin of `Generator` (generator.py), which owns `_lock` and `_events`.

A consumer attaches a sink (a non-blocking callable) to its job before enqueueing it. Every JobResult is handed to
its job's sink exactly once, under the generator's lock, in the same locked section that made it (a step's results
when the step ends, a cancel()'s result at once): a consumer that reads `job.done` under the lock has its job's
last piece already. A step's error goes to the sinks of the jobs it ended (a token filter, a sampler, a callback
that raised), or to every sink where it ended none (a failed forward). A cancel asked for where the lock is busy
(an event loop must not wait for a step) goes to an inbox the next locked section drains."""
from __future__ import annotations

from collections import deque
from typing import Callable, NamedTuple, Optional

from ..errors import InputError
from .job import Job, JobResult

Sink = Callable[[object], None]     # gets a JobResult or an exception; must not block


class _Attached(NamedTuple):
    job: Job
    sink: Sink


class Routing:
    def _init_routing(self) -> None:
        self._sinks: dict[int, _Attached] = {}      # id(job) -> its consumer
        self._cancel_inbox: deque = deque()          # jobs to cancel at the next locked section
        self._orphan_error: Optional[BaseException] = None   # ended unconsumed jobs in a consumer's step

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

    def _tell(self, entry: _Attached, item) -> None:
        try:
            entry.sink(item)
        except Exception:  # noqa: BLE001 - the consumer is gone (its event loop closed): its job has no reader left
            self._sinks.pop(id(entry.job), None)
            if not entry.job.done:
                self._cancel_inbox.append(entry.job)

    def _route(self, results: list[JobResult]) -> None:
        """Hands each result not handed yet to its job's sink (under the lock)."""
        for r in results:
            if r._routed:
                continue
            r._routed = True
            entry = self._sinks.get(id(r.job))
            if entry is not None and entry.job is r.job:
                self._tell(entry, r)

    def _route_error(self, error: BaseException, ended: set) -> None:
        """A failed step's error: to the consumers of the jobs it ended (`ended`: their ids) instead of their
        cancelled results; the other pending results as usual; to every consumer where it ended no job."""
        for r in self._events:
            if r._routed:
                continue
            r._routed = True
            entry = self._sinks.get(id(r.job))
            if entry is not None and entry.job is r.job:
                self._tell(entry, error if id(r.job) in ended else r)
        if not ended:
            for entry in list(self._sinks.values()):
                self._tell(entry, error)

    def _take_orphan_error(self) -> Optional[BaseException]:
        with self._lock:
            err, self._orphan_error = self._orphan_error, None
            return err

    def _cancel_soon(self, job: Job) -> None:
        """Cancel now where the lock is free, else at the end of the section holding it (never waits for a step)."""
        if self._lock.acquire(blocking=False):
            try:
                self._cancel_quiet(job)
            finally:
                self._lock.release()
        else:
            self._cancel_inbox.append(job)

    def _drain_cancels_now(self) -> None:
        """The inbox drained by a caller that may wait for the lock (the adapters' engine worker between steps)."""
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
        consumer's step (a stream, a driver) that ends a job nobody consumes keeps the error for the next plain
        iterate(), whose caller owns such jobs."""
        with self._lock:
            if self._stepping:   # a callback or token filter stepping its own generator: jobs sit mid-step there
                raise InputError("Generator.iterate: called from inside a step (a job's callback or token_filter); "
                                 "enqueue or cancel jobs there, and step the generator from outside")
            self._drain_cancels()
            try:
                results = self._step_locked()
            except Exception as e:     # noqa: BLE001 - _step_locked left the pending results in _events
                ended = {id(r.job) for r in self._events if not r._routed and r._by_error}
                if consumer and self._orphan_error is None and any(j not in self._sinks for j in ended):
                    self._orphan_error = e
                self._route_error(e, ended)
                self._drain_cancels()
                return [], e, bool(ended)
            self._route(results)
            self._drain_cancels()
            return results, None, False
