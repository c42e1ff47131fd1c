// exl_core::qgemm_skinny: fused dequantise + tensor-core GEMM for skinny fp16 x (1..32 rows), the
// decode case, over the PackedWeight chunk table (see qmatmul_cuda.cu).
//
// Decode reads every weight once per step, so the kernel is built around keeping many weight bytes
// in flight with few instructions per byte:
//   orientation  y^T = W^T x^T: the weights are the mma's A operand (16 output columns x 16 k), x is
//                B (8 rows of x per n-tile), so each dequantised A fragment serves every n-tile and a
//                lane turns one 16-byte load (4 columns x 8 k) into A registers with one LOP3 per
//                fp16 pair (B = 1024 + q); no wasted rows for M = 1 beyond the mma's n = 8.
//   block        8 warps = 4 column warps x 2 K warps, 128 columns; lane (g = lane/4, t = lane%4) loads
//                columns 4g..4g+3, values 8t..8t+7 of each 32-row chunk.  Tile u (0, 1) maps A row g
//                to column 4g+2u and row g+8 to column 4g+2u+1.
//   pipeline     each warp walks a contiguous run of chunks with a ring of R chunks of words in
//                registers: a chunk's slot is refilled with the chunk R ahead as soon as it is used.
//   scale/zero   d = x . (1024 + q) accumulates in fp32 over a whole group, then
//                acc += s * (d - (1024 + z) * sum(x over the group)): one scale step per group, the
//                group's scales loaded when the group starts (used a group later).
//   split-K      grid y splits K; on sm_90 the split blocks form one cluster and reduce through
//                distributed shared memory (cluster_store): deterministic, one launch, bias fused.
// This header holds the kernel without torch headers (bench/gemv_probe.cu builds it with plain nvcc); the host side
// (split plan, checks, launch, op registration) is qgemm_skinny_cuda.cu.
#pragma once
#include <cuda_fp16.h>

#include <algorithm>

#include "pdl_device.cuh"
#include "qmma_device.cuh"

