"""Decode speed against llama.cpp over repeated bench/int8_act_ab.py runs, each in a fresh process.

One int8_act_ab run interleaves exact, int8 and llama.cpp rounds inside one process and keeps
each one's best; on this shared 2-core box the level a process lands on still moves by ~10% from
run to run (page placement, neighbours), so one run's ratio is not the answer. This runs it
`--runs` times and reports, per model, every run's ratios and their best, min and median.

    python bench/decode_ab_runs.py --runs 5 -- --rounds 6 --llamacpp-python PY

Writes bench/results/decode_ab_runs.json (the runs: decode_ab_runs_runI.json).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, print_table, spread, write_results  # noqa: E402

KEYS = ("exact_tok_s", "int8_tok_s", "llamacpp_tok_s", "exact_x_llamacpp", "int8_x_llamacpp")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--name", default="decode_ab_runs")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for int8_act_ab.py (after --)")
    args = ap.parse_args()
    rest = [a for a in args.rest if a != "--"]
    runs = []
    for i in range(1, args.runs + 1):
        name = f"{args.name}_run{i}"
        subprocess.run([sys.executable, str(Path(__file__).with_name("int8_act_ab.py")), *rest, "--out", name],
                       check=True)
        runs.append(json.loads((RESULTS / f"{name}.json").read_text()))
    rows = []
    for model in [r["model"] for r in runs[0]["rows"]]:
        per = [next(r for r in run["rows"] if r["model"] == model) for run in runs]
        row = {"model": model}
        for key in KEYS:
            vals = [p[key] for p in per if key in p]
            if vals:
                row[key] = vals
                row.update({f"{key}_{k}": v for k, v in spread(vals).items()})
        rows.append(row)
    print()
    print_table(rows, ["model", "int8_x_llamacpp_median", "int8_x_llamacpp_min", "int8_x_llamacpp_best",
                       "exact_x_llamacpp_median", "exact_x_llamacpp_min", "exact_x_llamacpp_best"])
    write_results(args.name, {"runs": args.runs, "int8_act_ab_args": rest,
                              "run_files": [f"{args.name}_run{i}.json" for i in range(1, args.runs + 1)],
                              "rows": rows})


if __name__ == "__main__":
    main()
