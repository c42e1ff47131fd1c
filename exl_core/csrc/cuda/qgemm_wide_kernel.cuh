// The kernel of exl_core::qgemm_wide (host side: qgemm_wide_cuda.cu), without torch headers so that
// bench/wide_probe.cu builds and times it with plain nvcc: the decode GEMM for 9..32 rows of fp16 x (batch 8-32 decode steps) over the
// PackedWeight chunk table.
//
// Why not qgemm_kslice at these rows: its block is 32 output columns x KW warps along K, so every block reads
// all of x from L2 (4 16-byte loads per lane per chunk at 32 rows, 4x the weight bytes), and it keeps the
// scale for later (fp32 d/acc split plus 8 mma per chunk summing x for the zero term): 213-222 registers,
// ~2 warps per scheduler, ~0.7 TB/s at 32 rows.  Here (designed and tuned in bench/wide_probe.cu):
//   block      4 warps side by side = 128 output columns of one K range, so x leaves L2 once per 128
//              columns; its rows for the range go to shared memory by cp.async in kStages stages of kRing
//              chunks, each piece reordered in place into the B-pair order by the thread that copied it, so
//              every warp reads its B words with one 16-byte shared load per row group of 8 and chunk, no PRMT.
//   A          the weights, scaled before the mma: pairs of (1024 + q) by one LOP3 (a_frags), q exact by one
//              HSUB2, then q*s - z*s by one HFMA2 (fp16 weights as a dense fp16 GEMM would hold them): 16 mma
//              per chunk at 32 rows and one accumulator set.  s and z of the block's groups are staged in
//              shared memory by cp.async before the PDL wait.
//   weights    a ring of kRing chunks of words in registers per lane, refilled as each chunk is used.
//   split-K    grid y, a cluster (1, S, 1) per column tile reduced through distributed shared memory
//              (cluster_store: deterministic, bias fused).
// Act-order weights read x permuted by one gather launch (permute_x_per_weight).
// Measured (H200, 32 rows, us, 16 distinct weights per CUDA graph; bench/cuda_probe.py kslice, one call,
// bench/results/cuda_kslice_h200.json) against qgemm_kslice: GPTQ 4-bit g128 4096x4096 14.4 (13.0), q/k/v 27.6
// (38.9), gate/up 47.2 (66.1), 11008x4096 32.2 (30.5); EXL2 ~4.0 bpw act-order 18.7 (18.7), 52.3 (53.7), 56.4
// (87.3), 42.0 (44.7).  This kernel in the probe (no PDL, one matrix per launch; wide_probe_h200.json call 9):
// GPTQ 14.1 / 28.2 / 41.3 / 29.1; the probe's own v2 without the chunk table ran 13.0 / 26.4 / 39.9 / 27.3.
// Stop 26 (bench/wide_probe.cu, 32 rows, one call): 12.24-12.29 / 23.51-23.62 / 33.64-34.00 / 25.29 us after the
// four-column cluster reduction, the in-place reorder of the x stages and two stages (NOTES.md, session "seventh").
// Resource report (sm_90, stop 26): uniform 4-bit 127 (4 n-tiles) / 109 (2) registers, mixed widths 168 / 160; no spills.
#pragma once
#include <cuda_fp16.h>

#include "norm_fold_device.cuh"
#include "pdl_device.cuh"
#include "qmma_device.cuh"

