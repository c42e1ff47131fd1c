// exl_core::qgemm_kslice: the batch-1 decode kernel (1..8 rows of fp16 x) over the PackedWeight chunk
// table, built so that a launch is one memory latency of prologue, a stream of weight loads and one
// block barrier at the end.
//
// Why not qgemm_skinny: its blocks split K across a thread-block cluster, stage x for all column warps
// behind two block barriers and reduce through two cluster barriers; under ncu its warps spend most
// cycles at those barriers (0.30 issued warps per scheduler, DRAM 15 %): 8.8 us for a 4096x4096 4-bit
// matrix, against 4.1 us for a plain read of the same bytes in the same pattern (bench/read_bw.cu).
// Here:
//   block      32 output columns (one warp's width) x KW warps; warp w owns chunks [c0, c1) of K, so
//              each warp streams its own weights and needs only its own slice of x: no block barrier
//              until the KW partial sums are added (one __syncthreads, fixed order: deterministic) --
//              except under act-order, where the block first copies x whole (below).
//   prologue   the ring's weight loads are issued first, then the warp's chunk-table slice and the
//              scale/zero rows of its groups go to shared memory by cp.async, all before the PDL wait
//              (weights are fixed at load time); after it x's slice follows by cp.async, or under
//              act-order a gather from a block-wide copy of x in shared memory (one __syncthreads) or,
//              where the copy does not fit, from global memory; one __syncwarp makes it all visible.
//   widths     4-bit chunks by a_frags<4>, every other width by one runtime path (a_frags_any): the
//              kernel's code must fit the instruction cache (see a_frags_rt).
//   mma        as in qgemm_skinny: weights are the A operand of m16n8k16 (a lane's 16-byte load = 4
//              columns x 8 k, fp16 1024 + q by one LOP3 per pair), x is B; lane t's B pairs are its own
//              8 values of x (staged rows: stored in the pair order, one 16-byte shared load; 9..32 rows:
//              one 16-byte global load, 4 PRMT), and a second mma with A = 1 sums x over the chunk in fp32
//              for the zero term: acc += s * (x.(1024 + q) - (1024 + z) * sum(x)).
//              Uniform 4-bit staged rows (S16): pairs 1 and 3 of x staged divided by 16, A's pairs 1 and 3
//              taken in place as 1024 + 16 q (a_frags16): one shift a word; the sum mma keeps the two pair
//              sums apart (flush_group16).  SASS of the k8 ring-4 instance: ~43 instructions a chunk (~90
//              before the changes of stop 23, csrc/cuda/NOTES.md).
// Measured and not kept (H200, bench/cuda_probe.py kslice; csrc/cuda/NOTES.md): the weight ring in
// shared memory by cp.async (waited by group count) instead of registers: 4096x4096 8.1 vs 6.8 us;
// persistent blocks walking several tiles with the ring running across tiles: gate/up 30.9 vs 29.1 us,
// 4096x4096 8.2 vs 6.8; 32-column-tiled words (each warp's stream contiguous): within 0.4 us of row-major.
// Measured in bench/gemv_probe.cu (M = 1, PDL chain of decode layers, bench/results/gemv_probe_h200.json) and not
// kept: fp16 (q - z) * s before the mma as in qgemm_wide (chain 66.11 vs 64.83 us a layer), registers capped at 64
// by __launch_bounds__ (73.22 with spills; ring 4 64.95); both lived here as template options in commit 166985b.
// This header holds the kernel without torch headers (bench/gemv_probe.cu builds it with plain nvcc); the
// host side (plan, checks, launch, op registration) is qgemm_kslice_cuda.cu.
#pragma once
#include <cuda_fp16.h>

#include "act_device.cuh"
#include "norm_fold_device.cuh"
#include "pdl_device.cuh"
#include "qmma_device.cuh"

