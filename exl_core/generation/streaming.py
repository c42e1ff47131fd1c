"""Per-job text output: token ids -> text pieces, with stop strings held back and cut.

    token ids ──► incremental detokenizer ──► pending text ──► released text
                  (waits for whole UTF-8      (longest suffix that may still begin a stop
                   characters)                 string stays pending; a match cuts and stops)

Text is released only when no stop string can start inside it any more, so a stop string is
never emitted, even when it arrives split over several tokens.
"""
from __future__ import annotations

from typing import Optional, Sequence


class IncrementalText:
    """Decodes a growing list of token ids piece by piece.

    Decodes a short window of recent tokens twice (with and without the new ones) and emits
    the difference, so tokenizers whose text of a token depends on its neighbours (leading
    spaces, byte fallback) come out right; text ending in an incomplete UTF-8 character
    (U+FFFD) waits for the next token."""

    def __init__(self, tokenizer, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.prefix_offset = 0      # window start
        self.read_offset = 0        # tokens before this are already emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special=self.skip_special)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd") and full.startswith(prefix):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is still undecoded (possibly an incomplete character) at the end."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if full.startswith(prefix) else ""


class StopMatcher:
    """Holds back text that may still become a stop string; finds complete ones."""

    def __init__(self, stop_strings: Sequence[str]):
        self.stops = [s for s in stop_strings if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to release, stopped). After a stop, the returned text
        is everything before the earliest stop string and the matcher should not be fed."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            out, self.pending = self.pending[:cut], ""
            return out, True
        hold = 0
        for s in self.stops:                       # longest pending suffix that prefixes a stop
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TextStream:
    """Token ids in, releasable text out, for one job."""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = (), skip_special: bool = True):
        self.decoder: Optional[IncrementalText] = IncrementalText(tokenizer, skip_special) if tokenizer else None
        self.matcher = StopMatcher(stop_strings)

    def push(self, token_id: int) -> tuple[str, bool]:
        if self.decoder is None:
            return "", False
        return self.matcher.feed(self.decoder.push(token_id))

    def finish(self) -> tuple[str, bool]:
        """End of generation: flush the decoder and the held-back text (a stop string
        completed by the flushed text still counts and is cut)."""
        if self.decoder is None:
            return "", False
        text, stopped = self.matcher.feed(self.decoder.flush())
        if stopped:
            return text, True
        return text + self.matcher.flush(), False
