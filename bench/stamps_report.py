"""Where a decode layer's time goes between its launches, from gemv_probe's phase stamps (mode `stamps`,
STAMP_CSV=...: every warp of layers 3 and 4 with its globaltimer at entry, before and after the PDL wait, x staged,
loop done, after the block's barrier, exit; bench/gemv_probe.cu).

    python bench/stamps_report.py bench/results/gemv_stamps_l34_h200_stop49_call1_1dd63da.csv.gz

Per launch, us from the layer's first q/k/v entry: the median entry, the median wait release, the staged rows'
p10/p50/p90, the loop's end p10/p50/p90/max and the last exit; then the ramp (the launch before's last exit to this
launch's median staged time, when its weights stream again) and the tail (its median loop end to its last exit; for
gate/up's 688 blocks in two waves that is the second wave).
"""
from __future__ import annotations

import csv
import gzip
import math
import sys

OPS = ("q/k/v", "o", "gate/up", "down")


def t2(ns: int) -> str:
    """ns as us, truncated (not rounded) to two decimals, in integer arithmetic."""
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)
    return f"{sign}{ns // 1000}.{ns % 1000 // 10:02d}".rjust(6)


def pct(v: list, q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def main(path: str) -> None:
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        rows = list(csv.DictReader(f))
    prev_exit = None                                          # ns: the launch before's last exit (layers run in turn)
    for layer in sorted({r["layer"] for r in rows}, key=int):
        lr = [r for r in rows if r["layer"] == layer]
        t0 = min(int(r["t0"]) for r in lr if r["op"] == OPS[0])
        print(f"layer {layer}: us from its q/k/v launch's first warp entry")
        for op in OPS:
            w = [r for r in lr if r["op"] == op]
            at = {p: [int(r[f"t{p}"]) - t0 for r in w] for p in range(7)}     # ns
            staged, done, exit_max = pct(at[3], 0.5), pct(at[4], 0.5), max(at[6])
            ramp = t2(staged - (prev_exit - t0)) if prev_exit is not None else "     -"
            print(f"  {op:8s} entry {t2(pct(at[0], .5))}  waited {t2(pct(at[2], .5))}  staged {t2(pct(at[3], .1))} "
                  f"{t2(staged)} {t2(pct(at[3], .9))}  loop done {t2(pct(at[4], .1))} {t2(done)} {t2(pct(at[4], .9))} "
                  f"{t2(max(at[4]))}  exit {t2(exit_max)} | ramp {ramp} tail {t2(exit_max - done)}")
            prev_exit = max(int(r["t6"]) for r in w)


if __name__ == "__main__":
    main(sys.argv[1])