// Phase stamps for bench/gemv_probe.cu's `stamps` mode (built with -DKSLICE_STAMPS, which defines the macro as a
// timer store per warp) and its `tailpf` mode's hook after a warp's loop (-DKSLICE_TAIL_PREFETCH: L2 prefetches of
// the next launch's first weights); both defined in bench/gemv_probe_hooks.cuh, empty in the extension.
#ifndef EXL_KSLICE_STAMP
#define EXL_KSLICE_STAMP(phase)
#endif
#ifndef EXL_KSLICE_TAIL
#define EXL_KSLICE_TAIL()
#endif
// Probe hooks of the ramp's x staging (gemv_probe.cu, stop 50): EXL_KSLICE_PREWAIT(R), the uniform 4-bit ring slots
// loaded before the PDL wait (the rest after x is staged), and EXL_KSLICE_STAGE_X(), which stages plain x rows its own
// way and returns true (a bulk copy: -DKSLICE_X_BULK).  In the extension: all R slots, and cp.async by every lane.
#ifndef EXL_KSLICE_PREWAIT
#define EXL_KSLICE_PREWAIT(R) (R)
#endif
#ifndef EXL_KSLICE_STAGE_X
#define EXL_KSLICE_STAGE_X() false
#endif
// Probe hooks of the folded norm's staging (gemv_probe.cu, stop 53: what its ~2.6-2.8 us a layer in the chain is made
// of): EXL_KSLICE_FOLD_RMS0() and EXL_KSLICE_FOLD_RMS(m), the r of row 0 and of row m >= 1 -- in the extension from
// the producer's sums, row 0's loaded before the x copies (ss0, FoldSums0) -- and EXL_KSLICE_FOLD_NW_PIECE(dst, src),
// one 16-byte piece of the norm weight into shared memory -- in the extension a cp.async before the PDL wait.
#ifndef EXL_KSLICE_FOLD_RMS0
#define EXL_KSLICE_FOLD_RMS0() ss0.rms(mats.nf, M, K, lane)
#endif
#ifndef EXL_KSLICE_FOLD_RMS
#define EXL_KSLICE_FOLD_RMS(m) fold_rms(mats.nf, M, m, K, lane)
#endif
#ifndef EXL_KSLICE_FOLD_NW_PIECE
#define EXL_KSLICE_FOLD_NW_PIECE(dst, src) cp_async16(dst, src)
#endif

namespace exl_kslice {
using namespace exl_mma;

constexpr int kTile = 32;        // output columns per block
constexpr int kMaxRows = 32;     // four mma n-tiles
constexpr int kStagedRows = 8;   // up to one n-tile, x is staged in shared memory; more rows (which would not
                                 // fit: 32 x 4096 fp16 is 256 KB) read x from global memory (L1/L2-resident)
constexpr int kXPad = 32;        // halves of padding per staged x row: rows g, g+1 on other banks

// Shared memory of one block: [chunk table n_chunks x 3 int32][scale/zero KW x slots x 64 fp32]
// [x rows x xs_stride fp16][partial sums KW x M x kTile fp32][xr: x_halves fp16, act-order x copied whole].
struct Smem {
  size_t tab, sz, xs, red, xr, total;
  __host__ __device__ Smem(int n_chunks, int kw, int slots, int M, int xs_stride, int64_t x_halves = 0) {
    tab = 0;
    sz = (static_cast<size_t>(n_chunks) * 12 + 15) & ~size_t(15);
    xs = sz + static_cast<size_t>(kw) * slots * 64 * 4;
    red = xs + ((static_cast<size_t>(M) * xs_stride * 2 + 15) & ~size_t(15));
    xr = red + static_cast<size_t>(kw) * M * kTile * 4;
    total = xr + static_cast<size_t>(x_halves) * 2;
  }
};

// Halves of x a block copies whole for the shared-memory gather of act-order weights (gate and up rows with ACT).
__host__ __device__ inline int64_t gather_halves(int M, int64_t K, bool act) { return (act ? 2 : 1) * M * K; }
// The xr region otherwise: the RMSNorm weight's K halves when the norm is folded in (staged rows, no permutation).
__host__ __device__ inline int64_t xr_halves(int sgather, bool fold, int M, int64_t K, bool act) {
  return sgather ? gather_halves(M, K, act) : fold ? K : 0;
}

// d[u][nt] += A(tile u of the chunk's words) x B(n-tile nt), both k16 steps of the chunk: one dequantised
// A fragment serves every n-tile.
// (BITS 0: the width `bits` at run time, a_frags_any.)
// S16 (4-bit only): x staged by stage_pairs<true>, so A's pairs 1 and 3 are 1024 + 16 q (a_frags16).
template <int BITS, int NT, bool S16>
__device__ __forceinline__ void chunk_mma_b(const Raw& r, const uint32_t (&b)[NT][4], int t, float (&d)[2][NT][4],
                                            int bits = BITS) {
  static_assert(!S16 || BITS == 4, "pairs by 16: 4-bit words");
  uint32_t a[4][4];                                           // [column 4g+v][pair p]
  if constexpr (S16) a_frags16(r, a);
  else if constexpr (BITS > 0) a_frags<BITS>(r, t, a);
  else a_frags_any(bits, r, t, a);
  mma_chunk<NT>(a, b, d);
}

// flush_group for staged x (one n-tile, stage_pairs<true>): dx[0..1] holds the sums of pairs 0 and 2 (e) and dx[2..3] of
// pairs 1 and 3 as staged (o, x / 16) for x rows 2t, 2t+1, so x . q = d - 1024 (e + o) and sum(x) = e + 16 o.
__device__ __forceinline__ void flush_group16(const float4& s4, const float4& z4, float (&dx)[1][4],
                                              float (&d)[2][1][4], float (&acc)[2][1][4]) {
  const float t1[2] = {dx[0][0] + dx[0][2], dx[0][1] + dx[0][3]};
  const float t2[2] = {fmaf(16.f, dx[0][2], dx[0][0]), fmaf(16.f, dx[0][3], dx[0][1])};
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int v = 2 * u + (i >> 1), row = i & 1;
      acc[u][0][i] = fmaf(compf(s4, v), fmaf(-compf(z4, v), t2[row], fmaf(-1024.f, t1[row], d[u][0][i])), acc[u][0][i]);
      d[u][0][i] = 0.f;
    }
#pragma unroll
  for (int i = 0; i < 4; ++i) dx[0][i] = 0.f;
}

