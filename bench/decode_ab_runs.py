"""Decode speed against llama.cpp over repeated bench/int8_act_ab.py runs, each in a fresh process.

One int8_act_ab run interleaves exact, int8 and llama.cpp rounds inside one process and keeps
each one's best; on this shared 2-core box the level a process lands on still moves by ~10% from
run to run (page placement, neighbours), so one run's ratio is not the answer. This runs it
`--runs` times and reports, per model, every run's ratios and their best, min and median.

    python bench/decode_ab_runs.py --runs 5 -- --rounds 6 --llamacpp-python PY

Writes bench/results/decode_ab_runs.json (the runs: decode_ab_runs_runI.json).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, repeated_runs_cli, spread_rows, write_results  # noqa: E402

KEYS = ("exact_tok_s", "int8_tok_s", "llamacpp_tok_s", "exact_x_llamacpp", "int8_x_llamacpp")


def main():
    args, rest, runs = repeated_runs_cli("int8_act_ab.py", 5, "decode_ab_runs")
    rows = spread_rows(runs, "model", KEYS)
    print()
    print_table(rows, ["model", "int8_x_llamacpp_median", "int8_x_llamacpp_min", "int8_x_llamacpp_best",
                       "exact_x_llamacpp_median", "exact_x_llamacpp_min", "exact_x_llamacpp_best"])
    write_results(args.name, {"runs": args.runs, "int8_act_ab_args": rest,
                              "run_files": [f"{args.name}_run{i}.json" for i in range(1, args.runs + 1)],
                              "rows": rows})


if __name__ == "__main__":
    main()
