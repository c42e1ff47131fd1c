#!/usr/bin/env bash
# The stamp of an extension build of the tree in the current folder: 16 hex digits over what the build depends on --
# python's major.minor, torch's version and CUDA, nvcc's release, the build settings' variables, setup.py and every
# file under exl_core/csrc but notes. bench/gpu.sh uses a carried `.devcache/ext_<stamp>.so.gz` whose stamp matches
# instead of building; bench/cross_build.sh makes such builds on a machine without a GPU. Nothing machine-specific
# (paths, patch releases, the host compiler) enters it, so both compute the same stamp for the same sources;
# cross_build.sh records the builder's versions beside each build (ext_<stamp>.txt).
# Usage: bash bench/build_stamp.sh [PYTHON]   (from the repository root or a copy of setup.py and exl_core/csrc)
set -uo pipefail
PY=${1:-python3}
versions=$($PY -c "import sys, torch; print(sys.version_info[:2], torch.__version__, torch.version.cuda)") || exit 1
nv=$(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*') || exit 1
settings='^(EXL_CORE_CUDA_ARCHS|EXL_CORE_NO_CUDA|NVCC_APPEND_FLAGS|NVCC_PREPEND_FLAGS)='
( echo "$versions $nv"; env | grep -E "$settings" | LC_ALL=C sort; sha1sum setup.py
  find exl_core/csrc -type f ! -name '*.md' | LC_ALL=C sort | xargs sha1sum ) | sha1sum | cut -c1-16