namespace exl_wide {
using namespace exl_mma;

constexpr int kWarps = 4, kThreads = 32 * kWarps, kTile = 32 * kWarps;   // 128 output columns per block
constexpr int kRing = 4;          // chunks of words in flight per lane = chunks per x stage (the kernel's default)
constexpr int kStages = 2;        // x stages in shared memory (default; 3 ran 0.3-1.8 % slower once the stages were
                                  // reordered in place, bench/wide_probe.cu, 2026-12-01)
constexpr int kXPad = 32;         // halves of padding per staged row: the two rows of one LDS.128 phase on other banks
constexpr int kMaxRows = 32;
constexpr size_t kSmemMax = 100 * 1024;   // two blocks per SM
constexpr int kTwRow = kTile + 8;         // int32 a staged row of twin words (TWIN): rows t, t+1 of one LDS.128 phase
                                          // 32 bytes apart in banks

// Shared memory of one block: [x stages kStages x rows x kStageW fp16 | after the K loop: partial tile M x kTile
// fp32][chunk table slice cps x 3 int32][scale/zero of the block's groups: groups x (scale kTile | zero kTile) fp32]
// [with the norm folded in: r of each row, kMaxRows fp32 | partial sums, kThreads fp32 | the norm weight over the
//  block's K range, whole stages][TWIN: twin words, kStages x RING chunks x 4 rows x kTwRow int32 | the twin groups'
//  zeros, groups x kTile fp32 | the twin group of each of the block's groups, groups int32]
template <int RING = kRing, int STAGES = kStages>
struct Smem {
  static constexpr int kStageW = RING * 32 + kXPad;                    // staged row width in halves
  size_t tab, sz, fold, twin, tz, tid, total;
  __host__ __device__ Smem(int rows, int M, int cps, int groups, bool folded = false, bool twins = false) {
    const size_t xs = static_cast<size_t>(STAGES) * rows * kStageW * 2, red = static_cast<size_t>(M) * kTile * 4;
    tab = xs > red ? xs : red;
    sz = tab + ((static_cast<size_t>(cps) * 12 + 15) & ~size_t(15));
    fold = sz + static_cast<size_t>(groups) * 2 * kTile * 4;
    twin = fold + (folded ? (kMaxRows + kThreads) * 4 + static_cast<size_t>((cps + RING - 1) / RING) * RING * 64 : 0);
    tz = twin + (twins ? static_cast<size_t>(STAGES) * RING * 4 * kTwRow * 4 : 0);
    tid = tz + (twins ? static_cast<size_t>(groups) * kTile * 4 : 0);
    total = tid + (twins ? static_cast<size_t>(groups) * 4 : 0);
  }
};

// grid (total column tiles, S); block kThreads; cluster (1, S, 1) when S > 1.  The block's K range is chunks
// [blockIdx.y * cps, + cps).  U4: every chunk 4-bit with its words in chunk order (no table read for the
// words).  x (or the weight's permuted copy mat.x) 16-byte aligned, K % 32 == 0.
// RING / STAGES: the ring depth (= chunks per x stage) and x stages; the extension runs the defaults, the probe
// (bench/wide_probe.cu) times others.
// FOLD: the RMSNorm folded in (Mats::nf; its own instances, so the plain kernels keep their code and registers).
// PAIR (exl_core::qgemm_wide_swiglu): mats.m[0] is gate, m[1] up (same N, uniform 4-bit with regular groups, no
// permutation: the host checks); a block takes 64 columns of each -- warps 0-1 the gate's, 2-3 the up's, grid x
// ceil(N / 64) -- so its epilogue has both halves of silu(gate) * up and writes only that (cluster_store_swiglu):
// no silu_mul launch after the GEMM, half the output bytes.
// TAILS (PAIR only): the product also stored at mats.tails' columns, rows mats.ldy apart (qmma_device.cuh Mats).
// TWIN (uniform 4-bit, regular groups): the weights' extra rows (formats/uniform4.py: a 5..8-bit group's high
// halves, a twin group after the K main rows, reading the same x columns) folded into their main chunks -- the K
// loop runs over the n_chunks main chunks only (x's rows are K long: the main columns first), and a chunk of a
// group with a twin (mats.twins[group] >= 0) adds 16 x its twin chunk's values to its own before the scaling, with
// the group's zero z + 16 z_twin: (r + 16 h - z - 16 z_h) s = (q - z_orig) s, the weight's own 5..8-bit value.  The
// twin words go to shared memory by cp.async with the x stage of their chunk.  Saves the extra rows' K steps (an x
// stage and 16 mma a chunk at 32 rows) for ~3 instructions a pair on a twinned chunk.
template <int NT, bool U4, int RING = kRing, int STAGES = kStages, bool FOLD = false, bool PAIR = false,
          bool TAILS = false, bool TWIN = false>
__global__ void __launch_bounds__(kThreads, U4 ? 4 : 3)   // 128 / 168 registers: mixed widths hold 2 words a chunk
    qgemm_wide_kernel(const __half* __restrict__ x, int M, int64_t K, int n_chunks, int cps, int max_groups,
                      int gshift, const Mats mats) {
  constexpr int kRing = RING, kStages = STAGES, kStageW = Smem<RING, STAGES>::kStageW;
  constexpr int kRows = 8 * NT, kPieces = kRows * kRing * 4;   // 16-byte pieces of x per stage
  static_assert(!PAIR || (U4 && !FOLD), "the SwiGLU pair runs uniform 4-bit weights without the folded norm");
  static_assert(!TAILS || PAIR, "tails: the SwiGLU pair's store");
  static_assert(!TWIN || (U4 && !FOLD), "twins: uniform 4-bit words, regular groups (the host checks gshift)");
  constexpr int kMatW = PAIR ? kTile / 2 : kTile;               // columns of one matrix in a block's tile
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const Mat& mat = PAIR ? mats.m[warp >> 1] : block_mat(mats);   // PAIR: per warp (warp-uniform)
  const int64_t N = mat.N;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) - (PAIR ? 0 : mat.tile0);
  const int c_begin = static_cast<int>(blockIdx.y) * cps;
  const int c_end = min(n_chunks, c_begin + cps), nc = max(0, c_end - c_begin);
  const int64_t col = tile * kMatW + (PAIR ? warp & 1 : warp) * 32 + 4 * g;   // this lane's 4 columns
  // N % 4 == 0: a lane has all 4 columns or none; lanes past N read the last 4 columns, never stored.
  const int64_t lcol = col < N ? col : N - 4;
  const int32_t* base = opaque_ptr(mat.qw.at(0, lcol));   // kept in registers, not re-derived per load
  const int64_t ldq = mat.qw.ldq;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // The norm folded in (norm_fold_device.cuh): weights without permutation (the host checks), x the residual.
  constexpr bool fold = FOLD;
  const Smem<RING, STAGES> lay(kRows, M, cps, max_groups, fold, TWIN);
  __half* xs = reinterpret_cast<__half*>(smem_raw);                     // [kStages][kRows][kStageW]
  float* red = reinterpret_cast<float*>(smem_raw);                      // [M][kTile], after the K loop
  int32_t* tab = reinterpret_cast<int32_t*>(smem_raw + lay.tab);        // chunks [c_begin, c_end)
  float* szs = reinterpret_cast<float*>(smem_raw + lay.sz);             // [group - g_first][2][kTile]
  float* rrow = reinterpret_cast<float*>(smem_raw + lay.fold);          // fold: [kMaxRows] r of each row
  float* rpart = rrow + kMaxRows;                                       // fold: [kThreads] partial sums of squares
  __half* gsm = reinterpret_cast<__half*>(rpart + kThreads);            // fold: norm weight, K range of the block
  int32_t* tws = reinterpret_cast<int32_t*>(smem_raw + lay.twin);       // TWIN: [stage][slot][row t][kTwRow]
  float* tzs = reinterpret_cast<float*>(smem_raw + lay.tz);             // TWIN: [group - g_first][kTile] zero
  int32_t* tids = reinterpret_cast<int32_t*>(smem_raw + lay.tid);       // TWIN: [group - g_first] twin group or -1

