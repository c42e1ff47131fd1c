"""Prompt speed over repeated bench/cpu_decode.py runs: best and spread per row, since one timed
512-token forward per run is at the mercy of whatever else the shared box is doing.

    python bench/cpu_prompt_runs.py --runs 3 --name cpu_prompt_bf16 -- [cpu_decode.py arguments]

Runs cpu_decode.py `--runs` times (each writes bench/results/NAME_runI.json, peers measured in
the same run), then writes bench/results/NAME.json: per engine, prompt tok/s and the ratio to
llama.cpp of every run, their best (max), min and median.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, repeated_runs_cli, spread_rows, write_results  # noqa: E402


def main():
    args, rest, runs = repeated_runs_cli("cpu_decode.py", 3, "cpu_prompt_bf16")
    rows = spread_rows(runs, "engine", ("prompt_tok_s", "prompt_x_llamacpp", "decode_tok_s", "decode_x_llamacpp"))
    print()
    print_table(rows, ["engine", "prompt_tok_s_best", "prompt_tok_s_min", "prompt_x_llamacpp_best",
                       "prompt_x_llamacpp_median", "prompt_x_llamacpp_min"])
    write_results(args.name, {"runs": args.runs, "cpu_decode_args": rest,
                              "threads": runs[0]["threads"], "prompt_tokens": runs[0]["prompt_tokens"],
                              "run_files": [f"{args.name}_run{i}.json" for i in range(1, args.runs + 1)],
                              "rows": rows})


if __name__ == "__main__":
    main()
