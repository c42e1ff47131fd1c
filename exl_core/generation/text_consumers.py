"""The Generator's text-level consumers, on top of its routing (routing.py): `generate` (prompts in, texts out) and
`stream` (one job's text pieces), each a consumer of its jobs, so a step's results and errors reach it whichever
thread runs that step. A mixin of `Generator` (generator.py), which owns `_lock`, `enqueue`, `cancel`, `tokenizer`,
`_step_routed`, `_attach` / `_detach`."""
from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator, Optional, Sequence, Union

from ..errors import InputError
from .job import Job
from .routing import next_result
from .sampling import SamplerSettings


class TextConsumers:
    def _encode(self, prompt: str, chat: bool) -> list[int]:
        if self.tokenizer is None:
            raise InputError("Generator: text prompts need a tokenizer; pass Job(input_ids=...) instead")
        if not isinstance(prompt, str):
            raise InputError(f"Generator: prompt must be a str, got {type(prompt).__name__}")
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True)
            return self.tokenizer.encode(text, add_bos=False, special=True)
        return self.tokenizer.encode(prompt)

    def _make_job(self, prompt: str, chat: bool, **kw) -> Job:
        ids = self._encode(prompt, chat)
        if not ids:
            raise InputError("Generator: the prompt encodes to no tokens (empty prompt)")
        return Job(ids, **kw)

    def generate(self, prompts: Union[str, Sequence[str]], max_new_tokens: int = 256,
                 sampler: Optional[SamplerSettings] = None, stop: Optional[Sequence[Union[str, int]]] = None,
                 seed: Optional[int] = None, chat: bool = False, stop_on_eos: bool = True,
                 **job_kwargs) -> Union[str, list[str]]:
        """Generate for one prompt (returns str) or a batch (returns list[str], run together).
        Every job gets the same `seed` (so each is reproducible alone or batched). Other
        jobs already queued advance too; their results reach them through their callbacks."""
        single = isinstance(prompts, str)
        if not single and not isinstance(prompts, Iterable):   # None, a Job: list() would raise a bare TypeError
            raise InputError(f"Generator.generate: prompts must be a str or a list of str, got "
                             f"{type(prompts).__name__}; enqueue a Job for token ids")
        plist = [prompts] if single else list(prompts)
        jobs = [self._make_job(p, chat, max_new_tokens=max_new_tokens, sampler=sampler, stop=stop, seed=seed,
                               stop_on_eos=stop_on_eos, **job_kwargs) for p in plist]
        # a consumer of its jobs (routing.py): the error that ends one reaches it whichever thread ran that step
        sinks = [deque() for _ in jobs]
        puts = [items.append for items in sinks]
        for j, put in zip(jobs, puts):
            self._attach(j, put)
        try:
            self.enqueue(jobs)
            while True:
                with self._lock:     # done is set in the section that routed the job's error
                    done = all(j.done for j in jobs)
                for items in sinks:
                    while items:        # popleft: a step on another thread may append meanwhile
                        next_result(items)
                if done:
                    break
                self._step_routed()
        except BaseException:
            for j in jobs:          # every job, whatever its callback does when told it was cancelled
                try:
                    self.cancel(j)
                except Exception:   # noqa: BLE001 - the step's error is the one to raise
                    pass
            raise
        finally:
            for j, put in zip(jobs, puts):
                self._detach(j, put)
        texts = [j.text for j in jobs]
        return texts[0] if single else texts

    def _job_of(self, prompt: Union[str, Job], max_new_tokens: Optional[int], chat: bool, job_kwargs: dict,
                what: str) -> Job:
        """stream / astream's job: the Job given (which carries its own settings: none may be passed beside it), or
        one made from the prompt (max_new_tokens 256 when None)."""
        if isinstance(prompt, Job):
            given = (["max_new_tokens"] if max_new_tokens is not None else []) + (["chat"] if chat else [])
            if given or job_kwargs:
                raise InputError(f"Generator.{what}: a Job carries its own settings; {given + list(job_kwargs)} "
                                 "would be ignored (set them on the Job, or pass a prompt string)")
            return prompt
        return self._make_job(prompt, chat, max_new_tokens=256 if max_new_tokens is None else max_new_tokens,
                              **job_kwargs)

    def stream(self, prompt: Union[str, Job], max_new_tokens: Optional[int] = None, chat: bool = False,
               **job_kwargs) -> Iterator[str]:
        """Text pieces of one job as they are produced (max_new_tokens: 256 by default). Closing the iterator
        cancels the job: leaving a `for` loop over it, or `.close()` where the iterator is kept in a variable."""
        job = self._job_of(prompt, max_new_tokens, chat, job_kwargs, "stream")
        items: deque = deque()      # its results and errors, from whoever runs the steps (routing.py)
        sink = items.append
        self._attach(job, sink)
        try:
            self.enqueue(job)
        except BaseException:
            self._detach(job, sink)
            raise
        try:
            while True:
                with self._lock:    # done is set in the locked section that routed the job's last result
                    done = job.done
                while items:
                    r = next_result(items)
                    if r.text:
                        yield r.text
                    if r.done:
                        return
                if done:
                    return
                self._step_routed()     # its results and errors reach `items`, and the other consumers'
        finally:
            self._detach(job, sink)
            if not job.done:
                self.cancel(job)