  Raw ring[kRing];
  const int32_t* wnext = base + static_cast<int64_t>(4 * c_begin + t) * ldq;   // U4: chunk c's word, row 4c + t
  if constexpr (U4) {                                                   // the first loads need no table
#pragma unroll
    for (int i = 0; i < kRing; ++i) {
      ring[i].lo = i < nc ? __ldg(reinterpret_cast<const int4*>(wnext + static_cast<int64_t>(4 * i) * ldq))
                          : make_int4(0, 0, 0, 0);
      ring[i].hi = make_int4(0, 0, 0, 0);
    }
    wnext += static_cast<int64_t>(4 * kRing) * ldq;
  }
  // Regular groups (uniform 4-bit; qgemm_kslice's group_shift): chunk c is in group c >> gshift, no table read.
  const bool reg = U4 && gshift >= 0;
  if (!reg) {
    for (int i = threadIdx.x; i < nc * 3; i += kThreads) tab[i] = __ldg(mat.chunks + 3 * c_begin + i);
    __syncthreads();
  }
  if constexpr (!U4) {
#pragma unroll
    for (int i = 0; i < kRing; ++i) {
      ring[i].lo = ring[i].hi = make_int4(0, 0, 0, 0);
      if (i < nc) load_words<false>(ring[i], tab + 3 * i, c_begin + i, base, ldq, t);
    }
  }
  // scale/zero rows of the block's groups (consecutive along the chunks; at most max_groups, the host's bound)
  const int g_first = nc <= 0 ? 0 : reg ? c_begin >> gshift : tab[1];
  const int ngr = nc <= 0 ? 0 : min(max_groups, (reg ? (c_end - 1) >> gshift : tab[3 * (nc - 1) + 1]) - g_first + 1);
  for (int i = threadIdx.x; i < ngr * (kTile / 2); i += kThreads) {
    const int gr = i / (kTile / 2), r = i % (kTile / 2), half = r / (kTile / 4), q = r % (kTile / 4);
    // piece q: the block's columns 4q..4q+3 (PAIR: the first kMatW of gate, then the same of up)
    const Mat& mq = PAIR ? mats.m[4 * q >= kMatW] : mat;
    int64_t cq = PAIR ? tile * kMatW + (4 * q) % kMatW : tile * kTile + 4 * q;
    cq = cq < N ? cq : N - 4;
    cp_async16(szs + (gr * 2 + half) * kTile + 4 * q,
               (half ? mq.zero : mq.scale) + static_cast<int64_t>(g_first + gr) * N + cq);
  }
  if (fold)                                                             // a weight: before the wait, with group 0
    for (int i = threadIdx.x; i < nc * 4; i += kThreads) cp_async16(gsm + 8 * i, mats.nf.nw + c_begin * 32 + 8 * i);
  if constexpr (TWIN) {                                                 // load-time data: before the wait
    for (int i = threadIdx.x; i < ngr; i += kThreads) tids[i] = __ldg(mats.twins + g_first + i);
    for (int i = threadIdx.x; i < ngr * (kTile / 4); i += kThreads) {
      const int gr = i / (kTile / 4), q = i % (kTile / 4);
      const int tg = __ldg(mats.twins + g_first + gr);
      if (tg < 0) continue;
      const Mat& mq = PAIR ? mats.m[4 * q >= kMatW] : mat;
      int64_t cq = PAIR ? tile * kMatW + (4 * q) % kMatW : tile * kTile + 4 * q;
      cq = cq < mq.N ? cq : mq.N - 4;
      cp_async16(tzs + gr * kTile + 4 * q, mq.zero + static_cast<int64_t>(tg) * mq.N + cq);
    }
  }

