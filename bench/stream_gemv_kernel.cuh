// A batch-1 GEMV in the shape of bench/persist_probe.cu's F rows (probe only; bench/gemv_probe.cu times it): one
// block an SM (one wave), launch bounds that leave room for a second launch's block on the same SM, the dependants
// triggered first thing (EARLY), and the first PRE chunks of a warp's weights copied into shared memory by cp.async
// before the PDL wait, so the next launch has its weights in flight through this one's tail.  Read-only, four such
// launches a layer read a layer's bytes at 30.63 us against 35.18 for four launches of the usual shape (call 2,
// bench/results/persist_probe_h200_stop40_call2.jsonl).
// The arithmetic is qgemm_kslice's for staged uniform 4-bit rows (S16: chunk_mma_b, flush_group16): GPTQ 4-bit with
// regular groups of 128 rows, M = 1, x unpermuted.  A block owns a contiguous run of the launch's column tiles (all
// its matrices'), its KW warps split K as in qgemm_kslice; a warp's weight stream runs on across the block's tiles
// (the register ring is refilled with the next tile's words), and each tile ends in one block reduction.
// Measured (gemv_probe mode `stream`, H200, stop 40 calls 3-4, bench/results/gemv_probe_stream_h200_stop40_*): a
// layer's chain at 69.30-72.08 us with one block an SM and 56.19-56.73 with two, against the extension's kernels'
// 46.67-47.04 -- lost: 8 warps an SM leave each warp too long a chain of chunks (csrc/cuda/NOTES.md, "twenty-first").
#pragma once
#include "../exl_core/csrc/cuda/cp_async_device.cuh"
#include "../exl_core/csrc/cuda/qgemm_kslice_kernel.cuh"