// grid (total column tiles); block 32 * KW.  `slots`: groups per warp whose scale/zero rows are staged
// (a warp spanning more groups reads the rest from global memory); `xs_stride`: halves per staged x row.
// NT n-tiles of 8 x rows.  NT == 1: x's rows staged in shared memory.  NT > 1 (9..32 rows): every lane loads
// its B fragments (8 values of a row, 16 bytes) straight from global memory into a ring of XR chunks, as it
// does its weight words; x is small and every block reads it, so those loads are L1/L2 hits.  The host then
// passes act-order weights' x already permuted (mat.x), and staging (a barrier and M x K x 2 bytes of
// shared memory) disappears.
// FOLD: the RMSNorm folded into the staging (Mats::nf; staged uniform 4-bit rows without permutation, its own
// instances: in the plain ones its code had doubled the kernel's size and batch-1 decode fell from ~497 to 424.2
// tok/s, stop 27 call 4).
// XC (ACT only): mat.perm holds each chunk's first column in x, a multiple of 8 -- an act-order whose chunks read runs
// of 32 consecutive columns (the identity plus whole chunks read again: formats/uniform4.py's extra rows after
// loader.fold_down_perms) -- staged by 16-byte loads instead of a gather (the host's xchunks; its own instances).
// H2 (by default the SwiGLU-fused down projection, ACT; every staged launch under EXL_CORE_KSLICE_H2_ALL=1 and in
// bench/gemv_probe.cu `h2`): mat.scale
// holds each group and column's (scale / mul, zero) as one half2, 4 bytes instead of fp32's 8, and mat.zero each
// group's fp32 multiplier mul (the host's exact split: ops/cuda_scale_half2.py), staged in the slot's float 32.  In the
// probe (stop 45 call 5, PDL chain of a 7B layer's decode launches) half2 on down alone ran the chain at 45.74 us
// against 46.84; on all four launches 46.98 (q/k/v and gate/up lost 2.66 / 2.74 %), so only down takes it.  In the
// model (stop 46 call 2, bench --quick, 4 rounds in turn, medians): batch-1 decode GPTQ 516.31 against 513.15 tok/s
// with EXL_CORE_KSLICE_H2=0 (1.0061x), EXL2 458.65 against 451.72 (1.0153x), higher in every round.
template <int KW, bool U4, int R, int NT, bool ACT = false, bool FOLD = false, bool XC = false, bool H2 = false>
__global__ void __launch_bounds__(32 * KW)
    qgemm_kslice_kernel(const __half* __restrict__ x, const __half* __restrict__ up, int M, int64_t K, int n_chunks,
                        int slots, int xs_stride, int gshift, int sgather, const Mats mats) {
  EXL_KSLICE_STAMP(0);
  constexpr bool XG = NT > 1;
  // Staged rows are stored in the B-pair order (stage_pairs), so a chunk's B words are one shared load and no PRMT.
  // Uniform 4-bit staged rows also divide pairs 1 and 3 by 16 (S16, a_frags16): one shift a word.  Mixed widths do
  // not: twice given it, they lost -- with an HFMA2 a pair for their other widths (stop 23: EXL2 M=1 q/k/v 23.7 us
  // against 22.2) and with those pairs as fp16 16384 + 16 q at no cost (stop 24, e59ddcf: GEMV probe EXL2-like chain
  // 86.99 against 84.59 us a layer; csrc/cuda/NOTES.md).
  constexpr bool S16 = U4 && !XG;
  constexpr int XR = XG ? 8 / NT : 1;                         // chunks of x in flight per lane: 32 registers
  static_assert(R % XR == 0, "the x ring must turn with the weight ring");
  const Mat& mat = block_mat(mats);
  const int64_t N = mat.N;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) - mat.tile0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t col = tile * kTile + 4 * g;                  // this lane's 4 columns
  // N % 4 == 0: a lane has all 4 columns or none; lanes past N read the last 4 columns, never stored.
  const int64_t lcol = col < N ? col : N - 4;
  const int32_t* base = opaque_ptr(mat.qw.at(0, lcol));
  const int64_t ldq = mat.qw.ldq;
  const int c0 = static_cast<int>(static_cast<int64_t>(n_chunks) * warp / KW);
  const int c1 = static_cast<int>(static_cast<int64_t>(n_chunks) * (warp + 1) / KW);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // The norm folded in (norm_fold_device.cuh): staged rows of a weight without permutation only (the host checks).
  static_assert(!FOLD || (U4 && NT == 1 && !ACT), "the folded norm: staged uniform 4-bit rows, no SwiGLU");
  static_assert(!XC || (ACT && NT == 1), "chunk offsets: the SwiGLU-fused staged rows");
  constexpr bool fold = FOLD;
  const Smem lay(n_chunks, KW, slots, M, xs_stride, xr_halves(sgather, fold, M, K, ACT));
  int32_t* tab = reinterpret_cast<int32_t*>(smem_raw + lay.tab);
  float* szw = reinterpret_cast<float*>(smem_raw + lay.sz) + warp * slots * 64;    // [slots][scale 32 | zero 32]
  __half* xs = reinterpret_cast<__half*>(smem_raw + lay.xs);
  float* red = reinterpret_cast<float*>(smem_raw + lay.red);

  Raw ring[R];