  exl_pdl::pdl_wait();                                                  // x is the previous kernel's output
  exl_pdl::pdl_trigger();
  // rows M..kRows-1 of every stage stay zero (cp.async never writes them)
  if (M < kRows) {
    for (int i = threadIdx.x; i < (kRows - M) * (kStageW / 8); i += kThreads) {
      const int r = M + i / (kStageW / 8), q = i % (kStageW / 8);
#pragma unroll
      for (int st = 0; st < kStages; ++st)
        reinterpret_cast<uint4*>(xs + (st * kRows + r) * kStageW)[q] = make_uint4(0, 0, 0, 0);
    }
  }
  // A thread's pieces of every stage: rows pm + j * kRP (pass j), halves pk..pk+7 of the stage's kRing chunks.  Its
  // source pointer is computed once (opaque_ptr) and the passes are 32-bit offsets from it: per piece, ptxas had
  // re-derived the row, the 64-bit address and the limits (~80 instructions a stage of 4 chunks, between the stage's
  // barrier and its first mma; SASS of the 4-n-tile uniform 4-bit instance).
  constexpr int kP = kRing * 4, kRP = kThreads / kP, kPasses = kRows / kRP;   // pieces a row, rows a pass, passes
  static_assert(kThreads % kP == 0 && kRows % kRP == 0 && kPasses * kThreads == kPieces, "x pieces per thread");
  const int pm = threadIdx.x / kP, pk = 8 * (threadIdx.x % kP);
  const __half* xpiece = opaque_ptr((mat.x != nullptr ? mat.x : x) + (static_cast<int64_t>(c_begin) * 32 +
                                                                      static_cast<int64_t>(pm) * K + pk));
  const int pass_stride = kRP * static_cast<int>(K);                   // K < 2^26 (plan_usable)
  const int nst = (nc + kRing - 1) / kRing;
  auto issue = [&](int s) {                                             // stage s: chunks c_begin + s*kRing ..
    __half* dst = xs + (s % kStages) * kRows * kStageW + pm * kStageW + pk;
    const __half* src = xpiece + s * (kRing * 32);
    if (pk < min(kRing, nc - s * kRing) * 32) {
#pragma unroll
      for (int j = 0; j < kPasses; ++j)
        if (pm + j * kRP < M) cp_async16(dst + j * kRP * kStageW, src + j * pass_stride);
    }
    if constexpr (TWIN) {       // the stage's twinned chunks' words: thread (row r, piece q) one 16-byte piece each
      const int r = threadIdx.x / (kTile / 4), q = threadIdx.x % (kTile / 4);
      const Mat& mq = PAIR ? mats.m[4 * q >= kMatW] : mat;
      int64_t cq = PAIR ? tile * kMatW + (4 * q) % kMatW : tile * kTile + 4 * q;
      cq = cq < mq.N ? cq : mq.N - 4;
#pragma unroll
      for (int i = 0; i < kRing; ++i) {
        const int c = c_begin + s * kRing + i;
        if (c >= c_end) break;
        const int tg = __ldg(mats.twins + (c >> gshift));             // tids may not be visible yet
        if (tg < 0) continue;
        const int64_t tc = (static_cast<int64_t>(tg) << gshift) + (c & ((1 << gshift) - 1));
        cp_async16(tws + (((s % kStages) * kRing + i) * 4 + r) * kTwRow + 4 * q, mq.qw.at(4 * tc + r, cq));
      }
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nst) issue(s);
    cp_async_commit();                                                        // group 0 also holds scale/zero
  }
  if constexpr (fold) {                   // rows' r while the first stages fly: thread (q, m) sums tiles q, q + kQ, ..
    constexpr int kQ = kThreads / kMaxRows;  // of row m, all its loads in flight (a row a warp, one after another,
    const int m = threadIdx.x % kMaxRows, q = threadIdx.x / kMaxRows;   // was a round trip per row)
    float acc_ss = 0.f;
    if (m < M) {
#pragma unroll 16
      for (int tt = q; tt < mats.nf.ss_tiles; tt += kQ) acc_ss += __ldg(mats.nf.ss_in + static_cast<int64_t>(tt) * M + m);
    }
    rpart[threadIdx.x] = acc_ss;
    __syncthreads();
    if (threadIdx.x < M) {
      float tot = 0.f;
#pragma unroll
      for (int j = 0; j < kQ; ++j) tot += rpart[j * kMaxRows + threadIdx.x];
      rrow[threadIdx.x] = rsqrtf(tot / static_cast<float>(K) + mats.nf.eps);
    }
    cp_async_wait_all();                    // the norm weight is read from pieces other threads copied
    __syncthreads();
  }

