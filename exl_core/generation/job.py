"""A generation request (`Job`) and what each step reports about it (`JobResult`)."""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from ..errors import InputError, is_bool, is_int
from .sampling import SamplerSettings

FINISH_REASONS = ("stop", "length", "eos", "cancelled", "callback")

TokenFilter = Callable[[list[int], torch.Tensor], Optional[torch.Tensor]]
_ids = itertools.count()


@dataclass
class JobResult:
    """One step's news about one job.

    text: newly released text (stop strings and text that may still become one held back);
    token_ids: the new token(s) (empty when only held-back text was flushed or on cancel);
    finish_reason: None while running, else one of FINISH_REASONS;
    logprobs: log-probability of each new token under the model (when the job asked)."""
    job: "Job"
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    logprobs: Optional[list[float]] = None
    _routed: bool = field(default=False, repr=False, compare=False)    # handed to its consumer (routing.py)
    _by_error: bool = field(default=False, repr=False, compare=False)  # its job ended by the step's error

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def identifier(self) -> Any:
        return self.job.identifier


class Job:
    """A prompt (token ids) and how to continue it.

    callback(result) is called for every JobResult of this job; returning False stops the job
    (finish reason "callback") and frees its pages. token_filter(ids, logits) sees the job's
    token history (prompt + generated) and its float32 logits row [V] before sampling and may
    return a replacement row (or edit it in place and return None). stop: strings (matched on
    the decoded text, never emitted) and/or token ids (the token is not emitted either).
    loras: {adapter name: weight} of adapters loaded with exl_core.load_lora, applied on the
    fly to this job's rows only.
    """

    def __init__(self, input_ids: Union[Sequence[int], torch.Tensor], max_new_tokens: int = 256,
                 sampler: Optional[SamplerSettings] = None, stop: Optional[Sequence[Union[str, int]]] = None,
                 seed: Optional[int] = None, stop_on_eos: bool = True,
                 callback: Optional[Callable[[JobResult], Optional[bool]]] = None,
                 token_filter: Optional[TokenFilter] = None, return_logprobs: bool = False,
                 identifier: Any = None, decode_special: bool = False,
                 loras: Optional[dict[str, float]] = None):
        if isinstance(input_ids, torch.Tensor):
            # one prompt per Job: flattening a (batch, T) tensor would silently join its rows
            if input_ids.dim() != 1:
                raise InputError(f"Job: input_ids must be a 1-D tensor or a list of ints (one prompt), got a "
                                 f"{input_ids.dim()}-D tensor of shape {list(input_ids.shape)}; for a batch make "
                                 "one Job per row (e.g. Job(ids[0]))")
            input_ids = input_ids.tolist()
        if isinstance(input_ids, str):
            raise InputError("Job: input_ids must be token ids, got a str; encode it first (tokenizer.encode)")
        try:
            ids = list(input_ids)
        except TypeError:
            raise InputError(f"Job: input_ids must be a 1-D tensor or a list of ints, got "
                             f"{type(input_ids).__name__}") from None
        if not ids:
            raise InputError("Job: input_ids is empty; a prompt needs at least one token (e.g. BOS)")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise InputError("Job: input_ids must be non-negative ints")
        if not is_int(max_new_tokens) or max_new_tokens < 1:     # is_int: True is no count
            raise InputError(f"Job: max_new_tokens={max_new_tokens!r} must be an int >= 1")
        if isinstance(stop, str) or is_int(stop):     # a single stop string / token, not a sequence of chars
            stop = [stop]
        try:
            stop = list(stop) if stop is not None else []
        except TypeError:      # 5.5, an object: list() names neither the argument nor what it takes
            raise InputError(f"Job: stop={stop!r:.60} must be a string, a token id or a list of them (or None)") \
                from None
        for s in stop:
            if not ((isinstance(s, str) and s) or (is_int(s) and s >= 0)):
                raise InputError(f"Job: stop entry {s!r} must be a non-empty string or a token id")
        if sampler is not None and not isinstance(sampler, SamplerSettings):
            # a dict or a name would pass here and fail at enqueue as an AttributeError
            hint = " (e.g. SamplerSettings(**sampler))" if isinstance(sampler, dict) else ""
            raise InputError(f"Job: sampler must be a SamplerSettings or None, got {type(sampler).__name__}{hint}")
        for name, fn in (("callback", callback), ("token_filter", token_filter)):
            if fn is not None and not callable(fn):     # else a TypeError mid-generation, after its pages are taken
                raise InputError(f"Job: {name} must be callable or None, got {type(fn).__name__}")
        if loras is not None and not isinstance(loras, Mapping):    # dict() takes pairs, fails on the rest
            raise InputError(f"Job: loras={loras!r:.60} must be a mapping of adapter name to weight, e.g. "
                             "{'my_adapter': 1.0} (or None)")
        flags = {}
        for name, v in (("stop_on_eos", stop_on_eos), ("return_logprobs", return_logprobs),
                        ("decode_special", decode_special)):
            if not is_bool(v):
                raise InputError(f"Job: {name}={v!r:.60} must be True or False")
            flags[name] = bool(v)
        stop_on_eos, return_logprobs, decode_special = flags.values()
        if seed is not None:
            # int() would take "5" or 5.7 and fail on "abc" with a bare ValueError; index() takes numpy ints
            try:
                if isinstance(seed, bool):
                    raise TypeError
                seed = operator.index(seed)
                if not -2**63 <= seed < 2**64:      # torch.Generator.manual_seed's range
                    raise TypeError
            except TypeError:
                raise InputError(f"Job: seed={seed!r} must be an int in [-2**63, 2**64) (or None for a random "
                                 "seed)") from None
        self.input_ids = ids
        self.max_new_tokens = int(max_new_tokens)
        self.sampler = sampler if sampler is not None else SamplerSettings()
        self.stop_strings = [s for s in stop if isinstance(s, str)]
        self.stop_tokens = {int(s) for s in stop if not isinstance(s, str)}
        self.seed = seed
        self.stop_on_eos = stop_on_eos
        self.callback = callback
        self.token_filter = token_filter
        self.return_logprobs = return_logprobs
        self.identifier = identifier if identifier is not None else next(_ids)
        self.decode_special = decode_special
        self.loras = dict(loras) if loras else {}     # LoRA adapter name -> weight (model.lora)
        self.rng: Optional[torch.Generator] = None
        if seed is not None:
            self.rng = torch.Generator().manual_seed(seed)
        # -- state, owned by the Generator ------------------------------------------------------
        self.status = "new"                  # new -> queued -> active -> done
        self.owner = None                    # weakref to the Generator that queued it (no cycle: it holds its jobs)
        self._consumed = False               # enqueued with a consumer (stream, generate, ...): its errors go there
        self.table = None                    # cache.PageTable while active
        self.tokens: list[int] = list(ids)   # prompt + generated
        self.generated: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""                       # all text released so far
        self.finish_reason: Optional[str] = None
        self.limit = self.max_new_tokens     # may be lowered to what the cache can hold
        self.reused_tokens = 0               # prompt positions taken from the prefix index
        self.page_keys: Optional[list[bytes]] = None   # Cache.prompt_keys(input_ids), computed once
        self.salt: Optional[bytes] = None    # lora.prefix_salt at its first admission try (the LoRA state it
        # depends on cannot change while the job is queued or running)
        self.stream = None                   # streaming.TextStream

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def done(self) -> bool:
        return self.status == "done"

    @property
    def fed(self) -> int:
        """Positions whose K/V is in the cache."""
        return self.table.num_tokens if self.table is not None else 0

    def __repr__(self) -> str:
        return (f"Job(id={self.identifier!r}, prompt={self.prompt_len} tok, generated={len(self.generated)}, "
                f"status={self.status}, finish={self.finish_reason})")
