"""Pipelined decode: the next decode step is launched before this step's tokens reach the host.

Why: with CUDA graphs a decode step's GPU work is one replay, but the Generator's host work around it -- reading the
sampled tokens, stop checks, text, callbacks, the next plan and its buffers -- ran while the GPU waited.  On the H200
the Generator decoded a 7B-shaped GPTQ model at 435.6 / 2,331.8 / 7,058.8 tok/s (batch 1 / 8 / 32) where the same
model's graphed steps alone run 518.9 / 2,652.2 / 8,252.5 (bench/results/gpu_generator.json, gpu_h200.json, stop 29).

How: right after sampling, where the batch will decode again as it is (every active job was sampled this step, none
reaches its token limit with this token, no job waits to join, the step fits a CUDA graph), `draw` copies the tokens
to pinned host memory, then replays the next step's graph with the sampled ids copied on the device into its input
(GraphedDecoder.run's device_ids), and only then waits for the copy -- which was queued before that replay, so the
wait does not include it.  The host does this step's work while the GPU runs the next.  Measured (stop 30 call 4,
same call): 1.2892x / 1.2074x / 1.2132x at batch 1 / 8 / 32, the Generator then at 0.9983x / 1.0229x / 1.0211x the
bench's graphed steps (bench/results/gpu_generator.json).  EXL_CORE_GEN_LOOKAHEAD=0 or Generator(lookahead=False): off.

Exact: the launched step is the one the next `iterate` would run -- same jobs in the same order, at the same
positions, fed the tokens the host accepts (the device's sampled ids), through the same graph -- and `take` hands out
its logits only if the next plan is exactly that.  Otherwise (a stop string, EOS, a callback or cancel ended a job, a
job joined) it is dropped and the plan runs as usual: the jobs that go on have the same slots written again by that
forward; the slots written for a job that ended lie in pages released to the pool (later writes come after, in
stream order) and past its stored tokens, so no prefix-index page changes.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Optional

import torch

from ..model.lora import lora_manager
from .logprobs import check_row_max


class Lookahead:
    def __init__(self, generator):
        # a weak reference: a cycle with its generator would leave an abandoned Generator (its CUDA graphs, events,
        # pinned buffers) to Python's cycle collector, which can run inside a later graph capture -- destroying a
        # graph there invalidates that capture (bench/graph_capture_probe.py found it; cuda_graphs.py also keeps the
        # collector off while it captures)
        self._gen = weakref.ref(generator)
        self._pending: Optional[tuple] = None      # (jobs, their positions, their tokens, logits) of a launched step
        self._pinned: Optional[tuple[torch.Tensor, ...]] = None     # host ids, logprobs, row maxima
        self._copied: Optional[torch.cuda.Event] = None               # recorded after their copy, each step

    @property
    def gen(self):
        return self._gen()

    def take(self, plan) -> Optional[torch.Tensor]:
        """The logits of the step launched last time, where `plan` is exactly that step; else None (and the step is
        dropped).  Counted in the generator's stats (lookahead_used / lookahead_dropped)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        jobs, starts, tokens, logits = pending
        items = plan.items
        if len(items) != len(jobs) or lora_manager(self.gen.model) is not None or any(
                i.job is not j or i.start != s or i.tokens != [t] or not i.wants_logits
                for i, j, s, t in zip(items, jobs, starts, tokens)):
            self.gen.stats.lookahead_dropped += 1
            return None
        self.gen.stats.lookahead_used += 1
        return logits

    def draw(self, jobs: list, tok: torch.Tensor, lp: torch.Tensor, row_max: Optional[torch.Tensor] = None
             ) -> tuple[list[int], list[float], Optional[list]]:
        """(this step's sampled ids, their logprobs, None) as host lists; where the batch decodes again as it is, the
        next step is launched first (module docstring).  row_max: the sampler's row maxima still to be checked
        (sampling.sample_batch_unchecked), read with the ids -- so the launch need not wait for this step's logits.
        Without a launch a failed check raises here, as sample_batch would.  After one the logits buffer may hold the
        next step's values already, so nothing may be sampled again: the launched step is dropped and the third item
        is, per row, the error sample_batch would raise for that row alone, or None (the row's values stand)."""
        if not self._continues(jobs):
            if row_max is not None:
                check_row_max(row_max)
            return tok.tolist(), lp.tolist(), None
        read = self._to_host(tok, lp, row_max)     # queued before the launch: reading it does not wait for the step
        gen = self.gen
        try:
            logits = gen._graph_step([0] * len(jobs), [j.table for j in jobs], device_ids=tok)
        except Exception as e:   # noqa: BLE001 - this step's tokens must still be read and accepted
            warnings.warn(f"Generator: the lookahead launch failed ({e!r}); decoding without it from now on")
            gen.lookahead = None
            logits = None
        toks, lps, maxes = read()
        bad = None if maxes is None else _row_errors(maxes)
        if bad is not None and logits is not None:  # the launched step was fed a row that cannot be sampled
            gen.stats.lookahead_dropped += 1
        elif logits is not None:
            self._pending = (list(jobs), [j.fed for j in jobs], toks, logits)
        return toks, lps, bad

    def _continues(self, jobs: list) -> bool:
        """Whether the next plan will be these jobs, one decode token each, through a graph: every active job
        sampled now (so none is prefilling), none at its last token, nobody waiting, a shape the graphs take."""
        gen = self.gen
        n = len(jobs)
        return (n == len(gen.active) and not gen.waiting and all(a is b for a, b in zip(jobs, gen.active))
                and all(j.status == "active" and len(j.generated) + 1 < j.limit for j in jobs)
                and gen._graphable([1] * n, [True] * n, 1 + max(len(j.tokens) for j in jobs)))

    def _to_host(self, tok: torch.Tensor, lp: torch.Tensor, row_max: Optional[torch.Tensor]):
        """A function returning (tok list, lp list, row_max on the host or None), their device-to-host copy queued
        now."""
        if not tok.is_cuda:
            return lambda: (tok.tolist(), lp.tolist(), row_max)
        n = tok.numel()
        if self._pinned is None or self._pinned[0].numel() < n:
            size = max(n, 64)
            self._pinned = (torch.empty(size, dtype=torch.int64, pin_memory=True),
                            torch.empty(size, dtype=torch.float32, pin_memory=True),
                            torch.empty(size, dtype=torch.float32, pin_memory=True))
        ht, hl, hm = (b[:n] for b in self._pinned)
        with torch.cuda.device(tok.device):
            ht.copy_(tok, non_blocking=True)
            hl.copy_(lp, non_blocking=True)
            if row_max is not None:
                hm.copy_(row_max, non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            done = self._copied
            done.record()

        def read():
            done.synchronize()
            return ht.tolist(), hl.tolist(), None if row_max is None else hm
        return read


def _row_errors(maxes: torch.Tensor) -> Optional[list]:
    """Per row, the error check_row_max raises for that row alone (sample_batch's message for a one-row batch), or
    None; None for all rows fine (one check: the rows one by one only after it failed)."""
    try:
        check_row_max(maxes)
        return None
    except Exception:   # noqa: BLE001 - which rows, below
        pass
    errors = []
    for r in range(maxes.numel()):
        try:
            check_row_max(maxes[r:r + 1])
            errors.append(None)
        except Exception as e:   # noqa: BLE001 - kept for the row's job
            errors.append(e)
    return errors if any(e is not None for e in errors) else None
