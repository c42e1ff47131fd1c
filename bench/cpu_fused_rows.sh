#!/usr/bin/env bash
# A/B of the CPU matmuls' small-M paths (csrc/cpu/simd.h): bench/cpu_fused_rows.cpp built against the working tree's
# csrc/cpu and against REV's (default HEAD: an uncommitted change), run in turn for ROUNDS rounds (default 3), single
# thread, AVX2 (REV's qmatmul.h must declare the same argument structs); prints the best us a call per round and the
# ratio, and writes bench/results/cpu_fused_rows.json (OUT=... to change).
#   bash bench/cpu_fused_rows.sh [REV]      # stop 64's change: bash bench/cpu_fused_rows.sh 02205ee~1
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:-HEAD}
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-bench/results/cpu_fused_rows.json}
grep -qw avx2 /proc/cpuinfo || { echo "cpu_fused_rows: needs AVX2" >&2; exit 1; }
dir=$(mktemp -d /tmp/cpu_fused_rows.XXXXXX)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/rev/cpu"
for f in $(git ls-tree --name-only "$REV" exl_core/csrc/cpu/); do
  git show "$REV:$f" >"$dir/rev/cpu/$(basename "$f")"
done
CXX=${CXX:-g++}
$CXX -O3 -std=c++17 -Iexl_core/csrc/cpu -o "$dir/tree" bench/cpu_fused_rows.cpp exl_core/csrc/cpu/qmatmul_avx2.cpp
$CXX -O3 -std=c++17 -I"$dir/rev/cpu" -o "$dir/rev_bin" bench/cpu_fused_rows.cpp "$dir/rev/cpu/qmatmul_avx2.cpp"
for r in $(seq 1 "$ROUNDS"); do
  for s in "576 1536" "1536 576" "576 576"; do
    "$dir/rev_bin" $s | sed "s/^/rev $r /"
    "$dir/tree" $s | sed "s/^/tree $r /"
  done
done >"$dir/runs.txt"
${PY:-.venv/bin/python} - "$dir/runs.txt" "$OUT" "$REV" "$(git rev-parse --short "$REV")" <<'PY'
import json, sys
from collections import defaultdict
sys.path.insert(0, "bench")
from common import machine_info, truncate as trunc
runs = defaultdict(list)
for line in open(sys.argv[1]):
    who, r, path, K, N, M, us = line.split()
    runs[(path, int(K), int(N), int(M), who)].append(float(us))
rows = []
print(f"{'path':>4} {'K':>5} {'N':>5} {'M':>2} {'rev us (rounds)':>28} {'tree us (rounds)':>28} {'rev / tree':>22}")
for path, K, N, M in sorted({k[:4] for k in runs}):
    a, b = runs[(path, K, N, M, "rev")], runs[(path, K, N, M, "tree")]
    ratios = [trunc(x / y, 4) for x, y in zip(a, b)]
    print(f"{path:>4} {K:>5} {N:>5} {M:>2} {' / '.join(f'{trunc(v):.2f}' for v in a):>28} "
          f"{' / '.join(f'{trunc(v):.2f}' for v in b):>28} {' / '.join(f'{v:.4f}' for v in ratios):>22}")
    rows.append({"path": path, "K": K, "N": N, "M": M, "rev_us": [trunc(v, 3) for v in a],
                 "tree_us": [trunc(v, 3) for v in b], "rev_over_tree": ratios})
json.dump({"benchmark": "bench/cpu_fused_rows.sh", "rev": sys.argv[3], "rev_commit": sys.argv[4],
           "machine": machine_info(), "threads": 1, "isa": "avx2", "paths": {"q4": "4-bit, 128-row groups (fused_cols)",
                                                   "fp32": "dense fp32 weight (dense_small)",
                                                   "bf16": "dense bf16 weight (dense_small)"},
           "rows": rows}, open(sys.argv[2], "w"), indent=1)
print("wrote", sys.argv[2])
PY
