"""Per-job text output: token ids -> text pieces, with stop strings held back and cut.

    token ids ──► IncrementalDecoder ──► StopStringMatcher ──► released text
                  (tokenizer.py: waits     (stop.py: the longest tail that may still begin
                   for whole characters)    a stop string stays held; a match cuts and stops)

Text is released only when no stop string can start inside it any more, so a stop string is
never emitted, even when it arrives split over several tokens.
"""
from __future__ import annotations

from typing import Sequence

from ..tokenizer import IncrementalDecoder
from .stop import StopStringMatcher


class TextStream:
    """Token ids in, releasable text out, for one job (no tokenizer: no text)."""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = (), skip_special: bool = True,
                 context: Sequence[int] = ()):
        """context: the prompt's ids, so the first token's text is as it reads after them (its leading space)."""
        self.decoder = (IncrementalDecoder(tokenizer, skip_special=skip_special, context=context)
                        if tokenizer is not None else None)
        self.matcher = StopStringMatcher(list(stop_strings))

    def push(self, token_id: int) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string completed)."""
        if self.decoder is None:
            return "", False
        return self.matcher.feed(self.decoder.add(token_id))

    def finish(self) -> tuple[str, bool]:
        """End of generation: flush the decoder and the held-back text (a stop string
        completed by the flushed text still counts and is cut)."""
        if self.decoder is None:
            return "", False
        text, stopped = self.matcher.feed(self.decoder.flush())
        if stopped:
            return text, True
        return text + self.matcher.flush(), False
