"""Decode steps replayed from CUDA graphs, so the host stays off the GPU's critical path.

A decode step (every sequence feeds one token, every row wants logits, no LoRA) of a model on
CUDA launches ~10 kernels per layer; eagerly, Python and the launch queue cost more than the
kernels at batch 1. `GraphedDecoder` records the model's forward once per (batch size,
block-table width bucket) over a `StaticDecodeContext` — the paged context's tensors at fixed
addresses — and each later step copies the step's ids/positions/slots/table into those
buffers (one host-to-device copy) and replays.

Why it is exact: the graph runs the same kernels on the same values as the eager forward
(attention through the CUDA paged kernel, or `gathered_sdpa` where it does not serve; neither
reads a host value); block tables are padded with -1 to the bucket width, pages past a sequence's
length that the paged kernel never reads and the gathering path zeroes and masks. The first step of each shape
runs eagerly on a side stream (the warm-up CUDA graphs need; its logits are that step's
answer), then the same forward is recorded for later steps.

Off the GPU `GraphedDecoder(..., capture=False)` runs the static context eagerly: that is
how the CPU tests check the padding and buffer logic the graphs depend on.
"""
from __future__ import annotations

import gc
import warnings
from array import array
from collections import OrderedDict
from typing import Optional, Sequence

import torch

from ..cache.pages import PageTable
from ..cache.paged import PagedContext, step_indices, table_width

# Block tables are padded to a multiple of this many tokens' worth of pages: few graphs as sequences
# grow, while the gathered attention (whose work grows with the padded width) reads little padding.
WIDTH_BUCKET_TOKENS = 256
# Recorded (batch, width) shapes kept, least recently used dropped first, so the graphs' memory stays bounded. The
# widths are bounded already (accepts() sends steps past the rope table eagerly), but batch sizes times widths can
# pass this in a server whose batch keeps changing: then a dropped shape is recorded again when it comes back
# (GraphedDecoder.recorded counts every recording).
MAX_ENTRIES = 64