  float acc[2][NT][4];
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[u][nt][i] = 0.f;
  __half2 sh[4], zs[4];
  int grp = -1;
  bool twinned = false;                                                 // TWIN: the current group has a twin

  // Chunk c (slot i of the ring, its x at xb): new group -> its s and -z*s in fp16; B from the stage; A scaled;
  // the slot refilled with chunk c + kRing when `reload`.
  auto chunk = [&](int i, int c, const __half* xb, bool reload, int st) {
    const int32_t* e = tab + 3 * (c - c_begin);
    const int ge = reg ? c >> gshift : e[1];
    if (ge != grp) {                                                    // warp-uniform
      grp = ge;
      const float* sp = szs + (ge - g_first) * 2 * kTile + warp * 32 + 4 * g;
      float4 s4, z4;
      if (ge - g_first < max_groups) {
        s4 = *reinterpret_cast<const float4*>(sp);
        z4 = *reinterpret_cast<const float4*>(sp + kTile);
      } else {                                                          // beyond the staged groups (not expected)
        s4 = __ldg(reinterpret_cast<const float4*>(mat.scale + static_cast<int64_t>(ge) * N + lcol));
        z4 = __ldg(reinterpret_cast<const float4*>(mat.zero + static_cast<int64_t>(ge) * N + lcol));
      }
      if constexpr (TWIN) {                                             // z + 16 z_twin (exact: z_twin = (z - 8) / 16)
        const bool staged = ge - g_first < max_groups;                  // (the plan stages every group of a block)
        const int tg = staged ? tids[ge - g_first] : __ldg(mats.twins + ge);
        twinned = tg >= 0;
        if (twinned) {
          const float4 t4 = staged
              ? *reinterpret_cast<const float4*>(tzs + (ge - g_first) * kTile + warp * 32 + 4 * g)
              : __ldg(reinterpret_cast<const float4*>(mat.zero + static_cast<int64_t>(tg) * N + lcol));
          z4 = make_float4(fmaf(16.f, t4.x, z4.x), fmaf(16.f, t4.y, z4.y), fmaf(16.f, t4.z, z4.z),
                           fmaf(16.f, t4.w, z4.w));
        }
      }
      half_scales(s4, z4, sh, zs);
    }
    uint32_t b[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint4 v = *reinterpret_cast<const uint4*>(xb + nt * 8 * kStageW + i * 32);
      b[nt][0] = v.x, b[nt][1] = v.y, b[nt][2] = v.z, b[nt][3] = v.w;   // staged in the pair order (permute_stage)
    }
    uint32_t a[4][4];
    if constexpr (TWIN) {
      if (twinned) {
        const int4 tw = *reinterpret_cast<const int4*>(tws + ((st * kRing + i) * 4 + t) * kTwRow + warp * 32 + 4 * g);
        scaled_a_twin(ring[i], tw, sh, zs, a);
      } else {
        scaled_a<4>(ring[i], t, sh, zs, a);
      }
      if (reload) ring[i].lo = __ldg(reinterpret_cast<const int4*>(wnext));
      wnext += 4 * ldq;
    } else if constexpr (U4) {
      scaled_a<4>(ring[i], t, sh, zs, a);
      if (reload) ring[i].lo = __ldg(reinterpret_cast<const int4*>(wnext));
      wnext += 4 * ldq;
    } else {
      scaled_a<0>(ring[i], t, sh, zs, a, e[0]);
      if (reload) load_words<false>(ring[i], e + 3 * kRing, c + kRing, base, ldq, t);
    }
    mma_chunk<NT>(a, b, acc);
  };

