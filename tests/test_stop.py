"""Stop strings across streamed text, against a brute-force scan of the whole text."""
from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings, strategies as st

from exl_core.errors import InputError
from exl_core.generation.stop import StopStringMatcher


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Scan every end position in order; at the first one where some stop string ends,
    cut before the longest of those."""
    for end in range(1, len(text) + 1):
        for s in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(s):
                return text[:end - len(s)], True
    return text, False


def longest_hold(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for n in range(1, len(text) + 1):
        tail = text[-n:]
        if any(len(s) > n and s.startswith(tail) for s in stops):
            best = n
    return best


def run_chunks(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    """Feed chunk by chunk, checking the streaming invariants after every feed."""
    m = StopStringMatcher(stops)
    emitted, consumed = "", ""
    for c in chunks:
        was_stopped = m.stopped
        out, stopped = m.feed(c)
        consumed += c
        emitted += out
        for s in stops:
            assert s not in emitted, f"stop string {s!r} leaked into {emitted!r}"
        if was_stopped:
            assert out == "" and stopped
            continue
        if not stopped:
            # Nothing is lost or duplicated, and only a possible stop start is held back.
            assert emitted + m.held == consumed
            assert len(m.held) == longest_hold(consumed, stops)
    if not m.stopped:
        emitted += m.flush()
    else:
        assert m.flush() == ""
    return emitted, m.stopped


def all_splits(text: str):
    """Every way to cut text into non-empty consecutive pieces (2^(n-1) of them)."""
    n = len(text)
    for mask in range(1 << max(n - 1, 0)):
        cuts = [i + 1 for i in range(n - 1) if mask >> i & 1]
        bounds = [0, *cuts, n]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("text, stops", [
    ("is 42.\n\nQ: n", ["\n\nQ:"]),
    ("abcabcab", ["ab", "abc"]),            # one stop string a prefix of another
    ("xxabcd", ["bcd", "c"]),               # shorter one completes first
    ("aab\nab", ["b\n", "\n"]),             # both end at once: the longer one cuts
    ("aaaaab", ["aab", "aaab"]),            # overlapping self-similar prefixes
    ("no stop here", ["STOP", "\n\n"]),
])
def test_every_split(text, stops):
    assert len(text) <= 13                  # 2^(n-1) splits
    want = reference(text, stops)
    for chunks in all_splits(text):
        assert run_chunks(chunks, stops) == want, chunks


alphabet = st.sampled_from("ab\nQé")


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet, max_size=30),
       stops=st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=12))
def test_random_splits_match_reference(text, stops, cuts):
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    # Empty feeds happen (a token that decodes to nothing): sprinkle some in.
    chunks = list(itertools.chain.from_iterable((c, "") for c in chunks))
    assert run_chunks(chunks, stops) == reference(text, stops)


def test_held_text_released_by_flush():
    m = StopStringMatcher(["</answer>"])
    assert m.feed("forty-two</ans") == ("forty-two", False)
    assert m.held == "</ans"
    assert m.flush() == "</ans"
    assert m.flush() == ""


def test_match_reports_string_and_ignores_later_input():
    m = StopStringMatcher(["\n\n", "\n"])
    assert m.feed("ab") == ("ab", False)
    assert m.feed("c\n\nd") == ("c", True)
    assert m.matched == "\n"
    assert m.feed("more") == ("", True)


def test_no_stop_strings_passes_everything():
    m = StopStringMatcher([])
    rnd = random.Random()
    text = "".join(rnd.choice("abc \n") for _ in range(50))
    assert "".join(m.feed(c)[0] for c in text) == text
    assert m.flush() == ""


@pytest.mark.parametrize("bad", [[""], ["ok", 3], [None]])
def test_bad_stop_strings(bad):
    with pytest.raises(InputError, match="stop strings"):
        StopStringMatcher(bad)
