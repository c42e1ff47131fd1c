"""Prompt speed of two source trees side by side (e.g. this branch against /work/main), alternating
processes so both see the same background load: SmolLM2-135M, one forward over a 512-token prompt
through ContiguousContext (as bench/cpu_decode.py), best of `--passes` per process.

    python bench/prompt_ab.py --trees /work/main,/work/wt-prefill [--formats gptq,exl2,dense]
        [--rounds 3] [--passes 3] [--threads 2] [--prefill exact] [--name prompt_ab]

Each tree must have its extension built in place.  `--prefill` other than exact is passed to
every tree's load_model (a tree without the option fails; compare such trees with exact).  Writes bench/results/NAME.json (every round's tok/s).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_results  # noqa: E402

INNER = r"""
import json, sys, time, torch
fmt, prefill, passes, threads, bench = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
sys.path.insert(0, bench)
torch.set_num_threads(threads)
from exl_core.loader import load_model
from exl_core.model.context import ContiguousContext
from exl_core.default_model import default_dense_path
from quantized_models import quantized_smollm2
kw = {} if prefill == "exact" else {"prefill": prefill}
folder = default_dense_path() if fmt == "dense" else quantized_smollm2(fmt)
model, _ = load_model(folder, head="exact" if fmt == "dense" else "int8", **kw)
n = 512
prompt = torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(0))
def prefill_once():
    model.forward(prompt, ContiguousContext([n], [None], logit_rows=torch.tensor([n - 1])))
with torch.inference_mode():
    prefill_once(); best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter(); prefill_once(); best = min(best, time.perf_counter() - t0)
import exl_core
print(json.dumps({"prompt_tok_s": n / best, "exl_core": exl_core.__file__}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", required=True, help="comma-separated source trees (repository roots)")
    ap.add_argument("--formats", default="gptq,exl2,dense")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", default="exact")
    ap.add_argument("--name", default="prompt_ab")
    args = ap.parse_args()
    trees = args.trees.split(",")
    bench = str(Path(__file__).resolve().parent)
    res: dict = {}
    for _ in range(args.rounds):
        for fmt in args.formats.split(","):
            for tree in trees:
                env = dict(os.environ, PYTHONPATH=tree)
                # cwd = the tree: `python -c` puts the working directory first on sys.path
                out = subprocess.run([sys.executable, "-c", INNER, fmt, args.prefill, str(args.passes),
                                      str(args.threads), bench], env=env, cwd=tree, capture_output=True, text=True,
                                     check=True)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                if not got["exl_core"].startswith(str(Path(tree).resolve())):
                    raise SystemExit(f"{tree}: imported {got['exl_core']}, not this tree's exl_core")
                res.setdefault((fmt, tree), []).append(got["prompt_tok_s"])
    rows = [{"format": f, "tree": t, "prompt_tok_s": v, "best": max(v), "min": min(v)} for (f, t), v in res.items()]
    for r in rows:
        base = next(b for b in rows if b["format"] == r["format"] and b["tree"] == trees[0])
        r["best_x_first_tree"] = r["best"] / base["best"]
    print_table(rows, ["format", "tree", "best", "min", "best_x_first_tree"])
    write_results(args.name, {"trees": trees, "threads": args.threads, "passes": args.passes,
                              "prefill": args.prefill, "prompt_tokens": 512, "rows": rows})


if __name__ == "__main__":
    main()
