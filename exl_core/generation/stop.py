"""Stop conditions: stop strings matched across streamed text, stop tokens, EOS, length.

Text arrives in small pieces (one decoded token at a time), so a stop string can be split
over several pieces. `StopStringMatcher` holds back the longest tail that is still the start
of some stop string, and releases text as soon as it cannot be:

    fed so far:   "The answer is 42.\\n\\nQ"      stop = ["\\n\\nQ:"]
    emitted:      "The answer is 42."           held: "\\n\\nQ"   (could become "\\n\\nQ:")

A stop fires at the earliest point in the stream where any stop string is complete; of the
stop strings complete there, the longest (earliest starting) one decides what is dropped.
Everything from its first character on is never emitted. This definition does not depend on
how the text was split into pieces.
"""
from __future__ import annotations

from enum import Enum
from typing import Iterable, Optional

from ..errors import InputError


class FinishReason(str, Enum):
    """Why a job ended (a str, so `reason == "eos"` works)."""
    EOS = "eos"                  # an end-of-sequence token was drawn
    STOP_TOKEN = "stop_token"    # one of the job's stop tokens was drawn
    STOP_STRING = "stop_string"  # the text completed one of the job's stop strings
    LENGTH = "length"            # max_new_tokens reached


def _check_strings(stop_strings) -> list[str]:
    if stop_strings is None:
        return []
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    out = list(stop_strings)
    for s in out:
        if not isinstance(s, str) or not s:
            raise InputError(f"stop strings must be non-empty str, got {s!r}")
    return out


class StopStringMatcher:
    """Streams text through, holding back what could be the start of a stop string."""

    def __init__(self, stop_strings: Iterable[str]):
        self.stop_strings = _check_strings(stop_strings)
        # Every proper prefix of every stop string: a held tail must be one of them.
        self._prefixes = {s[:i] for s in self.stop_strings for i in range(1, len(s))}
        self._max_hold = max((len(s) - 1 for s in self.stop_strings), default=0)
        self._held = ""
        self.stopped = False
        self.matched: Optional[str] = None      # the stop string that fired

    @property
    def held(self) -> str:
        """Text received but not yet emitted (a possible start of a stop string)."""
        return self._held

    def feed(self, text: str) -> tuple[str, bool]:
        """Add `text`; return (text safe to emit now, whether a stop string completed).
        After a stop, further input is ignored and ("", True) is returned."""
        if not isinstance(text, str):
            raise InputError(f"StopStringMatcher.feed expects str, got {type(text).__name__}")
        if self.stopped:
            return "", True
        buf = self._held + text
        # The held tail has no complete stop string in it, so any match ends in `text`.
        best = None                                  # (end, -len, start, s)
        for s in self.stop_strings:
            i = buf.find(s)
            if i >= 0:
                key = (i + len(s), -len(s), i, s)
                if best is None or key < best:
                    best = key
        if best is not None:
            self.stopped, self.matched, self._held = True, best[3], ""
            return buf[:best[2]], True
        hold = 0
        for n in range(min(self._max_hold, len(buf)), 0, -1):
            if buf[-n:] in self._prefixes:
                hold = n
                break
        self._held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        """End of generation: release the held text (nothing after a stop)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


class StopConditions:
    """Everything that ends one job, checked once per drawn token.

    `step(token_id, text)` -> (text to emit now, finish reason or None), where `text` is the
    decoded text the token added. A stop token or EOS is not emitted; held-back text is
    released when the job ends for any reason other than a stop string."""

    def __init__(self, stop_token_ids: Iterable[int] = (), eos_ids: Iterable[int] = (),
                 stop_strings: Iterable[str] | None = None, max_new_tokens: Optional[int] = None):
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 0):
            raise InputError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0 or None")
        self.stop_token_ids = set(stop_token_ids or ())
        self.eos_ids = set(eos_ids or ())
        self.matcher = StopStringMatcher(stop_strings or [])
        self.max_new_tokens = max_new_tokens
        self.num_tokens = 0
        self.finish_reason: Optional[FinishReason] = None
        self.last_text = ""

    def step(self, token_id: int, text: str) -> tuple[str, Optional[FinishReason]]:
        if self.finish_reason is not None:
            return "", self.finish_reason
        self.num_tokens += 1
        if token_id in self.eos_ids:
            return self.matcher.flush(), self._finish(FinishReason.EOS)
        if token_id in self.stop_token_ids:
            return self.matcher.flush(), self._finish(FinishReason.STOP_TOKEN)
        out, stopped = self.matcher.feed(text)
        if stopped:
            return out, self._finish(FinishReason.STOP_STRING)
        if self.max_new_tokens is not None and self.num_tokens >= self.max_new_tokens:
            return out + self.matcher.flush(), self._finish(FinishReason.LENGTH)
        return out, None

    def check(self, token_id: int, text: str) -> Optional[FinishReason]:
        """`step` for callers that want only the reason; the text is left in `last_text`."""
        self.last_text, reason = self.step(token_id, text)
        return reason

    def _finish(self, reason: FinishReason) -> FinishReason:
        self.finish_reason = reason
        return reason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


__all__ = ["FinishReason", "StopStringMatcher", "StopConditions"]
