"""Prompt speed over repeated bench/cpu_decode.py runs: best and spread per row, since one timed
512-token forward per run is at the mercy of whatever else the shared box is doing.

    python bench/cpu_prompt_runs.py --runs 3 --name cpu_prompt_bf16 -- [cpu_decode.py arguments]

Runs cpu_decode.py `--runs` times (each writes bench/results/NAME_runI.json, peers measured in
the same run), then writes bench/results/NAME.json: per engine, prompt tok/s and the ratio to
llama.cpp of every run, their best (max), min and median.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, print_table, spread, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--name", default="cpu_prompt_bf16")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for cpu_decode.py (after --)")
    args = ap.parse_args()
    rest = [a for a in args.rest if a != "--"]
    runs = []
    for i in range(1, args.runs + 1):
        name = f"{args.name}_run{i}"
        subprocess.run([sys.executable, str(Path(__file__).with_name("cpu_decode.py")), *rest, "--out", name],
                       check=True)
        runs.append(json.loads((RESULTS / f"{name}.json").read_text()))
    engines = [r["engine"] for r in runs[0]["rows"]]
    rows = []
    for e in engines:
        per = [next(r for r in run["rows"] if r["engine"] == e) for run in runs]
        row = {"engine": e}
        for key in ("prompt_tok_s", "prompt_x_llamacpp", "decode_tok_s", "decode_x_llamacpp"):
            vals = [p[key] for p in per if key in p]
            if vals:
                row[key] = vals
                row.update({f"{key}_{k}": v for k, v in spread(vals).items()})
        rows.append(row)
    print()
    print_table(rows, ["engine", "prompt_tok_s_best", "prompt_tok_s_min", "prompt_x_llamacpp_best",
                       "prompt_x_llamacpp_median", "prompt_x_llamacpp_min"])
    write_results(args.name, {"runs": args.runs, "cpu_decode_args": rest,
                              "threads": runs[0]["threads"], "prompt_tokens": runs[0]["prompt_tokens"],
                              "run_files": [f"{args.name}_run{i}.json" for i in range(1, args.runs + 1)],
                              "rows": rows})


if __name__ == "__main__":
    main()
