#!/usr/bin/env bash
# A/B of the CPU matmul's small-M path (csrc/cpu/simd.h): bench/cpu_fused_rows.cpp built against the working tree's
# csrc/cpu and against REV's (default HEAD), run in turn for ROUNDS rounds (default 3), single thread, AVX2; prints
# the best us a call per round and the ratio, and writes bench/results/cpu_fused_rows.json (OUT=... to change).
#   bash bench/cpu_fused_rows.sh [REV]
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:-HEAD}
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-bench/results/cpu_fused_rows.json}
dir=$(mktemp -d /tmp/cpu_fused_rows.XXXXXX)
mkdir -p "$dir/rev/cpu"
for f in $(git ls-tree --name-only "$REV" exl_core/csrc/cpu/); do git show "$REV:$f" >"$dir/rev/cpu/$(basename "$f")"; done
CXX=${CXX:-g++}
$CXX -O3 -std=c++17 -Iexl_core/csrc/cpu -o "$dir/tree" bench/cpu_fused_rows.cpp exl_core/csrc/cpu/qmatmul_avx2.cpp
$CXX -O3 -std=c++17 -I"$dir/rev/cpu" -o "$dir/rev_bin" bench/cpu_fused_rows.cpp "$dir/rev/cpu/qmatmul_avx2.cpp"
for r in $(seq 1 "$ROUNDS"); do
  for s in "576 1536" "1536 576" "576 576"; do
    "$dir/rev_bin" $s | sed "s/^/rev $r /"
    "$dir/tree" $s | sed "s/^/tree $r /"
  done
done >"$dir/runs.txt"
python3 - "$dir/runs.txt" "$OUT" "$REV" "$(git rev-parse --short "$REV")" <<'PY'
import json, math, platform, sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    who, r, K, N, M, us = line.split()
    runs[(int(K), int(N), int(M), who)].append(float(us))
trunc = lambda v, n=2: math.floor(v * 10 ** n) / 10 ** n
rows = []
print(f"{'K':>5} {'N':>5} {'M':>2} {'rev us (rounds)':>26} {'tree us (rounds)':>26} {'rev / tree':>22}")
for K, N, M in sorted({k[:3] for k in runs}):
    a, b = runs[(K, N, M, "rev")], runs[(K, N, M, "tree")]
    ratios = [trunc(x / y, 4) for x, y in zip(a, b)]
    print(f"{K:>5} {N:>5} {M:>2} {' / '.join(f'{trunc(v):.2f}' for v in a):>26} "
          f"{' / '.join(f'{trunc(v):.2f}' for v in b):>26} {' / '.join(f'{v:.4f}' for v in ratios):>22}")
    rows.append({"K": K, "N": N, "M": M, "rev_us": [trunc(v, 3) for v in a], "tree_us": [trunc(v, 3) for v in b],
                 "rev_over_tree": ratios})
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
json.dump({"benchmark": "bench/cpu_fused_rows.sh", "rev": sys.argv[3], "rev_commit": sys.argv[4], "cpu": cpu,
           "threads": 1, "isa": "avx2", "weight": "4-bit, 128-row groups", "rows": rows}, open(sys.argv[2], "w"), indent=1)
print("wrote", sys.argv[2])
PY
rm -rf "$dir"