namespace exl_skinny {
using namespace exl_mma;

constexpr int kColWarps = 4, kKWarps = 2, kThreads = 32 * kColWarps * kKWarps;
constexpr int kTileN = 32 * kColWarps;    // 128 output columns per block
constexpr int kPad = 8;                   // halves of row padding: conflict-free B loads
constexpr size_t kSmemBudget = 100 * 1024; // per block: two blocks still fit one SM

// Ring depth (chunks of words in registers per lane) and blocks per SM the registers are sized for.
// Uniform 4-bit weights need one int4 per chunk, mixed widths two.
template <int NT, bool U4> struct Cfg {
  static constexpr int R = U4 ? (NT == 4 ? 6 : 8) : (NT == 4 ? 3 : 4);
  static constexpr int kMinBlocks = NT == 4 ? 1 : NT == 2 ? 2 : 3;
};

// x is staged for 8*NT rows (rows >= M zero) so the inner loop needs no row checks.
__host__ __device__ inline int rows_of(int M) { return M <= 8 ? 8 : M <= 16 ? 16 : 32; }
__host__ __device__ inline size_t tab_bytes(int cpb) { return (static_cast<size_t>(cpb) * 12 + 15) & ~size_t(15); }
__host__ __device__ inline size_t xsum_bytes(int M, int cpb) {
  return (static_cast<size_t>(rows_of(M)) * cpb * 4 + 15) & ~size_t(15);
}
__host__ __device__ inline int xs_stride_of(int cpb) { return cpb * 32 + kPad; }

// Shared memory: [chunk table cpb x 3][x sums cpb x rows fp32][x rows x xs_stride fp16]; after the K
// loop the same bytes hold the partial tiles [kKWarps][M][kTileN] fp32.
inline size_t smem_bytes(int M, int cpb) {
  const size_t stage =
      tab_bytes(cpb) + xsum_bytes(M, cpb) + static_cast<size_t>(rows_of(M)) * xs_stride_of(cpb) * 2;
  const size_t red = static_cast<size_t>(kKWarps) * M * kTileN * 4;
  return std::max(stage, red);
}

// Most chunks one block can stage for M rows within kSmemBudget.
inline int max_cpb(int M) {
  int lo = kKWarps, hi = 1 << 16;
  while (lo < hi) {                                           // largest cpb with smem_bytes <= budget
    const int mid = (lo + hi + 1) / 2;
    if (smem_bytes(M, mid) <= kSmemBudget) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// d[u][nt] += A(tile u of the chunk's words) x B(x rows of n-tile nt), both k16 steps of the chunk.
template <int BITS, int NT>
__device__ __forceinline__ void chunk_mma(const Raw& r, const __half* xc, int xs_stride, int g, int t,
                                          float (&d)[2][NT][4]) {
  uint32_t a[4][4];                                           // [column 4g+v][pair p]
  a_frags<BITS>(r, t, a);
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const __half* xr = xc + (nt * 8 + g) * xs_stride + j * 16 + 2 * t;
      const uint32_t b0 = *reinterpret_cast<const uint32_t*>(xr);
      const uint32_t b1 = *reinterpret_cast<const uint32_t*>(xr + 8);
#pragma unroll
      for (int u = 0; u < 2; ++u)
        mma16816(d[u][nt], a[2 * u][2 * j], a[2 * u + 1][2 * j], a[2 * u][2 * j + 1], a[2 * u + 1][2 * j + 1], b0, b1);
    }
}

template <int NT>
__device__ __forceinline__ void chunk_mma_any(int bits, const Raw& r, const __half* xc, int xs_stride, int g, int t,
                                              float (&d)[2][NT][4]) {
  switch (bits) {
    case 4: chunk_mma<4, NT>(r, xc, xs_stride, g, t, d); break;
    case 2: chunk_mma<2, NT>(r, xc, xs_stride, g, t, d); break;
    case 3: chunk_mma<3, NT>(r, xc, xs_stride, g, t, d); break;
    case 5: chunk_mma<5, NT>(r, xc, xs_stride, g, t, d); break;
    case 6: chunk_mma<6, NT>(r, xc, xs_stride, g, t, d); break;
    default: chunk_mma<8, NT>(r, xc, xs_stride, g, t, d); break;
  }
}

// grid (total column tiles, splits); block kThreads.
// Mixed widths keep the per-width switch (chunk_mma_any, 117-129 KB of sm_90 code per instance): the runtime
// extraction that shrank qgemm_kslice's (a_frags_any, 57-65 KB here) lost in this kernel, whose 1-n-tile instance
// then needs 128 registers (2 blocks per SM, not 3) to avoid spilling: EXL2 batch-1 decode 277.0 vs 300.9 tok/s,
// batch 8 1,572.7 vs 1,618.0 (H200, same call; NOTES.md, session of 2026-12-01 (third)).
template <int NT, bool U4>
__global__ void __launch_bounds__(kThreads, Cfg<NT, U4>::kMinBlocks)
    qgemm_skinny_kernel(const __half* __restrict__ x, int M, int64_t K, int n_chunks, int cpb, const Mats mats) {
  constexpr int R = Cfg<NT, U4>::R, kRows = 8 * NT;
  const Mat& mat = block_mat(mats);
  const int32_t* __restrict__ chunks = mat.chunks;
  const int64_t* __restrict__ perm = mat.perm;
  const int64_t N = mat.N;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) - mat.tile0;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int xs_stride = xs_stride_of(cpb);
  int32_t* tab = reinterpret_cast<int32_t*>(smem_raw);
  float* xsum = reinterpret_cast<float*>(smem_raw + tab_bytes(cpb));                      // [cpb][kRows]
  __half* xs = reinterpret_cast<__half*>(smem_raw + tab_bytes(cpb) + xsum_bytes(M, cpb)); // [kRows][xs_stride]
  float* red = reinterpret_cast<float*>(smem_raw);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int nw = warp % kColWarps, kw = warp / kColWarps;
  const int64_t col = tile * kTileN + nw * 32 + 4 * g;        // this lane's 4 columns
  // N % 4 == 0: a lane has all 4 columns or none; lanes past N read the last 4 columns and are not stored.
  const int64_t lcol = col < N ? col : N - 4;
  const int32_t* base = opaque_ptr(mat.qw.at(0, lcol));   // kept in registers, not re-derived per load
  const int64_t ldq = mat.qw.ldq;
  const int c_begin = blockIdx.y * cpb, c_end = min(n_chunks, c_begin + cpb);
  const int per = (c_end - c_begin + kKWarps - 1) / kKWarps;
  const int w_begin = min(c_end, c_begin + kw * per), w_end = min(c_end, w_begin + per);

  // The ring's first loads go out before anything else (table entries read from global memory).
  Raw ring[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    ring[i].lo = ring[i].hi = make_int4(0, 0, 0, 0);
    if (w_begin + i < w_end) load_words<U4>(ring[i], chunks + 3 * (w_begin + i), w_begin + i, base, ldq, t);
  }

  const int nc = c_end - c_begin, L = nc * 32;
  for (int i = threadIdx.x; i < nc * 3; i += kThreads) tab[i] = __ldg(chunks + 3 * c_begin + i);
  // Everything above reads weight data fixed at load time; x comes from the previous kernel (PDL).
  exl_pdl::pdl_wait();
  exl_pdl::pdl_trigger();
  stage_x_frag(xs, xs_stride, x, M, kRows, K, static_cast<int64_t>(c_begin) * 32, L, perm);
  __syncthreads();
  for (int idx = threadIdx.x; idx < kRows * nc; idx += kThreads) {  // per-chunk sums of the staged x
    const int m = idx / nc, c = idx - m * nc;
    xsum[c * kRows + m] = m < M ? chunk_x_sum(xs + m * xs_stride + c * 32) : 0.f;
  }
  __syncthreads();

  float d[2][NT][4], acc[2][NT][4], xg[NT][2];
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) d[u][nt][i] = acc[u][nt][i] = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) xg[nt][0] = xg[nt][1] = 0.f;
  float4 s4 = make_float4(0.f, 0.f, 0.f, 0.f), z4 = s4;
  int grp = -1;

  // One chunk: close the previous group when this one starts a new group (its scales were loaded when
  // it started, a group ago), add the chunk's x sums, run its mma.
  auto step = [&](const Raw& r, int cl) {
    const int32_t* e = tab + 3 * cl;
    const int ge = e[1];
    if (ge != grp) {                                          // warp-uniform
      if (grp >= 0) flush_group<NT>(s4, z4, xg, d, acc);
      grp = ge;
      s4 = __ldg(reinterpret_cast<const float4*>(mat.scale + static_cast<int64_t>(ge) * N + lcol));
      z4 = __ldg(reinterpret_cast<const float4*>(mat.zero + static_cast<int64_t>(ge) * N + lcol));
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float2 xv = *reinterpret_cast<const float2*>(xsum + cl * kRows + nt * 8 + 2 * t);
      xg[nt][0] += xv.x;
      xg[nt][1] += xv.y;
    }
    const __half* xc = xs + cl * 32;
    if constexpr (U4) chunk_mma<4, NT>(r, xc, xs_stride, g, t, d);
    else chunk_mma_any<NT>(e[0], r, xc, xs_stride, g, t, d);
  };

  int c = w_begin;
  for (; c + R <= w_end; c += R) {                            // full ring turns: refill each slot after use
#pragma unroll
    for (int i = 0; i < R; ++i) {
      step(ring[i], c + i - c_begin);
      if (c + i + R < w_end) load_words<U4>(ring[i], tab + 3 * (c + i + R - c_begin), c + i + R, base, ldq, t);
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i)                                 // the last partial turn
    if (c + i < w_end) step(ring[i], c + i - c_begin);
  if (grp >= 0) flush_group<NT>(s4, z4, xg, d, acc);

  __syncthreads();                                            // x stage dead: reuse as `red`
  store_partials<NT>(acc, red + kw * M * kTileN + nw * 32, kTileN, M, g, t);
  __syncthreads();
  const int E = M * kTileN;
  for (int idx = threadIdx.x; idx < E; idx += kThreads) {
    float a = red[idx];
#pragma unroll
    for (int w = 1; w < kKWarps; ++w) a += red[w * E + idx];
    red[idx] = a;
  }
  cluster_store(red, E, kTileN, kThreads, tile, mat);
}

}  // namespace exl_skinny