#pragma unroll
  for (int i = 0; i < R; ++i) ring[i].lo = ring[i].hi = make_int4(0, 0, 0, 0);
  constexpr int kPre = EXL_KSLICE_PREWAIT(R);
  if constexpr (U4) {                                         // first weight loads need no table
#pragma unroll
    for (int i = 0; i < kPre; ++i)
      if (c0 + i < c1) load_words<true>(ring[i], nullptr, c0 + i, base, ldq, t);
  }
  // Regular groups (uniform 4-bit only; every launch's weights alike): chunk c is in group c >> gshift, and the
  // table is not read at all -- its load was the prologue's longest wait (bench/gemv_probe.cu under ncu).
  const bool reg = U4 && gshift >= 0;
  if (!reg) {
    for (int i = lane; i < (c1 - c0) * 3; i += 32) tab[3 * c0 + i] = __ldg(mat.chunks + 3 * c0 + i);
    __syncwarp();
  }
  if constexpr (!U4) {
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (c0 + i < c1) load_words<false>(ring[i], tab + 3 * (c0 + i), c0 + i, base, ldq, t);
  }
  // Scale/zero rows of the warp's first `slots` groups (groups are consecutive along the chunks).
  const int gA = c1 <= c0 ? 0 : reg ? c0 >> gshift : tab[3 * c0 + 1];
  const int gw = c1 <= c0 ? 0 : min(slots, (reg ? (c1 - 1) >> gshift : tab[3 * (c1 - 1) + 1]) - gA + 1);
  for (int j = lane; j < gw * (H2 ? 8 : 16); j += 32) {     // H2: a slot's 32 (s, z) pairs in its first 32 floats
    const int s = H2 ? j >> 3 : j >> 4, half = H2 ? 0 : (j >> 3) & 1, q = j & 7;
    int64_t cq = tile * kTile + 4 * q;
    cq = cq < N ? cq : N - 4;
    cp_async16(szw + s * 64 + half * 32 + 4 * q, (half ? mat.zero : mat.scale) + static_cast<int64_t>(gA + s) * N + cq);
  }
  if constexpr (H2)                                           // and its group's multiplier in float 32
    for (int j = lane; j < gw; j += 32) cp_async4(szw + j * 64 + 32, mat.zero + gA + j);

  const int kw0 = c0 * 32, kwl = (c1 - c0) * 32;
  __half* gsm = reinterpret_cast<__half*>(smem_raw + lay.xr);   // fold: the norm weight (a weight: before the wait)
  if constexpr (fold)
    for (int j = lane; j < (kwl >> 3); j += 32) EXL_KSLICE_FOLD_NW_PIECE(gsm + kw0 + 8 * j, mats.nf.nw + kw0 + 8 * j);

  EXL_KSLICE_STAMP(1);
  exl_pdl::pdl_wait();                                        // x is the previous kernel's output
  exl_pdl::pdl_trigger();
  EXL_KSLICE_STAMP(2);
  const int64_t* perm = mat.perm;
  // ACT (staged rows only): x is the MLP's gate, `up` its up, and the staged rows are silu(gate) * up, the down
  // projection's input without a silu_mul launch between gate/up and down.  Its own instances, so the plain
  // kernels keep their code (as a runtime branch, EXL2 batch-1 decode measured 254.4-255.5 tok/s in one call
  // against 264.9-266.1 in earlier calls; with the split 260.2 -- not separated from the spread between machines).
  const bool aligned = ((reinterpret_cast<uintptr_t>(x) | (ACT ? reinterpret_cast<uintptr_t>(up) : 0)) & 15) == 0;
  if constexpr (XG) {
    // nothing to stage
  } else if (perm == nullptr && aligned && !ACT) {
    // by cp.async, every piece in flight at once, then reordered in place (the build that staged through
    // registers, loads then stores, ran GPTQ q/k/v M=8 at 21.0 us against 19.4 in an earlier sweep)
    FoldSums0 ss0;                                            // before the copies: see FoldSums0
    if constexpr (fold) ss0.load(mats.nf, M, lane);
    if (fold || !EXL_KSLICE_STAGE_X())
      for (int j = lane; j < M * (kwl >> 3); j += 32) {
        const int m = j / (kwl >> 3), k = kw0 + 8 * (j - m * (kwl >> 3));
        cp_async16(xs + m * xs_stride + k, x + m * K + k);
      }
    if constexpr (fold) {                                     // rows' r while the copies fly, then x normalised
      float* rw = red + warp * M * kTile;                     // the warp's partial sums' area, free until its loop ends
      const float r0 = EXL_KSLICE_FOLD_RMS0();                // row 0's out of the row loop; with rms()'s tail loop
      for (int m = 0; m < M; ++m) {                           // gone too, GPTQ batch 1 1.0023x-1.0035x (stop 55 call 3)
        const float r = m == 0 ? r0 : EXL_KSLICE_FOLD_RMS(m);
        if (lane == 0) rw[m] = r;
      }
      cp_async_wait_all();
      __syncwarp();                                           // pieces other lanes copied, r
      for (int m = 0; m < M; ++m) {
        const float r = rw[m];
        for (int p = lane; p < (kwl >> 3); p += 32) {
          uint4* q = reinterpret_cast<uint4*>(xs + m * xs_stride + kw0 + 8 * p);
          *q = stage_pairs<S16>(fold_norm8(*q, *reinterpret_cast<const uint4*>(gsm + kw0 + 8 * p), r));
        }
      }
    } else {
      cp_async_wait_all();                                    // a lane reorders only the pieces it copied
      for (int j = lane; j < M * (kwl >> 3); j += 32) {
        const int m = j / (kwl >> 3), k = kw0 + 8 * (j - m * (kwl >> 3));
        uint4* p = reinterpret_cast<uint4*>(xs + m * xs_stride + k);
        *p = stage_pairs<S16>(*p);
      }
    }
  } else if (ACT && (perm == nullptr || XC) && (aligned || XC)) {  // XC: the host checked the alignment
    for (int j = lane; j < M * (kwl >> 3); j += 32) {
      const int m = j / (kwl >> 3), k = kw0 + 8 * (j - m * (kwl >> 3));
      const int64_t src = XC ? __ldg(perm + (k >> 5)) + (k & 31) : k;
      const uint4 gv = __ldg(reinterpret_cast<const uint4*>(x + m * K + src));
      const uint4 uv = __ldg(reinterpret_cast<const uint4*>(up + m * K + src));
      uint4 o;
      const __half *gp = reinterpret_cast<const __half*>(&gv), *upp = reinterpret_cast<const __half*>(&uv);
      __half* op = reinterpret_cast<__half*>(&o);
#pragma unroll
      for (int i = 0; i < 8; ++i) op[i] = exl_act::silu_mul<__half>(gp[i], upp[i]);
      *reinterpret_cast<uint4*>(xs + m * xs_stride + k) = stage_pairs<S16>(o);
    }
  } else if (sgather && perm != nullptr && aligned) {
    // Act-order, shared-memory gather: the block copies x's rows whole (16-byte pieces; with ACT gate's, then
    // up's) and every warp gathers its slice from that copy.  Gathering from global memory instead moves a
    // 32-byte sector per 2-byte value and every block repeats it (gemv_probe.cu: 4-bit weights with a
    // permutation ran the decode chain at 77.65 us a layer against 62.42 without).  perm is read after the
    // PDL wait (see permute_x_per_weight); its loads are coalesced.
    __half* xr = reinterpret_cast<__half*>(smem_raw + lay.xr);
    const int per_row = static_cast<int>(K >> 3), nrows = ACT ? 2 * M : M;
    for (int j = threadIdx.x; j < nrows * per_row; j += 32 * KW) {
      const int r = j / per_row, k = 8 * (j - r * per_row);
      cp_async16(xr + static_cast<int64_t>(r) * K + k, (r < M ? x + r * K : up + (r - M) * K) + k);
    }
    int src[8];                                               // the first pass's indices load during the copy
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int k = kw0 + lane + 32 * i;
      src[i] = k < kw0 + kwl ? static_cast<int>(__ldg(perm + k)) : -1;
    }
    cp_async_wait_all();
    __syncthreads();
    const unsigned short* xru = reinterpret_cast<const unsigned short*>(xr);
    unsigned short* xsu = reinterpret_cast<unsigned short*>(xs);
    for (int k0 = kw0 + lane; k0 < kw0 + kwl; k0 += 8 * 32) {
      if (k0 != kw0 + lane) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int k = k0 + 32 * i;
          src[i] = k < kw0 + kwl ? static_cast<int>(__ldg(perm + k)) : -1;
        }
      }
      for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if (src[i] < 0) continue;
          unsigned short h = xru[m * K + src[i]];
          if constexpr (ACT)
            h = __half_as_ushort(exl_act::silu_mul<__half>(__ushort_as_half(h), __ushort_as_half(xru[(M + m) * K + src[i]])));
          const int k = k0 + 32 * i;
          xsu[m * xs_stride + (k & ~7) + pairs_slot(k & 7)] = pairs_value<S16>(k & 7, h);
        }
      }
    }
  } else {
    const unsigned short* __restrict__ xu = reinterpret_cast<const unsigned short*>(x);
    unsigned short* xsu = reinterpret_cast<unsigned short*>(xs);
    for (int k0 = kw0 + lane; k0 < kw0 + kwl; k0 += 8 * 32) {  // 8 gathers in flight per lane and row
      int src[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int k = k0 + 32 * i;
        src[i] = k < kw0 + kwl ? static_cast<int>(perm ? __ldg(perm + k) : k) : -1;
      }
      for (int m = 0; m < M; ++m) {
        unsigned short h[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) h[i] = src[i] >= 0 ? __ldg(xu + m * K + src[i]) : 0;
        if constexpr (ACT) {
#pragma unroll
          for (int i = 0; i < 8; ++i)
            if (src[i] >= 0) h[i] = __half_as_ushort(exl_act::silu_mul<__half>(__ushort_as_half(h[i]), __ldg(up + m * K + src[i])));
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int k = k0 + 32 * i;
          if (src[i] < 0) continue;
          xsu[m * xs_stride + (k & ~7) + pairs_slot(k & 7)] = pairs_value<S16>(k & 7, h[i]);
        }
      }
    }
  }
  cp_async_wait_all();
  __syncwarp();
  EXL_KSLICE_STAMP(3);
  if constexpr (U4 && kPre < R) {                             // the ring slots the prologue left (probe only)
#pragma unroll
    for (int i = kPre; i < R; ++i)
      if (c0 + i < c1) load_words<true>(ring[i], nullptr, c0 + i, base, ldq, t);
  }

  float d[2][NT][4], acc[2][NT][4], dx[NT][4], xg[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) d[0][nt][i] = d[1][nt][i] = acc[0][nt][i] = acc[1][nt][i] = dx[nt][i] = 0.f;
    xg[nt][0] = xg[nt][1] = 0.f;
  }
  float4 s4 = make_float4(0.f, 0.f, 0.f, 0.f), z4 = s4;
  int grp = -1;
  const __half* xrow = xs + (g < M ? g : 0) * xs_stride + 8 * t;   // B column g = x row g (staged x)
  constexpr uint32_t kOnes = 0x3C003C00u, kZero = 0u;      // fp16 (1, 1), (0, 0)
  // x from global memory: lane (g, t) of n-tile nt reads row 8 nt + g, values 8t..8t+7 of each chunk.  Rows past M
  // read row M - 1 instead: an mma's output row n depends on x row n only, and rows past M are never stored, so
  // no zero fill and no per-load check (which cost ~16 instructions a chunk at 4 n-tiles).
  // xt[nt]: the lane's 8 values of chunk `cturn` (the first chunk of the ring turn in progress) in row 8 nt + g,
  // advanced once a turn, so a load is xt + an immediate.  The pointers pass through opaque_ptr: from the
  // expression ptxas re-derived the clamped rows and the 64-bit addresses before every load (~40 of ~135
  // instructions a chunk in the k8 ring-8 4-n-tile instance's SASS).
  const __half* xbase = XG && mat.x != nullptr ? mat.x : x;
  const __half* xt[NT];
  if constexpr (XG) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xt[nt] = opaque_ptr(xbase + (min(8 * nt + g, M - 1) * K + 8 * t + c0 * 32));
  }
  uint4 xr[XR][NT];
  auto load_x = [&](uint4 (&v)[NT], int off) {               // chunk cturn + off
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) v[nt] = __ldg(reinterpret_cast<const uint4*>(xt[nt] + off * 32));
  };
  auto next_turn = [&]() {
    if constexpr (XG) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) xt[nt] += R * 32;
    }
  };

  auto flush = [&]() {
    if constexpr (!S16) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        xg[nt][0] = dx[nt][0];
        xg[nt][1] = dx[nt][1];
      }
      flush_group<NT>(s4, z4, xg, d, acc);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) dx[nt][i] = 0.f;
    } else {
      flush_group16(s4, z4, dx, d, acc);
    }
  };
  // Regular groups: the group check runs at a group's first chunk only (gnext); table groups check every chunk.
  int gnext = c0;
  auto step = [&](const Raw& r, const uint4 (&xv)[NT], int c) {
    const int32_t* e = tab + 3 * c;
    if (c == gnext) {                                         // warp-uniform
      const int ge = reg ? c >> gshift : e[1];
      gnext = reg ? (ge + 1) << gshift : c + 1;
      if (ge != grp) {
        if (grp >= 0) flush();
        grp = ge;
        const int s = ge - gA;
        if constexpr (H2) {
          const float* src = s < slots ? szw + s * 64 + 4 * g : mat.scale + static_cast<int64_t>(ge) * N + lcol;
          const uint4 v = s < slots ? *reinterpret_cast<const uint4*>(src) : __ldg(reinterpret_cast<const uint4*>(src));
          const float mul = s < slots ? szw[s * 64 + 32] : __ldg(mat.zero + ge);
          const float2 p0 = __half22float2(*reinterpret_cast<const __half2*>(&v.x));
          const float2 p1 = __half22float2(*reinterpret_cast<const __half2*>(&v.y));
          const float2 p2 = __half22float2(*reinterpret_cast<const __half2*>(&v.z));
          const float2 p3 = __half22float2(*reinterpret_cast<const __half2*>(&v.w));
          s4 = make_float4(p0.x * mul, p1.x * mul, p2.x * mul, p3.x * mul), z4 = make_float4(p0.y, p1.y, p2.y, p3.y);
        } else if (s < slots) {
          s4 = *reinterpret_cast<const float4*>(szw + s * 64 + 4 * g);
          z4 = *reinterpret_cast<const float4*>(szw + s * 64 + 32 + 4 * g);
        } else {
          s4 = __ldg(reinterpret_cast<const float4*>(mat.scale + static_cast<int64_t>(ge) * N + lcol));
          z4 = __ldg(reinterpret_cast<const float4*>(mat.zero + static_cast<int64_t>(ge) * N + lcol));
        }
      }
    }
    uint32_t b[NT][4];
    if constexpr (XG) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        b_pairs(xv[nt], b[nt]);
        mma16816(dx[nt], kOnes, kOnes, kOnes, kOnes, b[nt][0], b[nt][1]);
        mma16816(dx[nt], kOnes, kOnes, kOnes, kOnes, b[nt][2], b[nt][3]);
      }
    } else {                                                  // staged in the pair order: the words are B
      const uint4 v = *reinterpret_cast<const uint4*>(xrow + c * 32);
      b[0][0] = v.x, b[0][1] = v.y, b[0][2] = v.z, b[0][3] = v.w;
      // S16: A rows g (k slots 0..7: pairs 0, 2) and g + 8 (slots 8..15: pairs 1, 3) sum those pairs apart
      constexpr uint32_t kA12 = S16 ? kZero : kOnes;
      mma16816(dx[0], kOnes, kA12, kA12, kOnes, b[0][0], b[0][1]);
      mma16816(dx[0], kOnes, kA12, kA12, kOnes, b[0][2], b[0][3]);
    }
    if constexpr (U4) chunk_mma_b<4, NT, S16>(r, b, t, d);
    else chunk_mma_b<0, NT, false>(r, b, t, d, e[0]);
  };
  // After chunk c's step: its slots take chunk c + R's words and chunk c + XR's x.  Uniform 4-bit: the words of
  // chunk c + R by a pointer that walks 4 rows a chunk -- from `base` per chunk, ptxas re-read the Mat's fields
  // from constant memory (indexed by the block's matrix) and redid the 64-bit address each time, ~25 instructions
  // ahead of every refill load (SASS of the k8 ring-4 instance).
  const int32_t* wnext = base + static_cast<int64_t>(4 * (c0 + R) + t) * ldq;
  const int64_t wstep = 4 * ldq;
  auto refill = [&](int i, int c) {                           // c = cturn + i
    if constexpr (U4) {
      if (c + R < c1) ring[i].lo = __ldg(reinterpret_cast<const int4*>(wnext));
      wnext += wstep;
    } else if (c + R < c1) {
      load_words<false>(ring[i], tab + 3 * (c + R), c + R, base, ldq, t);
    }
    if constexpr (XG)
      if (c + XR < c1) load_x(xr[i % XR], i + XR);
  };
  if constexpr (XG) {
#pragma unroll
    for (int i = 0; i < XR; ++i)
      if (c0 + i < c1) load_x(xr[i], i);
  }

  int c = c0;
  for (; c + R <= c1; c += R) {                               // full ring turns: refill each slot after use
#pragma unroll
    for (int i = 0; i < R; ++i) {
      step(ring[i], xr[i % XR], c + i);
      refill(i, c + i);
    }
    next_turn();
  }
