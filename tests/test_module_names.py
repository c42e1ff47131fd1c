"""No module of the package defines one top-level name twice: a second `def` silently replaces the first for every
caller (stop 36: a new helper took the name of another further down cuda_candidates.py, and every batch-decode launch
then called the wrong one)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "exl_core"


def test_no_top_level_name_defined_twice():
    twice = []
    for path in sorted(PACKAGE.rglob("*.py")):
        seen: dict[str, int] = {}
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name in seen:
                    twice.append(f"{path.relative_to(PACKAGE.parent)}: {node.name} at lines {seen[node.name]} and "
                                 f"{node.lineno}")
                seen[node.name] = node.lineno
    assert not twice, "\n".join(twice)