namespace exl_stream {
using namespace exl_mma;
using exl_kslice::kTile;

constexpr int KW = 8;   // warps a block, along K (K / 32 must be a multiple: 4096 and 11008 are)

__device__ __forceinline__ const Mat& mat_of_tile(const Mats& mats, int tile) {
  int mi = 0;
#pragma unroll
  for (int i = 1; i < kMaxMats; ++i)
    if (i < mats.n && tile >= mats.m[i].tile0) mi = i;
  return mats.m[mi];
}

// Groups of 128 rows a warp's chunks touch in one tile, at most (its scale/zero slots a tile).
__host__ __device__ inline int stream_slots(int64_t K) { return static_cast<int>(K / 32 / KW + 3) / 4 + 1; }

// Shared memory: [x, K halves (staged pairs)][partial sums KW x 32 fp32][PRE x KW x 32 16-byte weight slots]
// [scale/zero: KW x tpb (tiles a block, at most) x slots x (32 scales, 32 zeros) fp32].
__host__ __device__ inline size_t stream_smem(int64_t K, int pre, int tpb) {
  return static_cast<size_t>(K) * 2 + KW * 32 * 4 + static_cast<size_t>(pre) * KW * 32 * 16 +
         static_cast<size_t>(KW) * tpb * stream_slots(K) * 64 * 4;
}

template <int PRE, int R, bool EARLY>
__global__ void __launch_bounds__(32 * KW, 2) stream_gemv_kernel(const __half* __restrict__ x, int64_t K, int tiles,
                                                                int tpb, const Mats mats) {
  if (EARLY) exl_pdl::pdl_trigger();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int cpw = static_cast<int>(K / 32) / KW, c0 = warp * cpw, c1 = c0 + cpw;
  const int tb0 = static_cast<int>(static_cast<int64_t>(tiles) * blockIdx.x / gridDim.x);
  const int tb1 = static_cast<int>(static_cast<int64_t>(tiles) * (blockIdx.x + 1) / gridDim.x);
  const int J = (tb1 - tb0) * cpw;                           // this warp's chunks over the block's tiles
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* xs = reinterpret_cast<__half*>(smem_raw);
  float* red = reinterpret_cast<float*>(smem_raw + K * 2);
  int4* wsm = reinterpret_cast<int4*>(red + KW * 32) + warp * PRE * 32 + lane;   // slot u: wsm[32 u]
  const int slots = stream_slots(K), g0 = c0 >> 2, ng = ((c1 - 1) >> 2) - g0 + 1;
  float* szs = reinterpret_cast<float*>(reinterpret_cast<int4*>(red + KW * 32) + KW * PRE * 32) +
               static_cast<size_t>(warp) * tpb * slots * 64;   // [tile of the block][slot][scale 32 | zero 32]

  // The loads walk the warp's chunks in order: tile lt, chunk lc, lp = that chunk's words for this lane.
  int lt = tb0, lc = c0;
  auto words_at = [&](int tile, int c) {
    const Mat& m = mat_of_tile(mats, tile);
    int64_t col = static_cast<int64_t>(tile - m.tile0) * kTile + 4 * g;
    col = col < m.N ? col : m.N - 4;
    return m.qw.at(4 * c + t, col);
  };
  const int32_t* lp = words_at(lt, lc);
  int64_t lstep = 4 * mat_of_tile(mats, lt).qw.ldq;
  auto next_words = [&]() {
    const int4* p = reinterpret_cast<const int4*>(lp);
    if (++lc == c1) {
      lc = c0;
      if (++lt < tb1) {
        lp = words_at(lt, lc);
        lstep = 4 * mat_of_tile(mats, lt).qw.ldq;
      }
    } else {
      lp += lstep;
    }
    return p;
  };
#pragma unroll
  for (int u = 0; u < PRE; ++u)
    if (u < J) cp_async16(wsm + 32 * u, next_words());
  int4 ring[R];
#pragma unroll
  for (int i = 0; i < R; ++i) ring[i] = PRE + i < J ? __ldg(next_words()) : make_int4(0, 0, 0, 0);
  for (int tl = 0; tl < tb1 - tb0; ++tl) {                   // the warp's scale/zero rows of every tile (weights)
    const Mat& m = mat_of_tile(mats, tb0 + tl);
    for (int j = lane; j < ng * 16; j += 32) {
      const int s = j >> 4, half = (j >> 3) & 1, q = j & 7;
      int64_t cq = static_cast<int64_t>(tb0 + tl - m.tile0) * kTile + 4 * q;
      cq = cq < m.N ? cq : m.N - 4;
      cp_async16(szs + (tl * slots + s) * 64 + half * 32 + 4 * q,
                 (half ? m.zero : m.scale) + static_cast<int64_t>(g0 + s) * m.N + cq);
    }
  }

  exl_pdl::pdl_wait();                                       // x is the previous kernel's output
  if (!EARLY) exl_pdl::pdl_trigger();
  const int kw0 = c0 * 32, kwl = cpw * 32;
  for (int j = lane; j < (kwl >> 3); j += 32) cp_async16(xs + kw0 + 8 * j, x + kw0 + 8 * j);
  cp_async_wait_all();                                       // x, this lane's weight slots, scale/zero
  for (int j = lane; j < (kwl >> 3); j += 32) {
    uint4* p = reinterpret_cast<uint4*>(xs + kw0 + 8 * j);
    *p = stage_pairs<true>(*p);
  }
  __syncwarp();                                              // the slots other lanes copied

  float d[2][1][4], acc[2][1][4], dx[1][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) d[0][0][i] = d[1][0][i] = acc[0][0][i] = acc[1][0][i] = dx[0][i] = 0.f;
  float4 s4 = make_float4(0.f, 0.f, 0.f, 0.f), z4 = s4;
  const __half* xrow = xs + 8 * t;
  constexpr uint32_t kOnes = 0x3C003C00u, kZero = 0u;
  int ct = tb0, cc = c0, grp = -1;                           // the chunk being consumed
  auto finish_tile = [&]() {
    exl_kslice::flush_group16(s4, z4, dx, d, acc);
    grp = -1;
    store_partials<1>(acc, red + warp * kTile, kTile, 1, g, t);
    __syncthreads();
    if (threadIdx.x < kTile) {
      float a = 0.f;
#pragma unroll
      for (int w = 0; w < KW; ++w) a += red[w * kTile + threadIdx.x];
      const Mat& m = mat_of_tile(mats, ct);
      const int64_t n = static_cast<int64_t>(ct - m.tile0) * kTile + threadIdx.x;
      if (n < m.N) m.y[n] = __float2half(a);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[0][0][i] = acc[1][0][i] = 0.f;
  };
  auto consume = [&](const int4& w) {
    if (grp < 0 || (cc & 3) == 0) {                          // groups of 128 rows: 4 chunks
      if (grp >= 0) exl_kslice::flush_group16(s4, z4, dx, d, acc);
      grp = cc >> 2;
      const float* sz = szs + ((ct - tb0) * slots + grp - g0) * 64 + 4 * g;
      s4 = *reinterpret_cast<const float4*>(sz);
      z4 = *reinterpret_cast<const float4*>(sz + 32);
    }
    const uint4 v = *reinterpret_cast<const uint4*>(xrow + cc * 32);
    const uint32_t b[1][4] = {{v.x, v.y, v.z, v.w}};
    mma16816(dx[0], kOnes, kZero, kZero, kOnes, b[0][0], b[0][1]);
    mma16816(dx[0], kOnes, kZero, kZero, kOnes, b[0][2], b[0][3]);
    exl_kslice::chunk_mma_b<4, 1, true>(Raw{w, make_int4(0, 0, 0, 0)}, b, t, d);
    if (++cc == c1) {
      finish_tile();
      cc = c0;
      ++ct;
    }
  };

  int j = 0;
  for (; j < PRE && j < J; ++j) consume(wsm[32 * j]);
  for (; j + R <= J; j += R) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      consume(ring[i]);
      if (j + i + R < J) ring[i] = __ldg(next_words());
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i)
    if (j + i < J) consume(ring[i]);
}

}  // namespace exl_stream
