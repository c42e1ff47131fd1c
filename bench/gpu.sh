#!/usr/bin/env bash
# One command on the GPU machine (no network): build the CUDA extension, run the CUDA tests,
# write random-weight Llama-2-7B-shaped GPTQ 4-bit g128 and EXL2 ~4.0 bpw checkpoints, and
# print the benchmark table (bench/gpu_bench.py). Logs and the JSON go to $OUT (or bench/results).
#   bash bench/gpu.sh            # EXL_CORE_CUDA_ARCHS=90a by default (H100/H200 only, faster build)
#   PHASES="bench gen" bash bench/gpu.sh   # a subset (a second call on a machine that has the build)
#   CUDA_TESTS="tests/..." (test files of the tests phase), BENCH_ARGS=--quick, EXLV2_ARGS="--gptq-no-gidx DIR":
#   narrower runs when device time is short
# Phases: wg (bench/wgmma_probe.cu: the prompt's fused dequantise-GEMM against dequantise + cuBLAS, standalone;
#   PROBE_ARGS=decode32: the same kernel at 32 tokens a block on the batch-32 decode launches;
# WG_NCU=1 adds ncu, the SASS and the source page), wide (bench/wide_probe.cu: the 9..32-row decode GEMM design,
# standalone), twin (bench/twin_probe.cu: the
# rewritten EXL2 prompt's twin dequantise variants, standalone, cuBLAS where found), persist (bench/persist_probe.cu:
# what a persistent decode kernel's grid barriers cost against launches, read-only, standalone), attntail
# (bench/attn_tail_probe.cu: a layer's attention in the tail of its q/k/v launch against its own launch, standalone),
# dequant (bench/dequant_probe.cu: the
# prompt's dequantise kernels, alone and followed by their cuBLAS GEMMs, standalone), gemv (bench/gemv_probe.cu: the
# batch-1 GEMV per launch and as a PDL chain of decode layers, standalone; GEMV_NCU=1 adds qgemm_kslice under Nsight
# Compute: the second layer's o and gate/up, and EXL2-like q/k/v and o; a per-instruction SASS CSV of the q/k/v), build, tests, ckpt (only write the checkpoints), bench (table), spec (speculative decoding), promptprobe
# (bench/prompt_probe.py: where a 2048-token prompt's time goes), promptorder (bench/prompt_after_decode.py: the
# prompt before and after the decode runs),
# gen (Generator tok/s), nowide (bench's graph decode with EXL_CORE_WIDE=0), widetiles (GPTQ graph decode with
# EXL_CORE_WIDE_U4_MIN_TILES=1: o and down on qgemm_wide at 17..32 rows), nou4 (EXL2 on the
# mixed-width kernels), normpermold (EXL2 with EXL_CORE_NORM_PERM_LEAN=0 EXL_CORE_NORM_PERM_LATE=17: the permuted
# norm as stops 32-35 ran it, its regular instance triggering late from 17 rows; the default is the lean instance from
# 17 rows, early everywhere), wgdecode (both formats with EXL_CORE_WG_DECODE per WG_AB_VARIANTS, in turn: the
# stream-K wgmma kernel at 17..32 rows; default "multi,single" since stop 58, "0" off, "1" with the SwiGLU pair),
# envab (ENV_AB: bench --quick under several settings, in turn), buildab (BUILD_AB: carried builds alternated, bench
# --quick), widetwin (EXL2 with EXL_CORE_WIDE_TWIN=1: at 17..32 rows qgemm_wide folds the extra rows into
# their main chunks instead of running them as K rows of their own; off by default until measured), noxchunks (EXL2 with
# EXL_CORE_KSLICE_XCHUNKS=0: the SwiGLU-fused down stages x through its permutation, not by chunk offsets), notails
# (EXL2 with EXL_CORE_WIDE_TAILS=0: at 17..32 rows down gathers the SwiGLU pair's product by an x_gather), promptext
# (EXL2 prompt-only runs, EXL_CORE_PROMPT_NATURAL_X=0 / default alternated twice: the extended order, GEMMs over all rows,
# index_add, against x in natural order), promptab (bench/gpu_prompt_ab.py: the prompt's variants in one process, rounds
# alternated: both formats with and without the prompt's L2 window), l2on (both formats with EXL_CORE_DEQUANT_L2=1,
# --decode-after-prompt: the prompt's W persisting in L2, batch 1 and 32 again after the prompt), prompttl
# (bench/prompt_timeline.py: a prompt's kernels on a timeline, idle time by kernel pair), prompthost
# (bench/prompt_host.py: the prompt's host side: enqueue time, syncs, cProfile), throwprobe (bench/throw_probe.py:
# whether failing TORCH_CHECKs raise: native stacks, minimal extensions), graphprobe
# (bench/graph_capture_probe.py: which op breaks a decode step's graph capture), promptprof (the prompt's kernels by
# name: GPTQ, EXL2, EXL2 unrewritten), noattnorder (EXL2 with o gathering its input, EXL_CORE_ATTN_OUT_ORDER=0),
# nostage2 (both formats with EXL_CORE_ATTN_STAGE2=0), noh2 (both formats with EXL_CORE_KSLICE_H2=0: the SwiGLU-fused
# down reads fp32 scale and zero, not half2), h2all (both formats with EXL_CORE_KSLICE_H2_ALL=1: every staged-row
# qgemm_kslice launch on half2 scale/zero), argmax (both formats with the bench's greedy token by torch's argmax, not
# exl_core::greedy_pick), gennopick (the Generator with EXL_CORE_GREEDY_CUDA=0: its greedy steps by torch's passes),
# oldexl2 (both),
# genprefill (bench/gen_prefill_probe.py: the Generator's chunked prefill), nonorm (both formats with EXL_CORE_NORM_FOLD=0: the
# RMSNorm and residual add as their own launches), noonewave (both formats with EXL_CORE_KSLICE_ONE_WAVE=0: gate/up at
# batch 1 on 8-warp blocks, 1.73 waves), nowavecap (both formats with EXL_CORE_KSLICE_WAVE_CAP=0: that launch's blocks
# not capped at ceil(tiles / SMs) an SM), widefold (GPTQ with EXL_CORE_NORM_FOLD_WIDE=1), noropeattn (both formats
# with EXL_CORE_ROPE_ATTN_FUSE=0: rope and the K/V write as their own launch before attention), noswiglu (GPTQ with
# EXL_CORE_WIDE_SWIGLU=0: silu_mul as its own launch after gate/up at batch 17..32), noearlyw (both formats with
# EXL_CORE_NORM_EARLY_W=0: the norm kernels read the weight after their PDL wait), nonormperm (EXL2 with
# EXL_CORE_NORM_PERM=0: q/k/v and gate/up gather x themselves instead of the norm writing their act-order), wavekw4 /
# wavekw8 / wavekw16 (both formats with EXL_CORE_KSLICE_WAVE_KW=4 / 8 / 16: q/k/v and gate/up at 1..8 rows with 4 / 8 /
# 16 warps a block; default 8 for uniform 4-bit, 4 for mixed widths), kslice (decode kernel variants, cuda_probe.py kslice), noks (bench's graph decode
# with EXL_CORE_KSLICE=0: qgemm_skinny instead of qgemm_kslice), kvhtd (bench's graph decode and prompt with the
# K/V cache as (B, Hkv, T, D)), exlv2 (ExLlamaV2 0.3.2 on the same checkpoints, after bench and gen; carry .whl), sdpa (bench's graph decode with the masked-SDPA decode attention), ncu (qgemm_kslice at 32 rows under Nsight Compute), ncu32 (qgemm_wide and
# the 9..32-row qgemm_kslice at the bench's batch-32 launches under Nsight Compute: stall reasons, a SASS CSV), readbw (bench/read_bw.cu: read bandwidth by
# access method), normprobe (bench/norm_probe.py: the decode norms alone, plain against permuted; NORMPROBE_ARGS=--between-wg also between two stream-K launches), nopdl (bench's graph decode and prompt with EXL_CORE_PDL=0), nofuse (bench's
# graph decode and prompt with EXL_CORE_ATTN_CLUSTER=0, EXL_CORE_ROPE_KV_FUSE=0 and EXL_CORE_RESIDUAL_ADD=0), nogs (GPTQ with EXL_CORE_GROUP_SHIFT=0),
# nosg (both formats with EXL_CORE_KSLICE_SGATHER=0: act-order x gathered from global memory), nosilu
# (both formats with EXL_CORE_SILU_FUSE=0), u4rows (GPTQ with EXL_CORE_KSLICE_U4_ONE_ROW=0: gate/up at 2..8 rows on
# qgemm_kslice too), mixks (EXL2 with EXL_CORE_KSLICE_MIXED_SKINNY=0: mixed widths at 1..8 rows on qgemm_kslice), nofold (EXL2 with
# EXL_CORE_FOLD_DOWN_PERM=0: down_proj keeps its act-order permutation), knockout (bench/decode_knockout.py: the graphed decode with norms,
# attention, rope or the head knocked out, for their share of the step), projprobe (bench/proj_probe.py: the decode projections' launches alone, GPTQ vs
# EXL2's uniform 4-bit rewrite), timeline (bench/decode_timeline.py: every
# kernel of a graphed decode step, its duration and what it adds to the step's end), attnab (both formats with
# EXL_CORE_ATTN_HEAD_MAJOR=0, then EXL_CORE_ATTN_EARLY=0: the paged attention's launch order and early loads), probe (host syncs of a prefill/decode step, skinny kernel timings by layout and
# split); bench, spec, gen and probe write the checkpoints first when missing.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_GIVEN=${OUT:+1}         # a fresh folder of this call's files (the device tool's $OUT), not bench/results
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
# The device tool returns at most 8 files from $OUT: every phase's log goes to one file (the JSONs,
# cuda_tests.txt and gpu_log.txt stay within that); the build and checkpoint logs only when they fail. The A/B
# phases since stop 28 write their JSON to $OUT (at most ~5 of them in one call), older ones to /tmp (their table
# is in gpu_log.txt).
LOG="$OUT/gpu_log.txt"
BUILD_LOG=/tmp/exl_build_log.txt CKPT_LOG=/tmp/exl_ckpt_log.txt
export EXL_CORE_CUDA_ARCHS=${EXL_CORE_CUDA_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # bench scripts import exl_core from the tree
CK=${CKPT_DIR:-/tmp/exl_bench}
PHASES=${PHASES:-build tests bench spec gen}
has() { [[ " $PHASES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv

# nvcc flags that link cuBLAS into a probe chaining GEMMs (-DWITH_CUBLAS), where the image has its header and library
# (-l:<file> links the versioned name a wheel ships); nothing where it has not.
cublas_flags() {
  local h so
  h=$(find /usr/local/cuda*/include /usr/local/cuda*/targets/*/include /usr/local/lib/python3*/dist-packages/nvidia \
    /usr/local/lib/python3*/site-packages/nvidia /usr/lib/python3*/dist-packages/nvidia -name cublas_v2.h 2>/dev/null | head -1)
  so=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib /usr/local/lib/python3*/dist-packages/nvidia \
    /usr/local/lib/python3*/site-packages/nvidia /usr/lib/python3*/dist-packages/nvidia -name "libcublas.so*" 2>/dev/null | head -1)
  echo "cublas: ${h:-none} ${so:-none}" >&2
  [ -n "$h" ] && [ -n "$so" ] && echo "-DWITH_CUBLAS -I$(dirname "$h") -L$(dirname "$so") -l:$(basename "$so") -Xlinker -rpath=$(dirname "$so")"
}

# A standalone probe: build bench/NAME.cu with plain nvcc (seconds; $2: extra flags, e.g. cublas_flags), run it, log
# it, its JSON rows to $OUT/NAME_rows.jsonl.  PROBE_FLAGS: extra nvcc flags (a macro a probe reads, for an A/B build).
probe_run() {
  local name=$1
  rm -f /tmp/$name.txt /tmp/$name                              # a warm machine's old output must not pass as this run's
  nvcc -O3 ${PROBE_ARCH:--arch=sm_90} ${PROBE_FLAGS:-} ${2:-} -o /tmp/$name bench/$name.cu && timeout ${PROBE_TIMEOUT:-150} /tmp/$name ${PROBE_ARGS:-} \
    >/tmp/$name.txt 2>&1
  echo "== $name ${PROBE_FLAGS:-}" | tee -a "$LOG"
  cat /tmp/$name.txt >>"$LOG"
  grep -v '^JSON' /tmp/$name.txt | tail -40
  grep '^JSON ' /tmp/$name.txt | sed 's/^JSON //' >"$OUT/${name}_rows.jsonl"
}

if has wide; then     # design probe for the 9..32-row decode GEMM (standalone nvcc build, seconds)
  probe_run wide_probe                                       # a row per variant and shape
  [ -n "${WIDE_NCU:-}" ] && timeout 120 ncu --clock-control none -k regex:wide_kernel --launch-skip 4 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" /tmp/wide_probe one 2>&1 \
    | tee -a "$LOG" | grep -vE "^==PROF==|^ *-+$" | grep -vE "^ +(OPT|INF|WRN) |^          " | tail -90
  # SASS with stall samples per instruction (CSV, analysed off the machine)
  [ -n "${WIDE_NCU:-}" ] && timeout 120 ncu --clock-control none -k regex:wide_kernel --launch-skip 4 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --page source --print-source sass --csv /tmp/wide_probe one \
    >"$OUT/wide_sass.csv" 2>/dev/null; ls -la "$OUT/wide_sass.csv" 2>/dev/null
fi
if has gemv; then     # design probe for the batch-1 decode GEMV: per launch and as a PDL chain of decode layers
  probe_run gemv_probe
  if [ -n "${GEMV_NCU:-}" ]; then   # qgemm_kslice under Nsight Compute (the second layer's GPTQ q/k/v, 4-bit q/k/v through the mixed-width path, EXL2-like q/k/v; SASS CSV of the last)
    rm -f /tmp/gemv_probe_li
    nvcc -O3 -lineinfo -arch=sm_90 -o /tmp/gemv_probe_li bench/gemv_probe.cu
    timeout 150 ncu --clock-control none -k regex:qgemm_ --launch-skip 3 --launch-count 3 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" /tmp/gemv_probe_li ncu 2>&1 \
      | tee -a "$LOG" | grep -vE "^==PROF==|^ *-+$" | grep -vE "^ +(OPT|INF|WRN) |^          " >"$OUT/gemv_ncu.txt"
    timeout 150 ncu --clock-control none -k regex:kslice --launch-skip 5 --launch-count 1 \
      --section SourceCounters --section WarpStateStats --page source --print-source sass --csv /tmp/gemv_probe_li ncu \
      >"$OUT/gemv_ks_sass.csv" 2>/dev/null
    ls -la "$OUT"
  fi
fi
if has gemvab; then   # gemv_probe builds with other flags (GEMV_AB: flag sets split by ';', "" the plain build), their
  # chains (mode `chain`, or GEMV_AB_MODE) run in turn GEMV_AB_ROUNDS times (stop 50: the ramp's x staging; stop 53's
  # next step: GEMV_AB_MODE=fold GEMV_AB=";-DKSLICE_FOLD_NO_SS;-DKSLICE_FOLD_NO_NW" -- gemv_probe_hooks.cuh)
  IFS=';' read -ra sets <<<"${GEMV_AB:-;-DKSLICE_X_BULK}"
  for i in "${!sets[@]}"; do
    rm -f /tmp/gemv_ab_$i; nvcc -O3 -arch=sm_90 ${sets[$i]} -o /tmp/gemv_ab_$i bench/gemv_probe.cu >/tmp/gemv_ab_$i.log 2>&1 &
  done
  wait
  for r in $(seq 1 ${GEMV_AB_ROUNDS:-3}); do
    for i in "${!sets[@]}"; do
      echo "== gemvab round $r flags [${sets[$i]}]" | tee -a "$LOG"
      timeout 120 /tmp/gemv_ab_$i ${GEMV_AB_MODE:-chain} 2>&1 | tee -a "$LOG" | grep -E "ext|floor|FAIL|err" | tail -16
    done
  done | tee /tmp/gemv_ab.txt
  grep -E "^== gemvab|^JSON" "$LOG" | awk '/^== gemvab/{tag=$0; next} tag != "" {sub(/^JSON /, ""); print "{\"run\": \"" tag "\", \"row\": " $0 "}"}' \
    >"$OUT/gemv_ab_rows.jsonl"
fi
if has attntail; then  # batch 1: a layer's attention in the tail of its q/k/v launch against its own launch
  probe_run attn_tail_probe   # (bench/attn_tail_probe.cu; standalone, seconds; run in stop 48 call 1)
fi
if has persist; then  # the read floor of a layer's projection streams: 4 PDL launches against one resident kernel
  probe_run persist_probe   # with grid barriers between the stages (bench/persist_probe.cu; standalone, seconds)
fi
if has dequant; then  # design probe for the prompt's dequantise (and, where cuBLAS links, dequantise + GEMM chains)
  rm -f /tmp/dequant_probe.txt /tmp/dequant_probe
  nvcc -O3 -arch=sm_90 ${PROBE_FLAGS:-} $(cublas_flags) -o /tmp/dequant_probe bench/dequant_probe.cu || true
  [ -x /tmp/dequant_probe ] || nvcc -O3 -arch=sm_90 ${PROBE_FLAGS:-} -o /tmp/dequant_probe bench/dequant_probe.cu
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw --format=csv,noheader -lms 200 >/tmp/dequant_smi.txt 2>&1 &
  smi=$!
  timeout ${PROBE_TIMEOUT:-150} /tmp/dequant_probe ${DEQUANT_ARGS:-} >/tmp/dequant_probe.txt 2>&1   # DEQUANT_ARGS=check: checks only
  kill $smi 2>/dev/null
  echo "SM clock / power while the probe ran (every 200 ms):" >>/tmp/dequant_probe.txt
  cat /tmp/dequant_smi.txt >>/tmp/dequant_probe.txt
  cat /tmp/dequant_probe.txt >>"$LOG"
  grep -v '^JSON' /tmp/dequant_probe.txt | grep -v ' MHz, ' | tail -40
  grep ' MHz, ' /tmp/dequant_probe.txt | awk -F', ' '{print "sm", $2}' | sort | uniq -c | sort -rn | head -8   # clock histogram
  grep '^JSON ' /tmp/dequant_probe.txt | sed 's/^JSON //' >"$OUT/dequant_probe_rows.jsonl"
fi
if has twin; then     # the rewritten EXL2 prompt's twin dequantise: variants against the plain kernel (bench/twin_probe.cu)
  flags=$(cublas_flags)
  probe_run twin_probe "$flags"
  [ -z "$flags" ] || [ -x /tmp/twin_probe ] || probe_run twin_probe   # the cuBLAS link failed: without the GEMM rows
fi
if has wg; then       # the prompt's fused dequantise-GEMM (wgmma, sm_90a) against dequantise + cuBLAS
  PROBE_ARCH="-gencode arch=compute_90a,code=sm_90a" probe_run wgmma_probe "$(cublas_flags)"
  if [ -n "${WG_NCU:-}" ]; then   # the second GPTQ 4096x4096 launch under Nsight Compute
    timeout 150 ncu --clock-control none -k regex:qgemm_wg --launch-skip 1 --launch-count 1 --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" /tmp/wgmma_probe ncu 2>&1 \
      | tee -a "$LOG" | grep -vE "^==PROF==|^ *-+$" | grep -vE "^ +(OPT|INF|WRN) |^          " >"$OUT/wg_ncu.txt"
    grep -E "Duration|Compute \(SM\)|Ipc Active|Issue Slots|stalled" "$OUT/wg_ncu.txt" | sort -k3 -n | tail -30
    cuobjdump -sass /tmp/wgmma_probe 2>/dev/null | awk '/Function : /{p = /qgemm_wg_kernelILi256ELi4ELb0/} p' \
      >"$OUT/wg_sass.txt"
    wc -l "$OUT/wg_sass.txt"
    # the warps' stall samples a SASS instruction (the source page)
    timeout 150 ncu --clock-control none -k regex:qgemm_wg --launch-skip 1 --launch-count 1 --section SourceCounters \
      --section WarpStateStats -f -o /tmp/wg_src /tmp/wgmma_probe ncu >>"$LOG" 2>&1 &&
      ncu -i /tmp/wg_src.ncu-rep --page source --print-source sass --csv >"$OUT/wg_source.csv" 2>&1
    wc -l "$OUT/wg_source.csv"; head -c 600 "$OUT/wg_source.csv"; echo
  fi
fi
if has build; then
  # A build of these sources for this python, torch and nvcc with these build settings (bench/build_stamp.sh), carried
  # from an earlier call (`run` with carry [".devcache"]: a SAVE_BUILD=1 call wrote it to $OUT; copy it into
  # .devcache/) or made without a GPU by bench/cross_build.sh, skips the ~3-minute build.  No stamp, no carry.
  t0=$(date +%s)
  stamp=$(bash bench/build_stamp.sh "$PY" 2>/dev/null) || stamp=
  echo "build: here $($PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__)') \
$(nvcc --version 2>/dev/null | tail -1), stamp ${stamp:-none}" | tee -a "$LOG"
  so=exl_core/_C$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
  # a carried build made elsewhere (cross_build.sh) may not load here (system libraries): then it is built here
  if [ -n "$stamp" ] && [ -f ".devcache/ext_$stamp.so.gz" ] && gunzip -c ".devcache/ext_$stamp.so.gz" >"$so" &&
     { $PY -c "import torch; from exl_core.ops.cuda_candidates import _has_cuda_kernel as h; assert h('qgemv_chunks')" \
       2>&1 | tail -3 | tee -a "$LOG"; [ "${PIPESTATUS[0]}" = 0 ]; }; then
    echo "build: carried .devcache/ext_$stamp.so.gz" | tee -a "$LOG"
    kernels_checked=1                                        # the check below, already passed
    [ -f ".devcache/ext_$stamp.txt" ] && sed 's/^/build:   /' ".devcache/ext_$stamp.txt" | tee -a "$LOG"
  else
    rm -f "$so"
    if ! $PY setup.py build_ext --inplace -q >"$BUILD_LOG" 2>&1; then
      cp "$BUILD_LOG" "$OUT/"
      grep -i -B2 -A6 "error" "$BUILD_LOG" | head -60
      exit 1
    fi
    echo "build: $(( $(date +%s) - t0 )) s (stamp $stamp)" | tee -a "$LOG"
    if [ -n "${SAVE_BUILD:-}" ] && [ -n "$stamp" ]; then      # for the next call's carry (16 MiB a returned file)
      strip --strip-debug -o /tmp/ext_stripped.so "$so" 2>/dev/null || cp "$so" /tmp/ext_stripped.so
      gzip -c /tmp/ext_stripped.so >"$OUT/ext_$stamp.so.gz"
      ls -la "$so" /tmp/ext_stripped.so "$OUT/ext_$stamp.so.gz"
    fi
  fi
fi
only_probes=1     # the standalone probes (wg, wide, gemv, readbw, dequant, persist, twin) need no extension build
for p in $PHASES; do case $p in wg|wide|gemv|readbw|dequant|persist|twin|attntail) ;; *) only_probes=0 ;; esac; done
[ $only_probes = 1 ] || [ -n "${kernels_checked:-}" ] || $PY -c "from exl_core.ops.cuda_candidates import _has_cuda_kernel as h; assert h('qgemv_chunks'), 'no CUDA kernels in _C'" || exit 1

# Checkpoints are CPU work: write them while the GPU runs the tests.
( has ckpt || has bench || has u4rows || has mixks || has nofold || has spec || has gen || has probe || has nopdl || has nogs || has nosg || has knockout || has timeline || has nonorm || has noonewave || has nowavecap || has widefold || has noropeattn || has noswiglu || has noearlyw || has nonormperm || has wavekw4 || has wavekw8 || has wavekw16 || has attnab || has nofuse || has nosilu || has noks || has nowide || has widetiles || has nou4 || has promptprof || has projprobe || has noxchunks || has notails || has promptext || has promptab || has prompttl || has prompthost || has normpermold || has widetwin || has noattnorder || has nostage2 || has noh2 || has h2all || has argmax || has gennopick || has oldexl2 || has genprefill || has promptprobe || has kvhtd || has sdpa || has exlv2 || has promptorder || has l2on || has wgdecode || has envab || has buildab ||
  exit 0
  # a warm machine's folders are rebuilt when make_7b_checkpoint.py changed since they were written (stamp: its hash)
  stamp=$(sha1sum bench/make_7b_checkpoint.py | cut -c1-12)
  for f in gptq exl2; do
    [ -f "$CK/$f/config.json" ] && [ "$(cat "$CK/$f/.stamp" 2>/dev/null)" = "$stamp" ] && continue
    rm -rf "${CK:?}/$f" && $PY bench/make_7b_checkpoint.py --fmt $f --out "$CK/$f" && echo "$stamp" >"$CK/$f/.stamp" || exit 1
  done ) >"$CKPT_LOG" 2>&1 &
ck_pid=$!

if has tests; then
  t0=$(date +%s)
  timeout ${TEST_TIMEOUT:-240} $PY -m pytest -q -p no:cacheprovider ${CUDA_TESTS:-tests/test_cuda_kernels.py tests/test_cuda_prompt_path.py \
    tests/test_cuda_pointwise.py tests/test_cuda_model.py tests/test_cuda_graphs.py tests/test_attention_gathered.py \
    tests/test_cuda_uniform4.py tests/test_cuda_norm_fold.py tests/test_cuda_swiglu.py tests/test_cuda_norm_perm.py \
    tests/test_cuda_wide_twin.py tests/test_scale_half2.py tests/test_cuda_wg_decode.py} \
    >"$OUT/cuda_tests.txt" 2>&1
  echo "cuda tests (rc $?, $(( $(date +%s) - t0 )) s):"; grep -E "passed|failed|error" "$OUT/cuda_tests.txt" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/cuda_tests.txt" | head -15
  # the newest kernels' and paths' tests in a process of their own: a crash there cannot hide the results above
  # (SECOND_TESTS=0 leaves them out: a narrow check when device time is short)
  if [ "${SECOND_TESTS:-1}" != 0 ]; then
    timeout ${TEST_TIMEOUT:-240} $PY -m pytest -q -p no:cacheprovider tests/test_cuda_paged_attention.py \
      tests/test_cuda_attn_out_order.py tests/test_cuda_lookahead.py tests/test_cuda_xchunks.py \
      tests/test_generation_fastpaths.py tests/test_cuda_fresh_prefill.py >>"$OUT/cuda_tests.txt" 2>&1
    echo "paged attention tests (rc $?):"; tail -1 "$OUT/cuda_tests.txt"
    grep -E "^(FAILED|ERROR)" "$OUT/cuda_tests.txt" | tail -10
  fi
fi

if has normprobe; then  # the decode norms alone, plain against permuted (bench/norm_probe.py; no checkpoint needed)
  timeout ${PROBE_TIMEOUT:-150} $PY bench/norm_probe.py ${NORMPROBE_ARGS:-} --json "$OUT/norm_probe_h200.json" 2>&1 | tee -a "$LOG" | tail -30
fi
wait $ck_pid || { cp "$CKPT_LOG" "$OUT/"; cat "$CKPT_LOG"; exit 1; }
if has bench; then     # BENCH_ARGS=--quick: graph decode and prompt only.  The table's JSON goes to $OUT (a --json in
  # BENCH_ARGS, later on the line, wins); gpu_bench.py's own default, bench/results/, does not come back from a device
  timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" --json "$OUT/gpu_h200.json" \
    ${BENCH_ARGS:-} 2>&1 | tee -a "$LOG" | tail -60
fi
if has promptab; then  # the prompt's paths in one process, rounds alternated (bench/gpu_prompt_ab.py)
  timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_prompt_ab.py --gptq "$CK/gptq" --exl2 "$CK/exl2" ${PROMPTAB_ARGS:-} 2>&1 \
    | tee -a "$LOG" | tail -10
fi
if has prompttl; then  # the prompt's kernels on a timeline: idle time by kernel pair (bench/prompt_timeline.py)
  timeout ${BENCH_TIMEOUT:-400} $PY bench/prompt_timeline.py --gptq "$CK/gptq" --exl2 "$CK/exl2" 2>&1 | tee -a "$LOG" \
    | tail -50
fi
if has throwprobe; then  # whether failing TORCH_CHECKs raise (bench/throw_probe.py): the native stack of a crash
  timeout ${THROW_TIMEOUT:-420} $PY bench/throw_probe.py 2>&1 | tee -a "$LOG" | tail -60
fi
if has prompthost; then  # the prompt's host side: enqueue time against GPU time, syncs, cProfile (bench/prompt_host.py)
  timeout ${BENCH_TIMEOUT:-400} $PY bench/prompt_host.py --gptq "$CK/gptq" --exl2 "$CK/exl2" 2>&1 | tee -a "$LOG" \
    | tail -150
fi
if has readbw; then   # read-only bandwidth by access method (plain loads, the decode pattern, TMA bulk copies)
  nvcc -O3 -arch=sm_90 -o /tmp/read_bw bench/read_bw.cu && timeout 120 /tmp/read_bw 2>&1 | $PY bench/read_bw_json.py \
    | tee -a "$LOG" | tail -40
fi
if has kslice; then   # qgemm_kslice per (warps along K, ring depth) against qgemm_skinny, 7B decode shapes
  timeout ${PROBE_TIMEOUT:-150} $PY bench/cuda_probe.py kslice 2>&1 | tee -a "$LOG" | tail -20
fi
if has noks; then     # A/B: the same graph decode with the previous decode kernel (qgemm_skinny)
  EXL_CORE_KSLICE=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" --quick \
    --json bench/results/gpu_h200_noks.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has nowide; then   # A/B: the same graph decode with the 17..32-row path on qgemm_kslice instead of qgemm_wide
  EXL_CORE_WIDE=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" --quick \
    --json bench/results/gpu_h200_nowide.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has widetiles; then  # A/B: uniform 4-bit o and down (fewer than 64 tiles of 128 columns) on qgemm_wide at 17..32 rows
  EXL_CORE_WIDE_U4_MIN_TILES=1 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --quick \
    --json /tmp/gpu_h200_widetiles.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has nonorm; then   # A/B: the RMSNorm and residual add as their own launches (EXL_CORE_NORM_FOLD=0, ops/cuda_norm_fold.py)
  EXL_CORE_NORM_FOLD=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" --quick \
    --json /tmp/gpu_h200_nonorm.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has noonewave; then  # A/B: gate/up at batch 1 on 8-warp blocks in 1.73 waves (EXL_CORE_KSLICE_ONE_WAVE=0; stop 51)
  EXL_CORE_KSLICE_ONE_WAVE=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" \
    --quick --json "$OUT/gpu_h200_noonewave.json" 2>&1 | tee -a "$LOG" | tail -14
fi
if has nowavecap; then  # A/B: the one-wave gate/up's blocks not capped at ceil(tiles / SMs) an SM (stop 53)
  EXL_CORE_KSLICE_WAVE_CAP=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" \
    --quick --json "$OUT/gpu_h200_nowavecap.json" 2>&1 | tee -a "$LOG" | tail -14
fi
if has widefold; then  # A/B: the RMSNorm folded into qgemm_wide too (batch 17..32; EXL_CORE_NORM_FOLD_WIDE=1)
  EXL_CORE_NORM_FOLD_WIDE=1 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --quick \
    --json "$OUT/gpu_h200_widefold.json" 2>&1 | tee -a "$LOG" | tail -14
fi
if has noropeattn; then  # A/B: rope and the K/V write as their own launch before attention (EXL_CORE_ROPE_ATTN_FUSE=0)
  EXL_CORE_ROPE_ATTN_FUSE=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" \
    --quick --json "$OUT/gpu_h200_noropeattn.json" 2>&1 | tee -a "$LOG" | tail -14
fi
if has noswiglu; then  # A/B: gate/up, then silu_mul as its own launch at batch 17..32 (EXL_CORE_WIDE_SWIGLU=0)
  EXL_CORE_WIDE_SWIGLU=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --quick \
    --json "$OUT/gpu_h200_noswiglu.json" 2>&1 | tee -a "$LOG" | tail -14
fi
if has noearlyw; then  # A/B: the norm kernels read a model's weight after their PDL wait (EXL_CORE_NORM_EARLY_W=0)
  EXL_CORE_NORM_EARLY_W=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" \
    --quick --json "$OUT/gpu_h200_noearlyw.json" 2>&1 | tee -a "$LOG" | tail -14
fi
if has nonormperm; then  # A/B: EXL2's q/k/v and gate/up gather x themselves (EXL_CORE_NORM_PERM=0), not the norm
  EXL_CORE_NORM_PERM=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --exl2 "$CK/exl2" \
    --quick --json "$OUT/gpu_h200_nonormperm.json" 2>&1 | tee -a "$LOG" | tail -14
fi
for kw in 4 8 16; do   # A/B: staged 1..8-row kslice launches with more tiles than SMs at kw warps a block (default 8
                       # for uniform 4-bit, 4 for mixed widths)
  has wavekw$kw && EXL_CORE_KSLICE_WAVE_KW=$kw timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" \
    --exl2 "$CK/exl2" --quick --json "$OUT/gpu_h200_wavekw$kw.json" 2>&1 | tee -a "$LOG" | tail -14
done
if has nou4; then      # A/B: EXL2 on the mixed-width kernels (EXL_CORE_EXL2_AS_U4=0: not rewritten as uniform 4-bit rows)
  EXL_CORE_EXL2_AS_U4=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --exl2 "$CK/exl2" --quick \
    --json "$OUT/gpu_h200_nou4.json" 2>&1 | tee -a "$LOG" | tail -14
fi
for v in noxchunks:EXL_CORE_KSLICE_XCHUNKS notails:EXL_CORE_WIDE_TAILS; do  # A/B: EXL2's down with its gathers
  # back (on by default since stop 33): at 1..8 rows x through the permutation, at 17..32 an x_gather launch
  has ${v%%:*} && env ${v#*:}=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --exl2 "$CK/exl2" --quick \
    --json "$OUT/gpu_h200_${v%%:*}.json" 2>&1 | tee -a "$LOG" | tail -14
done
if has promptext; then  # A/B: EXL2 prompts in the extended order, GEMMs over all rows (EXL_CORE_PROMPT_NATURAL_X=0),
  # against the default natural order: prompt-only runs alternated twice, one JSON ({ext1, nat1, ext2, nat2})
  rm -f /tmp/exl_promptext_*.json                 # a warm machine's old runs must not pass as this call's
  for r in ext1:0 nat1:1 ext2:0 nat2:1; do
    EXL_CORE_PROMPT_NATURAL_X=${r#*:} timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --exl2 "$CK/exl2" \
      --prompt-only --json "/tmp/exl_promptext_${r%%:*}.json" 2>&1 | tee -a "$LOG" | grep prompt2048
  done
  $PY -c "import json, sys; json.dump({r: json.load(open(f'/tmp/exl_promptext_{r}.json')) for r in sys.argv[2:]},
    open(sys.argv[1], 'w'), indent=1)" "$OUT/gpu_h200_promptext.json" ext1 nat1 ext2 nat2
fi
if has l2on; then   # A/B: the prompt's W persisting in L2 (EXL_CORE_DEQUANT_L2=1), batch 1 and 32 again after it
  EXL_CORE_DEQUANT_L2=1 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" --quick \
    --decode-after-prompt --json "$OUT/gpu_h200_l2on.json" 2>&1 | tee -a "$LOG" | tail -14
fi
if has wgdecode; then  # A/B: qgemm_wg_decode (stream-K wgmma) at 17..32 rows, EXL_CORE_WG_DECODE per WG_AB_VARIANTS
  # (default "0 multi,single"; kinds multi, single, pair: ops/cuda_wg_decode.py), processes in turn for
  # WG_AB_ROUNDS rounds (default 2); the JSONs' names have "_" for the list's commas
  for r in $(seq 1 ${WG_AB_ROUNDS:-2}); do
    for v in ${WG_AB_VARIANTS:-0 multi,single}; do
      EXL_CORE_WG_DECODE=$v timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" \
        --quick --json "$OUT/gpu_h200_wg_${v//,/_}_r$r.json" 2>&1 | tee -a "$LOG" | grep -E "bs(1|32)_decode"
    done
  done
fi
if has envab; then  # A/B of any settings: ENV_AB="label:VAR=val,VAR2=val2 label2: ..." (an empty list after the
  # colon: the defaults; so no value may hold a comma or a space), both formats, bench --quick, processes in turn for
  # ENV_AB_ROUNDS rounds (default 1)
  for r in $(seq 1 ${ENV_AB_ROUNDS:-1}); do
    for v in ${ENV_AB:-default:}; do
      case $v in *:*) ;; *) echo "ENV_AB: '$v' needs a 'label:' in front" >&2; exit 1 ;; esac
      e=${v#*:}
      echo "== envab ${v%%:*} round $r: ${e:-defaults}" | tee -a "$LOG"
      env ${e//,/ } timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" \
        --quick --json "$OUT/gpu_h200_envab_${v%%:*}_r$r.json" 2>&1 | tee -a "$LOG" | grep -E "bs(1|32)_decode|prompt"
    done
  done
fi
if has buildab; then  # A/B of builds: BUILD_AB="[label=]stamp[:VAR=val,VAR2=val2] ..." (.devcache/ext_STAMP.so.gz,
  # carried; "current": this call's build; the settings as in ENV_AB, e.g. a build's matching EXL_CORE_* switches),
  # bench --quick both formats, alternated for BUILD_AB_ROUNDS rounds (default 2); this call's build put back afterwards
  # (stop 59's calls 5-7 ran this loop by hand before it became a phase)
  so=exl_core/_C$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
  cp "$so" /tmp/exl_current.so || exit 1
  ab_entry() { b=${1%%:*} e=; [[ $1 == *:* ]] && e=${1#*:}; label=${b%%=*} b=${b#*=}; }   # -> label, b, e
  labels=
  for v in ${BUILD_AB:-current}; do        # checked before any run: labels unique, builds there, settings VAR=val
    ab_entry "$v"
    [[ " $labels " == *" $label "* ]] && { echo "BUILD_AB: label '$label' twice (name them: label=stamp)" >&2; exit 1; }
    labels="$labels $label"
    [ "$b" = current ] || [ -f ".devcache/ext_$b.so.gz" ] || { echo "BUILD_AB: no .devcache/ext_$b.so.gz" >&2; exit 1; }
    for kv in ${e//,/ }; do [[ $kv == ?*=* ]] || { echo "BUILD_AB: '$kv' is not VAR=val" >&2; exit 1; }; done
  done
  for r in $(seq 1 ${BUILD_AB_ROUNDS:-2}); do
    for v in ${BUILD_AB:-current}; do
      ab_entry "$v"
      if [ "$b" = current ]; then cp /tmp/exl_current.so "$so"
      else gunzip -c ".devcache/ext_$b.so.gz" >"$so" || { cp /tmp/exl_current.so "$so"; exit 1; }; fi
      echo "== build $label ($b) round $r: ${e:-defaults}" | tee -a "$LOG"
      env ${e//,/ } timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" --quick \
        --json "$OUT/gpu_h200_build_${label}_r$r.json" 2>&1 | tee -a "$LOG" | grep -E "bs(1|8|32)_decode_tok_s |prompt"
    done
  done
  cp /tmp/exl_current.so "$so"
fi
for v in "normpermold:EXL_CORE_NORM_PERM_LEAN=0 EXL_CORE_NORM_PERM_LATE=17" "widetwin:EXL_CORE_WIDE_TWIN=1"; do  # A/B
  has ${v%%:*} && env ${v#*:} timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --exl2 "$CK/exl2" --quick \
    --json "$OUT/gpu_h200_${v%%:*}.json" 2>&1 | tee -a "$LOG" | tail -14
done
if has promptprof; then  # the 2,048-token prompt's kernels by name: GPTQ, EXL2 (default), EXL2 unrewritten
  for v in "gptq:" "exl2:" "exl2:EXL_CORE_EXL2_AS_U4=0"; do
    f=${v%%:*} e=${v#*:}
    echo "== prompt profile $f ${e:-default}" | tee -a "$LOG"
    env $e EXL_BENCH_PROFILE_PROMPT=1 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --$f "$CK/$f" --prompt-only \
      --json "$OUT/gpu_h200_promptprof_${f}${e:+_$(echo ${e%%=*} | tr 'A-Z' 'a-z')}.json" 2>&1 | tee -a "$LOG" \
      | grep -A26 "^-- profile\|prompt2048_tok_s"
  done
fi
if has graphprobe; then  # which op breaks a decode step's graph capture (tiny models, several seeds)
  timeout ${PROBE_TIMEOUT:-150} $PY bench/graph_capture_probe.py 2>&1 | tee -a "$LOG" | grep -v ": 0 failed captures" | tail -80
fi
if has genprefill; then  # where the Generator's chunked prefill goes (host syncs, time per chunk, profiler tables)
  timeout ${PROBE_TIMEOUT:-150} $PY bench/gen_prefill_probe.py --model "$CK/gptq" 2>&1 | tee -a "$LOG" | tail -70
fi
if has noattnorder; then  # A/B: o gathers its input itself (EXL_CORE_ATTN_OUT_ORDER=0), not the attention storing it
  EXL_CORE_ATTN_OUT_ORDER=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --exl2 "$CK/exl2" --quick \
    --json "$OUT/gpu_h200_noattnorder.json" 2>&1 | tee -a "$LOG" | tail -14
fi
if has nostage2; then  # A/B: the attention's second iteration of old keys loaded after the PDL wait (stop 39, off)
  EXL_CORE_ATTN_STAGE2=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" \
    --quick --json "$OUT/gpu_h200_nostage2.json" 2>&1 | tee -a "$LOG" | tail -14
fi
if has noh2; then  # A/B: the SwiGLU-fused down projection on fp32 scale and zero (ops/cuda_scale_half2.py off)
  EXL_CORE_KSLICE_H2=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" \
    --quick --json "$OUT/gpu_h200_noh2.json" 2>&1 | tee -a "$LOG" | tail -14
fi
if has h2all; then  # A/B: q/k/v, gate/up and o on half2 scale/zero too (ops/cuda_scale_half2.py KSLICE_H2_ALL)
  EXL_CORE_KSLICE_H2_ALL=1 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" \
    --quick --json "$OUT/gpu_h200_h2all.json" 2>&1 | tee -a "$LOG" | tail -14
fi
if has argmax; then  # A/B: the bench's greedy token by torch's argmax, not greedy_pick (gpu_bench.py --greedy)
  timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" --quick --greedy argmax \
    --json "$OUT/gpu_h200_argmax.json" 2>&1 | tee -a "$LOG" | tail -14
fi
if has oldexl2; then  # A/B: EXL2 as stop 29 ran it: mixed-width kernels, o gathering (both switches of stop 30 off)
  EXL_CORE_EXL2_AS_U4=0 EXL_CORE_ATTN_OUT_ORDER=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --exl2 "$CK/exl2" \
    --quick --json "$OUT/gpu_h200_oldexl2.json" 2>&1 | tee -a "$LOG" | tail -14
fi
if has kvhtd; then    # A/B: the bench's K/V cache as (B, Hkv, T, D) instead of (B, T, Hkv, D)
  timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --quick --kv-layout htd \
    --json bench/results/gpu_h200_kvhtd.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has sdpa; then     # A/B: the bench's decode attention as the masked SDPA over every slot (before the paged kernel)
  timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --quick --decode-attn sdpa \
    --json bench/results/gpu_h200_sdpa.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has nosilu; then   # A/B: decode with silu_mul launched before the down projection instead of fused into it
  EXL_CORE_SILU_FUSE=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" --quick \
    --json /tmp/gpu_h200_nosilu.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has nofuse; then   # A/B: attention's split merge by the combine kernel, rope + K/V write as two launches, o/down not
  # adding into the residual in their GEMM (the prompt)
  EXL_CORE_ATTN_CLUSTER=0 EXL_CORE_ROPE_KV_FUSE=0 EXL_CORE_RESIDUAL_ADD=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" \
    --exl2 "$CK/exl2" --quick --json /tmp/gpu_h200_nofuse.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has nosg; then     # A/B: act-order x gathered from global memory by every qgemm_kslice block (no shared-memory copy)
  EXL_CORE_KSLICE_SGATHER=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" --quick \
    --json /tmp/gpu_h200_nosg.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has attnab; then    # A/B: the paged attention's launch order row-major, then its reads all after the PDL wait
  EXL_CORE_ATTN_HEAD_MAJOR=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" --quick \
    --json /tmp/gpu_h200_attn_rowmajor.json 2>&1 | tee -a "$LOG" | tail -14
  EXL_CORE_ATTN_EARLY=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --exl2 "$CK/exl2" --quick \
    --json /tmp/gpu_h200_attn_late.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has knockout; then  # where a graphed decode step's time goes: parts knocked out one at a time (same process)
  timeout ${PROBE_TIMEOUT:-150} $PY bench/decode_knockout.py --gptq "$CK/gptq" --exl2 "$CK/exl2" 2>&1 | tee -a "$LOG" | tail -24
fi
if has projprobe; then  # the decode projections' launches alone: GPTQ vs EXL2's uniform 4-bit rewrite and variants of it
  timeout ${PROBE_TIMEOUT:-150} $PY bench/proj_probe.py --gptq "$CK/gptq" --exl2 "$CK/exl2" \
    --json "$OUT/proj_probe_h200.json" 2>&1 | tee -a "$LOG" | tail -60
fi
if has timeline; then  # every kernel of one graphed decode step on a timeline (torch.profiler); GPTQ also with rope
  # and the K/V write as their own launch at batch 1 and 32, silu_mul as its own at 32 (decode_timeline.VARIANTS);
  # TIMELINE_CASES keeps some cases, TIMELINE_SKIPS="0 120" traces each after that many steps (more keys)
  timeout ${PROBE_TIMEOUT:-150} $PY bench/decode_timeline.py --gptq "$CK/gptq" --exl2 "$CK/exl2" --exl2-u4 \
    --json "$OUT/decode_timeline_h200.json" 2>&1 | tee -a "$LOG" | tail -200
fi
if has promptorder; then  # the prompt alone, after the --quick decode runs, after empty_cache (host and GPU ms)
  timeout ${PROBE_TIMEOUT:-150} $PY bench/prompt_after_decode.py --gptq "$CK/gptq" --exl2 "$CK/exl2" \
    --json "$OUT/prompt_after_decode_h200.json" 2>&1 | tee -a "$LOG" | tail -20
fi
if has u4rows; then   # A/B: GPTQ gate/up at 2..8 rows on qgemm_kslice too (the one-row limit of stop 23 is unsettled)
  EXL_CORE_KSLICE_U4_ONE_ROW=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --quick \
    --json /tmp/gpu_h200_u4rows.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has nofold; then   # A/B: EXL2 with down_proj's act-order permutation left in place (loader.fold_down_perms off)
  EXL_CORE_FOLD_DOWN_PERM=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --exl2 "$CK/exl2" --quick \
    --json /tmp/gpu_h200_nofold.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has mixks; then    # A/B: EXL2 (mixed widths) at 1..8 rows on qgemm_kslice whatever the tile count (gate/up too)
  EXL_CORE_KSLICE_MIXED_SKINNY=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --exl2 "$CK/exl2" --quick \
    --json /tmp/gpu_h200_mixks.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has nogs; then     # A/B: GPTQ decode with qgemm_kslice and qgemm_wide reading each chunk's group from the chunk table
  EXL_CORE_GROUP_SHIFT=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --quick \
    --json /tmp/gpu_h200_nogs.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has nopdl; then    # A/B: the same graph decode and prompt with programmatic dependent launch off
  EXL_CORE_PDL=0 timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu_bench.py --gptq "$CK/gptq" --quick \
    --json bench/results/gpu_h200_nopdl.json 2>&1 | tee -a "$LOG" | tail -14
fi
if has probe; then    # where the host waits for the GPU; the decode kernel alone on 16 distinct weights
  timeout ${PROBE_TIMEOUT:-150} $PY bench/cuda_probe.py syncs "$CK/gptq" 2>&1 | tee -a "$LOG" | tail -30
  timeout ${PROBE_TIMEOUT:-150} $PY bench/cuda_probe.py prompt "$CK/gptq" 2>&1 | tee -a "$LOG" | tail -6
  timeout ${PROBE_TIMEOUT:-150} $PY bench/cuda_probe.py layout 2>&1 | tee -a "$LOG" | tail -14
fi
if has promptprobe; then   # 2048-token prompt: graph vs eager, dequantise/GEMM overlap and L2 slices, K/V copy layouts
  timeout ${PROBE_TIMEOUT:-150} $PY bench/prompt_probe.py "$CK/gptq" 2>&1 | tee -a "$LOG" | tail -30
fi
if has ncu; then      # qgemm_kslice at 32 rows (4096x4096) under Nsight Compute: what limits it. The L2 and DRAM
  # byte counts test the hypothesis of NOTES.md (x re-read from L2 by each of the 128 column tiles: ~32 MB of L2
  # reads against ~8.4 MB of weights from DRAM)
  timeout ${PROBE_TIMEOUT:-150} ncu --clock-control none -k regex:qgemm_kslice --launch-skip 8 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section LaunchStats --metrics lts__t_bytes.sum,lts__t_sectors_srcunit_tex_op_read.sum,dram__bytes_read.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed \
    $PY bench/cuda_probe.py ks 32 2>&1 | tee -a "$LOG" | tail -100
fi
if has ncu32; then    # the batch-32 decode kernels under Nsight Compute, at the bench's launches: qgemm_wide on q/k/v (one
  # 4096 x 12288 weight: the 3 x 4096 launch's grid) and gate/up (4096 x 22016), the 9..32-row qgemm_kslice on o (4096 x
  # 4096) and down (11008 x 4096), 32 rows: stall reasons per issued instruction (stop 25 profiled 4096 x 4096 only, a
  # shape that runs on kslice at batch 32); then gate/up's per-instruction stall samples as a SASS CSV
  for spec in "wide 32 0 4096 12288" "wide 32 0 4096 22016" "ks 32 0 4096 4096" "ks 32 0 11008 4096"; do
    timeout ${PROBE_TIMEOUT:-150} ncu --clock-control none -k regex:qgemm_ --launch-skip 8 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      $PY bench/cuda_probe.py $spec 2>&1 | tee -a "$LOG" | grep -vE "^==PROF==|^ *-+$" | grep -vE "^ +(OPT|INF|WRN) |^          " \
      | tail -70
  done
  timeout ${PROBE_TIMEOUT:-150} ncu --clock-control none -k regex:qgemm_ --launch-skip 8 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
    $PY bench/cuda_probe.py wide 32 0 4096 22016 >"$OUT/wide_gu_sass.csv" 2>/dev/null; ls -la "$OUT/wide_gu_sass.csv"
fi
if has gen; then      # the product path: Generator (paged cache, sampling) with and without CUDA graphs
  timeout ${GEN_TIMEOUT:-200} $PY bench/gpu_generator.py --model "$CK/gptq" --batches 1,8,32 2>&1 | tee -a "$LOG" | tail -8
fi
if has gennopick; then  # A/B: the Generator's greedy steps through torch's passes, not greedy_pick's CUDA kernel
  EXL_CORE_GREEDY_CUDA=0 timeout ${GEN_TIMEOUT:-200} $PY bench/gpu_generator.py --model "$CK/gptq" --batches 1,8,32 \
    2>&1 | tee -a "$LOG" | tail -8
fi
if has spec; then     # speculative decoding on the same 7B-shaped GPTQ checkpoint (issue 8's H200 row)
  timeout ${SPEC_TIMEOUT:-120} $PY bench/speculative.py --gpu-7b "$CK/gptq" --new-tokens 128 --k 4 \
    --draft-layers 4,8 2>&1 | tee -a "$LOG" | tail -8
fi
if has exlv2; then    # the peer on the same checkpoints: ExLlamaV2 0.3.2 (its wheel in .whl/, carried), ratios vs this call
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/exlv2_site \
    .whl/exllamav2-*.whl || echo "exlv2: no wheel in .whl/ (carry it)"
  PYTHONPATH=/tmp/exlv2_site:$PYTHONPATH TORCH_CUDA_ARCH_LIST=9.0 timeout ${EXLV2_TIMEOUT:-300} $PY bench/exllamav2_peer.py \
    ${EXLV2_ARGS:---gptq $CK/gptq --exl2 $CK/exl2 --gptq-no-gidx $CK/gptq} --ours "$OUT/gpu_h200.json" \
    --ours-generator "$OUT/gpu_generator.json" 2>&1 \
    | tee -a "$LOG" | tail -16
fi
# Same-call ratios of every A/B run this call wrote to $OUT against its default run (bench/ab_table.py)
if [ -n "$OUT_GIVEN" ] && [ -f "$OUT/gpu_h200.json" ] && ls "$OUT"/gpu_h200_*.json >/dev/null 2>&1; then
  $PY bench/ab_table.py "$OUT/gpu_h200.json" "$OUT"/gpu_h200_*.json 2>&1 | tee -a "$LOG"
fi
