#!/usr/bin/env bash
# Builds the CUDA extension for the H200 machine on a machine without a GPU, with that machine's python (3.12), torch
# (2.11.0+cu130) and nvcc release (13.0), into .devcache/ext_<stamp>.so.gz (bench/build_stamp.sh) with the builder's
# versions beside it (ext_<stamp>.txt). bench/gpu.sh's build phase then loads it instead of building (`run` with
# carry [".devcache"]), which saves each fresh device machine its 133-161 s build; where the carried build does not
# load there, gpu.sh builds as before.
#   bash bench/cross_build.sh           # the working tree's setup.py and exl_core/csrc
#   bash bench/cross_build.sh REV       # a commit's
# Env: XPY (a python 3.12 with that torch; default /tmp/xvenv, made on first use from the package registry),
#      XBUILD_DIR (the build folder kept between runs, default /tmp/exl_xbuild),
#      EXL_CORE_CUDA_ARCHS (default 90a, as gpu.sh), MAX_JOBS (default: this machine's cores).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
REV=${1:-}
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
export EXL_CORE_CUDA_ARCHS=${EXL_CORE_CUDA_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-$(nproc)}
# the toolkit the nvcc on PATH belongs to (torch would take /usr/local from a wrapper script in /usr/local/bin)
[ -n "${CUDA_HOME:-}" ] || { [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda; }

XPY=${XPY:-/tmp/xvenv/bin/python}
if ! "$XPY" -c "import torch" 2>/dev/null; then
  # the first python3.12 that runs: a pyenv shim on PATH may exist without that version selected
  py312=
  for c in "$(command -v python3.12 2>/dev/null || true)" /root/.pyenv/versions/3.12*/bin/python3.12; do
    [ -n "$c" ] && "$c" --version >/dev/null 2>&1 && { py312=$c; break; }
  done
  [ -n "$py312" ] || { echo "cross_build: no python3.12 here" >&2; exit 1; }
  venv=$(dirname "$(dirname "$XPY")")
  "$py312" -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$TORCH_VERSION" numpy ninja setuptools wheel
fi
read -r torch_ver torch_cuda < <("$XPY" -c "import torch; print(torch.__version__, torch.version.cuda)") || true
want="$TORCH_VERSION+cu${torch_cuda//./}"     # what the H200 machine has (stop 61's results: 2.11.0+cu130)
[ "$torch_ver" = "$want" ] || echo "cross_build: warning: torch $torch_ver here, not $want: no stamp will match" >&2
# the CUDA libraries' headers (cublas, cusparse, ...) that torch's headers include come with torch's nvidia wheels
nv_inc=$("$XPY" -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu${torch_cuda%%.*}', 'include'))")
[ -d "$nv_inc" ] || { echo "cross_build: no $nv_inc" >&2; exit 1; }

# one build folder kept between runs (XBUILD_DIR): files copied only where their contents changed, so ninja rebuilds
# just the translation units that changed (a full build takes ~9 min on 2 cores)
src=${XBUILD_DIR:-/tmp/exl_xbuild}
stage=$(mktemp -d /tmp/xstage.XXXXXX)
trap 'rm -rf "$stage"' EXIT
if [ -n "$REV" ]; then
  git archive "$REV" setup.py exl_core/csrc | tar -x -C "$stage"
  what="commit $(git rev-parse --short "$REV")"
else
  # the files a device call sends: tracked ones and untracked ones git does not ignore
  git ls-files -co --exclude-standard -- setup.py exl_core/csrc | tar -c -T - | tar -x -C "$stage"
  edits=$(git diff --quiet HEAD -- setup.py exl_core/csrc || echo ' + edits')
  what="working tree at $(git rev-parse --short HEAD)$edits"
fi
# copies the files whose contents differ (with a new mtime, for ninja) and drops those gone
(cd "$stage" && find setup.py exl_core/csrc -type f) | while read -r f; do
  cmp -s "$stage/$f" "$src/$f" || { mkdir -p "$(dirname "$src/$f")"; cp "$stage/$f" "$src/$f"; }
done
(cd "$src" && find exl_core/csrc -type f) | while read -r f; do [ -e "$stage/$f" ] || rm -f "$src/$f"; done
rm -f "$src"/exl_core/_C*.so
cd "$src"
stamp=$(bash "$ROOT/bench/build_stamp.sh" "$XPY")
t0=$(date +%s)
echo "cross_build: $what, torch $torch_ver, archs $EXL_CORE_CUDA_ARCHS, stamp $stamp, $MAX_JOBS jobs"
if ! CPATH="$nv_inc${CPATH:+:$CPATH}" "$XPY" setup.py build_ext --inplace -q >build.log 2>&1; then
  grep -i -B2 -A6 "error" build.log | head -60
  exit 1
fi
so=$(ls exl_core/_C*.so)
# it must at least load with that torch (no GPU needed to register the ops)
"$XPY" -c "import importlib.util as u, torch; s = u.spec_from_file_location('exl_core._C', '$so'); \
s.loader.exec_module(u.module_from_spec(s)); \
assert torch._C._dispatch_has_kernel_for_dispatch_key('exl_core::qgemv_chunks', 'CUDA'), 'no CUDA kernels'"
mkdir -p "$ROOT/.devcache"
strip --strip-debug -o stripped.so "$so"
gzip -c stripped.so >"$ROOT/.devcache/ext_$stamp.so.gz"
glibc=$(objdump -T "$so" | grep -o 'GLIBC_[0-9.]*' | sort -t. -k2,2n -k3,3n -u | tail -1 || true)
cxxabi=$(objdump -T "$so" | grep -o 'GLIBCXX_[0-9.]*' | sort -t. -k3,3n -u | tail -1 || true)
{
  echo "cross-built $(date -u +%F' '%H:%M) UTC from $what in $(( $(date +%s) - t0 )) s"
  py=$("$XPY" -c "import sys; print(sys.version.split()[0])")
  echo "python $py, torch $torch_ver, nvcc $(nvcc --version | grep -o "V[0-9][0-9.]*" || true)"
  echo "$(${CXX:-c++} --version | head -1), needs ${glibc:-no GLIBC symbol}, ${cxxabi:-no GLIBCXX symbol}"
} >"$ROOT/.devcache/ext_$stamp.txt"
cat "$ROOT/.devcache/ext_$stamp.txt"
ls -la "$ROOT/.devcache/ext_$stamp.so.gz"
# a device call carries the tree and .devcache together, 64 MiB at most: say when the builds kept here crowd it
bytes() { xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}' || true; }   # of the files named
tree=$(cd "$ROOT" && git ls-files -co --exclude-standard -z | bytes)
cache=$(printf '%s\0' "$ROOT"/.devcache/* | bytes)
echo "tree $((tree >> 20)) MiB + .devcache $((cache >> 20)) MiB of a call's 64 MiB"
[ $((tree + cache)) -le $((60 << 20)) ] || echo "cross_build: warning: delete older .devcache builds before a call" >&2
