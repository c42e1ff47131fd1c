"""A decode layer's launches from a decode_timeline JSON (bench/decode_timeline.py): per launch position of a layer,
the median over the layers of what it adds to the step's end and of its duration, for each default case of the
given batch sizes, with --variants the same-process variants too (figures truncated to 2 decimals).  Layers are
delimited by the paged attention launch (one a layer); the first and last layer are left out.

    python bench/timeline_layers.py bench/results/decode_timeline_h200_stop36_call1_ab65bdf.json --batch 32
"""
from __future__ import annotations

import argparse
import json
import math
import statistics


def trunc(v: float) -> str:
    """v truncated (not rounded) to 2 decimals, as the notes quote figures."""
    return f"{math.floor(v * 100) / 100:.2f}"


def layer_rows(case: dict) -> list[dict]:
    ks = case["kernels"]
    att = [i for i, r in enumerate(ks) if r["name"].startswith("void exl_attn::paged_attention_kernel")]
    per = att[1] - att[0]
    rows = []
    for pos in range(-3, per - 3):                  # from the launch three before attention (down, norm, q/k/v)
        at = [ks[a + pos] for a in att[1:-1]]
        if len({r["name"] for r in at}) != 1:
            raise ValueError(f"{case['format']} bs{case['batch']}: launch {pos} differs between layers")
        rows.append({"pos": pos, "part": at[0]["part"], "name": at[0]["name"],
                     "adds_us": statistics.median(r["adds_us"] for r in at),
                     "dur_us": statistics.median(r["dur_us"] for r in at)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--variants", action="store_true", help="the same-process variants too (decode_timeline.VARIANTS)")
    a = ap.parse_args()
    for case in json.load(open(a.json))["cases"]:
        if "kernels" not in case or (case["variant"] and not a.variants) or case["batch"] not in a.batch:
            continue
        rows = layer_rows(case)
        name = f"{case['format']} bs{case['batch']}" + (f" {case['variant']}" if case["variant"] else "")
        name += f" after {case['skip_steps']} steps" if case.get("skip_steps") else ""
        print(f"== {name}: untraced step {trunc(case['untraced_step_us'])} us, "
              f"traced span {trunc(case['span_us'])} us")
        for r in rows:
            print(f"  {r['pos']:3d} adds {trunc(r['adds_us']):>7s} dur {trunc(r['dur_us']):>7s}  {r['part']:9s} "
                  f"{r['name'][:80]}")
        print(f"  a layer: sum of the positions' median adds {trunc(sum(r['adds_us'] for r in rows))} us")


if __name__ == "__main__":
    main()