  // Stage s's pieces that this thread copied, reordered in place into b_pairs' order once, so that the four warps
  // reading them load B words with no PRMT (16 a chunk each at 4 n-tiles: ~1 instruction per HMMA of the loop in
  // the gate/up instance's SASS, done 4 times over for the same x).  Rows past M are zero (unchanged by it); pieces
  // past the weight's last chunk hold stale bytes that no chunk reads.
  // With the norm folded in, each piece is multiplied by the norm weight first (staged before the loop; one HMUL2 a
  // pair); the rows' r scales the outputs in cluster_store -- normalising every piece in every column tile instead
  // (fold_norm8, the norm kernel's roundings) ran GPTQ batch-32 decode at 5,959.0 tok/s against 7,748.8 unfolded
  // (stop 27 call 5); this way 7,264.3 against 7,757.0 (call 6), so the policy keeps the fold off here
  // (ops/cuda_norm_fold.py NORM_FOLD_WIDE).
  auto permute_stage = [&](int s) {
    __half* dst = xs + (s % kStages) * kRows * kStageW + pm * kStageW + pk;
    const uint4 wv = fold ? *reinterpret_cast<const uint4*>(gsm + s * (kRing * 32) + pk) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < kPasses; ++j)
      if (pm + j * kRP < M) {
        uint4* p = reinterpret_cast<uint4*>(dst + j * kRP * kStageW);
        *p = stage_pairs<false>(fold ? fold_weight8(*p, wv) : *p);
      }
  };
  for (int s = 0; s < nst; ++s) {
    cp_async_wait<kStages - 2>();
    permute_stage(s);                                                   // this thread's own pieces: no barrier first
    __syncthreads();                                                    // stage s landed; stage s-1 is free
    if (s + kStages - 1 < nst) issue(s + kStages - 1);
    cp_async_commit();
    const __half* xb = xs + (s % kStages) * kRows * kStageW + g * kStageW + 8 * t;
    const int cs = c_begin + s * kRing;
    if (cs + 2 * kRing <= c_end) {                                      // a full stage whose refills all exist
#pragma unroll
      for (int i = 0; i < kRing; ++i) chunk(i, cs + i, xb, true, s % kStages);
    } else {
#pragma unroll
      for (int i = 0; i < kRing; ++i)
        if (cs + i < c_end) chunk(i, cs + i, xb, cs + i + kRing < c_end, s % kStages);
    }
  }

  __syncthreads();                                                      // x stages dead: red aliases them
  store_partials<NT>(acc, red + warp * 32, kTile, M, g, t);
  if constexpr (PAIR)
    cluster_store_swiglu<TAILS>(red, M, kTile, kThreads, tile, mats.m[0], mats.m[1], mats.tails, mats.ldy);
  else cluster_store(red, M * kTile, kTile, kThreads, tile, mat, fold ? rrow : nullptr);
}

}  // namespace exl_wide
