"""`SamplerSettings`: what a job asks of the sampler, and its validation (the pipeline that applies them:
sampling.py, whose docstring gives the order of the steps)."""
from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from dataclasses import dataclass, replace as _dc_replace
from typing import Optional, Sequence, Union

import torch

from ..errors import SamplerError, is_bool, is_int

History = Union[torch.Tensor, Sequence[int], None]


def _is_real(v) -> bool:          # numbers.* so numpy scalars pass too; bools are not numbers here
    t = type(v)
    if t is float or t is int:    # the usual case, without the ABC machinery (validate runs every step)
        return True
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _finite(v) -> bool:
    """math.isfinite of a real number, where an int too large for a float (10**400) is not finite either (isfinite
    raises OverflowError on it)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


# (field, valid, rule) of SamplerSettings' float fields, checked by `validate`
_FLOAT_RULES = (
    ("temperature", lambda v: v >= 0, "must be a finite number >= 0 (0 = greedy)"),
    ("top_p", lambda v: 0 < v <= 1, "must be in (0, 1] (1 = off)"),
    ("min_p", lambda v: 0 <= v <= 1, "must be in [0, 1] (0 = off)"),
    ("typical", lambda v: 0 < v <= 1, "must be in (0, 1] (1 = off)"),
    ("repetition_penalty", lambda v: v > 0, "must be a finite number > 0 (1 = off)"),
    ("frequency_penalty", lambda v: True, "must be a finite number (0 = off)"),
    ("presence_penalty", lambda v: True, "must be a finite number (0 = off)"),
)


@dataclass
class SamplerSettings:
    """How one job turns logits into a token. See the module docstring for the order.

    temperature        >= 0; 0 = greedy (argmax, lowest id on ties)
    top_k              >= 0; 0 = off
    top_p              in (0, 1]; 1 = off
    min_p              in [0, 1]; 0 = off
    typical            in (0, 1]; 1 = off
    repetition_penalty > 0; 1 = off
    frequency_penalty, presence_penalty   finite; 0 = off
    penalty_range      how many most recent tokens the penalties look at (-1 all, 0 none)
    penalize_prompt    False: tokens of the prompt are never penalised
    temperature_last   apply temperature after the truncation filters instead of before
    logit_bias         {token id: bias added to its logit} (-inf allowed: bans the token)
    banned_tokens      token ids that can never be drawn
    """
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_range: int = -1
    penalize_prompt: bool = True
    temperature_last: bool = False
    logit_bias: Optional[dict[int, float]] = None
    banned_tokens: Optional[list[int]] = None

    def __post_init__(self):
        self.validate()

    @classmethod
    def greedy(cls, **overrides) -> "SamplerSettings":
        """Argmax decoding (penalties, bias and bans still apply when given)."""
        return cls(**{"temperature": 0.0, **overrides})

    def replace(self, **changes) -> "SamplerSettings":
        """A validated copy with some fields changed."""
        return _dc_replace(self, **changes)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_history(self) -> bool:
        """True when the token history changes the result (penalties active)."""
        return self.penalty_range != 0 and (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                                            or self.presence_penalty != 0.0)

    def validate(self, vocab_size: Optional[int] = None) -> "SamplerSettings":
        """Raise SamplerError naming the field and its valid range; token ids are checked
        against `vocab_size` when given. Returns self so calls chain."""
        def bad(name, value, rule):
            try:
                shown = repr(value)
            except ValueError:      # an int of more digits than Python converts to text (sys.set_int_max_str_digits)
                shown = "<a number too large to print>"
            raise SamplerError(f"SamplerSettings.{name}={shown} is invalid: {rule}")

        for name, ok, rule in _FLOAT_RULES:
            v = getattr(self, name)
            if not _is_real(v) or not _finite(v) or not ok(v):
                bad(name, v, rule)
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", self.top_k, "must be an int >= 0 (0 = off)")
        if not is_int(self.penalty_range) or self.penalty_range < -1:
            bad("penalty_range", self.penalty_range, "must be an int >= -1 (-1 = whole history, 0 = none)")
        for name in ("penalize_prompt", "temperature_last"):
            if not is_bool(getattr(self, name)):
                bad(name, getattr(self, name), "must be True or False")

        def check_id(name, t):
            if not is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                rng = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
                bad(name, t, f"token ids must be ints {rng}")

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", self.logit_bias, "must be a dict {token id: bias} or None")
            for t, b in self.logit_bias.items():
                check_id("logit_bias", t)
                if not _is_real(b) or not (_finite(b) or b == -math.inf):
                    bad("logit_bias", {t: b}, "biases must be finite numbers or -inf")
        if self.banned_tokens is not None:
            # a container read again at every step: an iterator would be used up here, an array / tensor has no
            # plain truth value (list(...) or .tolist() first)
            b = self.banned_tokens
            if not isinstance(b, Collection) or isinstance(b, (str, bytes)) or hasattr(b, "__array__"):
                bad("banned_tokens", b, "must be a list, tuple, set or range of token ids, or None")
            for t in self.banned_tokens:
                check_id("banned_tokens", t)
        return self
