"""User text files (calibration, evaluation, tasks): read as UTF-8, JSONL line by line, errors that name the file
and the line."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

from .errors import InputError


def require_file(path, what: str = "text file") -> Path:
    """`path` as a Path where it is a file; else an InputError naming it: not found, or a folder."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{what} {p} is a folder; name a file")
    if not p.is_file():
        raise InputError(f"{what} {p} not found")
    return p


def read_utf8(path, what: str = "text file") -> str:
    """The file's text; a missing or non-UTF-8 file is an InputError naming it (`what`: how to call it)."""
    p = require_file(path, what)
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {p} is not UTF-8 text ({e.reason} at byte {e.start})") from e


class _NestedTooDeep(json.JSONDecodeError):
    def __str__(self) -> str:       # no line/column: where the nesting became too deep tells the user nothing
        return self.msg


def loads_json(text: str) -> Any:
    """json.loads, where a document nested deeper than Python's recursion limit fails as malformed JSON (a
    json.JSONDecodeError saying "nested too deeply"), so the callers' JSON error handling names the file; json.loads
    itself raises a bare RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise _NestedTooDeep("nested too deeply", text, 0) from None


def jsonl_objects(path, what: str = "JSONL file") -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of every non-blank line; a line that is not JSON is an InputError naming it."""
    # lines end at \r\n, \n or \r (which JSON strings cannot hold raw); str.splitlines also breaks at U+2028, U+2029
    # and U+0085, which they may hold
    for n, line in enumerate(re.split(r"\r\n?|\n", read_utf8(path, what)), 1):
        if not line.strip():
            continue
        try:
            yield n, loads_json(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e.msg})") from e
