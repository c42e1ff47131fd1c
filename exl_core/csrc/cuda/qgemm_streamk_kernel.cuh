// exl_core::qgemm_streamk: the batch-1 decode GEMV (one row of fp16 x) as one wave of warps that each stream a
// contiguous range of (32-column tile, 32-row chunk) units of the launch's weights (stream-K).
//
// Why not qgemm_kslice: its grid is one block per 32-column tile, so a 2x11008 gate/up launch is 688 short-lived
// blocks (~2.6 waves at 2 blocks per SM), each paying a first-load latency and a block barrier; in
// bench/gemv_probe.cu every op ran at ~1.85x a read-only kernel over the same bytes whose grid is one wave of long
// per-thread streams. Here:
//   units      the launch's matrices share K, so unit u is chunk u % C of global tile u / C (tiles of matrix 0,
//              then matrix 1, ...); warp w of W takes units [U w / W, U (w + 1) / W): its stream runs across tile
//              and matrix boundaries, with the weight ring refilled across them.
//   prologue   before the PDL wait (weights are fixed at load time): the ring's first loads, the block's chunk
//              tables to shared memory, and the scale/zero rows of the warp's (tile, group) segments by cp.async;
//              after it, x (per matrix: gathered through the matrix's act-order permutation) goes to shared memory
//              and one block barrier makes it visible.
//   tiles      a tile that lies inside one warp's range is written straight to y; a shared tile's warps write
//              their partial sums to a workspace and bump the tile's counter, and the last to arrive adds the
//              partials in warp order (deterministic), writes y and resets the counter to zero for the next
//              launch (which touches it only after its PDL wait, i.e. after this grid has finished).
//   mma        as qgemm_kslice (weights are the A operand, x is B, a second mma with A = 1 sums x per chunk for
//              the zero term).
// Measured: csrc/cuda/NOTES.md and bench/results/gemv_probe_h200.json.
#pragma once
#include <cuda_fp16.h>

#include "pdl_device.cuh"
#include "qmma_device.cuh"

namespace exl_streamk {
using namespace exl_mma;

constexpr int kTile = 32;   // output columns per tile (one warp's mma width)

// Scratch shared by every launch on a device: counters[tiles] (zero between launches) and partials[warps][2][32].
struct Work {
  int* cnt;
  float* part;
};

// Shared memory of one block: [x: xslots x K fp16][chunk tables: tslots x C x 3 int32][scale/zero: WPB x slots x
// 64 fp32].
struct Smem {
  size_t xs, tab, sz, total;
  __host__ __device__ Smem(int64_t K, int xslots, int tslots, int wpb, int slots) {
    xs = 0;
    tab = static_cast<size_t>(xslots) * K * 2;
    sz = (tab + static_cast<size_t>(tslots) * (K / 32) * 12 + 15) & ~size_t(15);
    total = sz + static_cast<size_t>(wpb) * slots * 64 * 4;
  }
};

__host__ __device__ __forceinline__ int64_t first_unit(int64_t U, int64_t W, int64_t w) { return U * w / W; }
// The warp whose range holds unit u (the largest w with first_unit(w) <= u).
__host__ __device__ __forceinline__ int64_t warp_of(int64_t U, int64_t W, int64_t u) { return ((u + 1) * W - 1) / U; }

__device__ __forceinline__ int mat_of_tile(const Mats& mats, int64_t T) {
  int mi = 0;
#pragma unroll
  for (int i = 1; i < kMaxMats; ++i)
    if (i < mats.n && T >= mats.m[i].tile0) mi = i;
  return mi;
}

// Position in the unit stream: global tile, chunk, matrix.
struct Cur {
  int64_t T;
  int c, mi;
};

// A warp's sums v (lanes t == 0: columns 4g .. 4g + 3 of tile T, which starts at column tcol of its matrix's y):
// straight to y when no other warp shares the tile, else into the workspace, and the last of the tile's warps to
// arrive adds all of them in warp order.  Out of line: one copy, not one per ring step.
template <int DBG>
__device__ __noinline__ void tile_out(float4 v, int64_t T, int64_t U, int64_t W, int C, int64_t wg, int64_t u0,
                                      __half* y, const __half* bias, int64_t N, int64_t tcol, int* cnt, float* part) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t wf = warp_of(U, W, T * C), wl = warp_of(U, W, T * C + C - 1);
  if (wf == wl) {
    const int64_t col = tcol + 4 * g;
    if (t == 0 && col < N) {
      const float f[4] = {v.x, v.y, v.z, v.w};
      __half h[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) h[i] = __float2half_rn(f[i] + (bias ? __half2float(bias[col + i]) : 0.f));
      *reinterpret_cast<uint2*>(y + col) = *reinterpret_cast<const uint2*>(h);
    }
    return;
  }
  if (DBG == 2) return;
  const int slot = u0 >= T * C ? 0 : 1;
  if (t == 0) __stcg(reinterpret_cast<float4*>(part + (wg * 2 + slot) * kTile + 4 * g), v);
  if (DBG != 1) __threadfence();
  __syncwarp();
  int old = 0;
  if (lane == 0) old = atomicAdd(cnt + T, 1);
  old = __shfl_sync(0xffffffffu, old, 0);
  if (old != static_cast<int>(wl - wf)) return;
  // The last contributor.  wf's share of T is its slot 1 unless its range starts at T's first unit; the others'
  // slot 0.
  if (DBG != 1) __threadfence();
  const int nc = static_cast<int>(wl - wf + 1);
  const bool wf_before = first_unit(U, W, wf) < T * C;
  const float* pl = part + wf * 2 * kTile + lane;
  float a = 0.f;
  for (int i0 = 0; i0 < nc; i0 += 8) {                        // 8 loads in flight, then their sum in order
    float r[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int i1 = i0 + i;
      r[i] = i1 < nc ? __ldcg(pl + (2 * i1 + (i1 == 0 && wf_before ? 1 : 0)) * kTile) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) a += r[i];
  }
  const int64_t col = tcol + lane;
  if (col < N) y[col] = __float2half_rn(a + (bias ? __half2float(bias[col]) : 0.f));
  if (lane == 0) cnt[T] = 0;
}

