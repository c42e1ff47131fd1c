"""Stop strings matched across streamed text (the generator checks stop tokens, EOS and length itself).

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

from typing import Iterable, Optional

from ..errors import InputError


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


__all__ = ["StopStringMatcher"]