#pragma unroll
  for (int i = 0; i < R; ++i)                                 // the last partial turn
    if (c + i < c1) {
      step(ring[i], xr[i % XR], c + i);
      if constexpr (XG) refill(i, c + i);
    }
  if (grp >= 0) flush();
  EXL_KSLICE_STAMP(4);
  EXL_KSLICE_TAIL();

  store_partials<NT>(acc, red + warp * M * kTile, kTile, M, g, t);
  __syncthreads();
  EXL_KSLICE_STAMP(5);
  static_assert(kTile == 32, "a warp stores one row of a tile (fold_row_ss)");
  for (int idx = threadIdx.x; idx < M * kTile; idx += 32 * KW) {   // warp-uniform rows and trip count
    const int m = idx / kTile, cl = idx - m * kTile;
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < KW; ++w) a += red[(w * M + m) * kTile + cl];
    const int64_t n = tile * kTile + cl;
    float sq = 0.f;
    if (n < N) {
      if (mat.bias) a += __half2float(mat.bias[n]);
      sq = fold_store(mats.nf, mat.y + m * N + n, a);          // a plain store unless the residual add is folded in
    }
    if (mats.nf.ss_out != nullptr) fold_row_ss(mats.nf, sq, tile, M, m, lane);
  }
  EXL_KSLICE_STAMP(6);
}


}  // namespace exl_kslice