// grid: one wave of blocks of WPB warps; C = K / 32 chunks per tile, U = tiles x C units.  `slots`: scale/zero
// segments staged per warp (a warp with more reads the rest from global memory); xslots: x copies (1, or one per
// matrix of the block when any matrix has a permutation); tslots: chunk tables (one per matrix of the block).
template <int WPB, bool U4, int R, int DBG = 0>   // DBG (probe only): 1 no fences, 2 no shared-tile sums
__global__ void __launch_bounds__(32 * WPB, 16 / WPB)
    qgemm_streamk_kernel(const __half* __restrict__ x, int64_t K, int C, int64_t U, int slots, int xslots, int tslots,
                         const Mats mats, const Work work) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t W = static_cast<int64_t>(gridDim.x) * WPB, wg = static_cast<int64_t>(blockIdx.x) * WPB + warp;
  const int64_t u0 = first_unit(U, W, wg), u1 = first_unit(U, W, wg + 1);
  const int n = static_cast<int>(u1 - u0);
  const int64_t ub0 = first_unit(U, W, static_cast<int64_t>(blockIdx.x) * WPB);
  const int64_t ub1 = first_unit(U, W, static_cast<int64_t>(blockIdx.x + 1) * WPB);
  const int ma = mat_of_tile(mats, ub0 / C);
  const int mb = ub1 > ub0 ? mat_of_tile(mats, (ub1 - 1) / C) : ma;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Smem lay(K, xslots, tslots, WPB, slots);
  __half* xs = reinterpret_cast<__half*>(smem_raw + lay.xs);
  int32_t* tabs = reinterpret_cast<int32_t*>(smem_raw + lay.tab);
  float* szw = reinterpret_cast<float*>(smem_raw + lay.sz) + warp * slots * 64;   // [slots][scale 32 | zero 32]
  auto tab_of = [&](int mi) { return tabs + static_cast<int64_t>(mi - ma) * C * 3; };

  // The lane's column base of tile T (lanes past N read the last 4 columns, never stored).
  auto lane_base = [&](const Cur& k, int64_t& lcol) {
    const Mat& m = mats.m[k.mi];
    const int64_t col = (k.T - m.tile0) * kTile + 4 * g;
    lcol = col < m.N ? col : m.N - 4;
    return m.qw.at(0, lcol);
  };
  auto advance = [&](Cur& k) {
    if (++k.c == C) {
      k.c = 0;
      ++k.T;
      while (k.mi + 1 < mats.n && k.T >= mats.m[k.mi + 1].tile0) ++k.mi;
    }
  };

  Raw ring[R];