class StaticDecodeContext(PagedContext):
    """A PagedContext for S single-token rows whose tensors never move (graph inputs).

    ids, positions, slots, seq_lens_k (int64) and the block table (int32, S x width) are views of
    one device byte buffer, filled each step from one (pinned) host buffer by a single copy: a step
    costs one host-to-device transfer instead of a tensor per field plus copies into the buffers."""

    def __init__(self, cache, batch: int, width: int, num_positions: int):   # noqa: D107 - no super().__init__
        dev = cache.device
        self.cache = cache
        self.batch, self.width = batch, width
        head = 8 * 4 * batch                                  # four int64 fields of `batch` values
        nbytes = head + -(-4 * batch * width // 8) * 8
        self._dev = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        pinned = dev.type == "cuda"
        self._host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self._host_bytes = memoryview(self._host.numpy())     # the step's bytes go straight in (no tensor)
        self._copied = torch.cuda.Event() if pinned else None
        self.ids, self.positions, self.slots, self.seq_lens_k = self._dev[:head].view(torch.int64).split(batch)
        self.block_table = self._dev[head:head + 4 * batch * width].view(torch.int32).view(batch, width)
        self.cu_seqlens = torch.arange(batch + 1, dtype=torch.int64, device=dev)
        self.logit_rows = None
        self.max_q_len = 1
        self.num_positions = num_positions       # the model sizes its rope lookup from this, no sync

    def fill(self, ids: Sequence[int], tables: Sequence[PageTable]) -> None:
        """This step's values (one new token per table, pages already taken) into the fixed buffers."""
        from ..ops.attention_gathered import forget_plan
        forget_plan()                            # same tensor objects, new values: no stale plan
        if self._copied is not None:
            self._copied.synchronize()           # the previous step's copy has read the host buffer
        pos, slots, lens, rows = step_indices(tables, [1] * len(tables), self.width)
        raw = array("q", [*ids, *pos, *slots, *lens]).tobytes() + array("i", rows).tobytes()
        self._host_bytes[:len(raw)] = raw
        if self._copied is None:
            self._dev.copy_(self._host)
            return
        with torch.cuda.device(self._dev.device):    # the event must follow the copy's stream (the cache's GPU)
            self._dev.copy_(self._host, non_blocking=True)
            self._copied.record()


class _Entry:
    def __init__(self, ctx: StaticDecodeContext):
        self.ctx = ctx
        self.graph: Optional["torch.cuda.CUDAGraph"] = None
        self.logits: Optional[torch.Tensor] = None
        self.eager_only = False


class GraphedDecoder:
    def __init__(self, model, cache, max_batch: int = 64, capture: Optional[bool] = None):
        self.model, self.cache, self.max_batch = model, cache, max_batch
        self.capture = (cache.device.type == "cuda") if capture is None else capture
        cfg = model.config
        # one rope table for every graph, large enough for any position, built before capture
        self.num_positions = max(cfg.max_position_embeddings, cache.max_tokens) + 1
        self._rope = model.rope.cos_sin(self.num_positions)
        self.bucket = max(1, WIDTH_BUCKET_TOKENS // cache.page_size)      # pages
        self._entries: "OrderedDict[tuple[int, int], _Entry]" = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0
        self.recorded = 0              # shapes set up (recorded where capturing), again after an LRU drop too

    def accepts(self, lens, wants_logits, positions: int) -> bool:
        """A decode step this decoder can serve, its sequences `positions` long at most (the caller also keeps
        LoRA models off graphs: adapters change weights and per-row plans the recorded kernels would not see).
        Longer ones run eagerly: a sliding window lets a job run past the cache, and past the rope table here,
        which the eager context builds to each step's length."""
        return (0 < len(lens) <= self.max_batch and all(n == 1 for n in lens) and all(wants_logits)
                and positions <= self.num_positions)

    def run(self, ids: list[int], tables: Sequence[PageTable], device_ids: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
        """Logits (S, vocab) of this decode step (one new token per table, its page already taken
        by Cache.prepare); valid until the next call.  device_ids: the step's ids as an int64 [S] tensor on the
        cache's device (the sampler's output: lookahead.py), copied into the graph's input on the device after
        `ids` -- then placeholders -- went in with the rest."""
        s, w = len(ids), table_width(tables)
        width = -(-w // self.bucket) * self.bucket
        key = (s, width)
        e = self._entries.get(key)
        fresh = e is None
        if fresh:
            e = self._entries[key] = _Entry(StaticDecodeContext(self.cache, s, width, self.num_positions))
            self.recorded += 1
            if len(self._entries) > MAX_ENTRIES:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        e.ctx.fill(ids, tables)
        if device_ids is not None:
            e.ctx.ids.copy_(device_ids)          # the fill's copy is queued before it, on the same stream
        if not self.capture:
            return self.model.forward(e.ctx.ids, e.ctx)
        if fresh:
            return self._record(e)
        if e.eager_only:
            return self.model.forward(e.ctx.ids, e.ctx)
        e.graph.replay()
        self.replays += 1
        return e.logits

    def _record(self, e: _Entry) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            eager = self.model.forward(e.ctx.ids, e.ctx)                  # warm-up: also this step's answer
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # the warm-up left its attention plan cached for these very tensors: a capture that reused it
        # would replay that step's masks and pages forever; the graph must compute its own
        from ..ops.attention_gathered import forget_plan
        forget_plan()
        # torch.cuda.graph collects garbage before it starts; a collection during the capture could free objects
        # holding CUDA graphs, events or pinned memory, whose release is not permitted while a stream captures and
        # invalidates the capture silently (bench/graph_capture_probe.py: an abandoned Generator's graphs).  The switch
        # is process-wide: captures are meant to run on one thread at a time (torch's default capture mode)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                e.logits = self.model.forward(e.ctx.ids, e.ctx)
            e.graph = graph
        except RuntimeError as exc:      # some kernel of this model cannot be recorded: stay eager, say so
            warnings.warn(f"CUDA graph capture failed ({exc}); decoding this batch shape eagerly")
            e.eager_only = True
        finally:
            if collecting:
                gc.enable()
        return eager
