"""Same-call A/B ratios of bench/gpu_bench.py runs: each variant's tok/s over the default run's, per format and
metric, so a device call's log says at once what each switch did.

    python bench/ab_table.py DEFAULT.json VARIANT.json [VARIANT.json ...]

Ratios are variant / default from the JSONs' full-precision figures, truncated to 4 decimals (as the notes quote
them); a format or metric missing from either file is left blank.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

METRICS = ("bs1_decode_tok_s", "bs8_decode_tok_s", "bs32_decode_tok_s", "prompt2048_tok_s")


def truncated(x: float, places: int = 4) -> str:
    f = 10 ** places
    return f"{math.floor(x * f) / f:.{places}f}"


def ratios(default: dict, variant: dict) -> dict:
    """{format: {metric: variant / default}} for the figures both runs have."""
    out = {}
    for fmt in ("gptq", "exl2"):
        a, b = default.get(fmt), variant.get(fmt)
        if not isinstance(a, dict) or not isinstance(b, dict):
            continue
        out[fmt] = {m: b[m] / a[m] for m in METRICS if isinstance(a.get(m), (int, float)) and a[m] > 0
                    and isinstance(b.get(m), (int, float))}
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    default = json.loads(Path(argv[0]).read_text())
    print(f"{'variant / default':<46} " + "  ".join(f"{m.split('_')[0]:>8}" for m in METRICS))
    for path in argv[1:]:
        try:
            variant = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"{Path(path).name}: unreadable ({e})")
            continue
        for fmt, row in ratios(default, variant).items():
            cells = "  ".join(f"{truncated(row[m]) if m in row else '':>8}" for m in METRICS)
            print(f"{Path(path).stem[:40]:<40} {fmt:<5}  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