#pragma unroll
  for (int i = 0; i < R; ++i) ring[i].lo = ring[i].hi = make_int4(0, 0, 0, 0);
  Cur lc{u0 / C, static_cast<int>(u0 % C), 0};
  lc.mi = mat_of_tile(mats, lc.T);
  int64_t lcol;
  const int32_t* lbase = n > 0 ? lane_base(lc, lcol) : nullptr;
  int64_t lldq = mats.m[lc.mi].qw.ldq;
  int64_t lT = lc.T;
  int loaded = 0;                                             // units whose words have been requested
  // Loads the next unit's words into r (U4: no table needed) and advances the load cursor.
  auto load_next = [&](Raw& r) {
    if (lc.T != lT) {
      lbase = lane_base(lc, lcol);
      lldq = mats.m[lc.mi].qw.ldq;
      lT = lc.T;
    }
    if constexpr (U4) r.lo = __ldg(reinterpret_cast<const int4*>(lbase + static_cast<int64_t>(4 * lc.c + t) * lldq));
    else load_words<false>(r, tab_of(lc.mi) + 3 * lc.c, lc.c, lbase, lldq, t);
    advance(lc);
    ++loaded;
  };
  if constexpr (U4) {
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (i < n) load_next(ring[i]);
  }
  for (int i = threadIdx.x; i < (mb - ma + 1) * C * 3; i += 32 * WPB) {
    const int mi = ma + i / (C * 3);
    tabs[i] = __ldg(mats.m[mi].chunks + (i - (mi - ma) * C * 3));
  }
  __syncthreads();
  if constexpr (!U4) {
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (i < n) load_next(ring[i]);
  }
  // Scale/zero rows of the warp's segments (maximal runs of units in one tile and one group), in stream order.
  {
    int segbase = 0;
    for (int j0 = 0; j0 < n; j0 += 32) {
      const int j = j0 + lane;
      bool start = false;
      int64_t T = 0;
      int mi = 0, ge = 0;
      if (j < n) {
        const int64_t u = u0 + j;
        T = u / C;
        const int c = static_cast<int>(u - T * C);
        mi = mat_of_tile(mats, T);
        ge = tab_of(mi)[3 * c + 1];
        start = j == 0 || c == 0 || tab_of(mi)[3 * (c - 1) + 1] != ge;
      }
      const unsigned mask = __ballot_sync(0xffffffffu, start);
      if (start) {
        const int s = segbase + __popc(mask & ((1u << lane) - 1u));
        if (s < slots) {
          const Mat& m = mats.m[mi];
          for (int q = 0; q < 16; ++q) {
            const int half = q >> 3;
            int64_t cq = (T - m.tile0) * kTile + 4 * (q & 7);
            cq = cq < m.N ? cq : m.N - 4;
            cp_async16(szw + s * 64 + half * 32 + 4 * (q & 7), (half ? m.zero : m.scale) + static_cast<int64_t>(ge) * m.N + cq);
          }
        }
      }
      segbase += __popc(mask);
    }
  }

  exl_pdl::pdl_wait();                                        // x is the previous kernel's output
  exl_pdl::pdl_trigger();
  // x per slot: slot s serves matrix ma + s (one shared copy when no matrix is permuted).
  for (int s = 0; s < xslots && ma + s <= mb; ++s) {
    const int64_t* perm = mats.m[ma + s].perm;
    __half* dst = xs + static_cast<int64_t>(s) * K;
    if (perm == nullptr && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {
      for (int64_t k = 8 * threadIdx.x; k < K; k += 8 * 32 * WPB) cp_async16(dst + k, x + k);
    } else {
      const unsigned short* __restrict__ xu = reinterpret_cast<const unsigned short*>(x);
      unsigned short* du = reinterpret_cast<unsigned short*>(dst);
      for (int64_t k0 = threadIdx.x; k0 < K; k0 += 8 * 32 * WPB) {
        unsigned short h[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int64_t k = k0 + i * 32 * WPB;
          h[i] = k < K ? __ldg(xu + (perm ? __ldg(perm + k) : k)) : 0;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (k0 + i * 32 * WPB < K) du[k0 + i * 32 * WPB] = h[i];
      }
    }
  }
  cp_async_wait_all();
  __syncthreads();

  float d[2][1][4], acc[2][1][4], dx[1][4], xg[1][2];
#pragma unroll
  for (int i = 0; i < 4; ++i) d[0][0][i] = d[1][0][i] = acc[0][0][i] = acc[1][0][i] = dx[0][i] = 0.f;
  xg[0][0] = xg[0][1] = 0.f;
  float4 s4 = make_float4(0.f, 0.f, 0.f, 0.f), z4 = s4;
  constexpr uint32_t kOnes = 0x3C003C00u;                     // fp16 (1, 1)
  Cur cc{u0 / C, static_cast<int>(u0 % C), 0};
  cc.mi = mat_of_tile(mats, cc.T);
  int64_t curT = -1;
  int grp = -1, seg = -1;

  auto flush = [&]() {
    xg[0][0] = dx[0][0];
    xg[0][1] = dx[0][1];
    flush_group<1>(s4, z4, xg, d, acc);
#pragma unroll
    for (int i = 0; i < 4; ++i) dx[0][i] = 0.f;
  };
  // Tile T's sums are complete in this warp (lanes t == 0 hold x row 0 of columns 4g .. 4g + 3).
  auto finish_tile = [&](int64_t T) {
    flush();
    const Mat& m = mats.m[mat_of_tile(mats, T)];
    tile_out<DBG>(make_float4(acc[0][0][0], acc[0][0][2], acc[1][0][0], acc[1][0][2]), T, U, W, C, wg, u0, m.y, m.bias,
                  m.N, (T - m.tile0) * kTile, work.cnt, work.part);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[0][0][i] = acc[1][0][i] = 0.f;
  };
  auto step = [&](const Raw& r) {
    if (cc.T != curT) {
      if (curT >= 0) finish_tile(curT);
      curT = cc.T;
      grp = -1;
    }
    const int32_t* e = tab_of(cc.mi) + 3 * cc.c;
    const int ge = e[1];
    if (ge != grp) {                                          // warp-uniform
      if (grp >= 0) flush();
      grp = ge;
      ++seg;
      if (seg < slots) {
        s4 = *reinterpret_cast<const float4*>(szw + seg * 64 + 4 * g);
        z4 = *reinterpret_cast<const float4*>(szw + seg * 64 + 32 + 4 * g);
      } else {
        const Mat& m = mats.m[cc.mi];
        int64_t col = (cc.T - m.tile0) * kTile + 4 * g;
        col = col < m.N ? col : m.N - 4;
        s4 = __ldg(reinterpret_cast<const float4*>(m.scale + static_cast<int64_t>(ge) * m.N + col));
        z4 = __ldg(reinterpret_cast<const float4*>(m.zero + static_cast<int64_t>(ge) * m.N + col));
      }
    }
    const int xsl = xslots > 1 ? cc.mi - ma : 0;
    uint32_t b[1][4];
    b_pairs(*reinterpret_cast<const uint4*>(xs + static_cast<int64_t>(xsl) * K + cc.c * 32 + 8 * t), b[0]);
    mma16816(dx[0], kOnes, kOnes, kOnes, kOnes, b[0][0], b[0][1]);
    mma16816(dx[0], kOnes, kOnes, kOnes, kOnes, b[0][2], b[0][3]);
    if constexpr (U4) chunk_mma_b<4, 1>(r, b, t, d);
    else chunk_mma_b_any<1>(e[0], r, b, t, d);
    advance(cc);
  };

  // One copy of the ring's steps (the tail turn is the same loop, guarded): the kernel's code must stay in the
  // instruction cache (a version with a separate tail loop and the tile epilogue inlined into every step stalled
  // on instruction fetch: ncu no_instruction 6.4 cycles per issue).
  for (int j = 0; j < n; j += R) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (j + i < n) {
        step(ring[i]);
        if (loaded < n) load_next(ring[i]);
      }
    }
  }
  if (curT >= 0) finish_tile(curT);
}

}  // namespace exl_streamk
