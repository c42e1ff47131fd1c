// Device-side pieces shared by the tensor-core quantized GEMM kernels (qgemm_mma, qgemm_skinny, qgemm_kslice,
// qgemm_wide) that need no torch headers, so standalone probes (bench/wide_probe.cu) build them with plain nvcc:
// mma wrapper, packed-bits -> fp16 fragment pairs, the K order x is staged in, the per-lane word loads, cp.async,
// the multi-weight table and the split-K reduction over a thread-block cluster.  See qmatmul_cuda.cu for the chunk
// table (bits, group, first qweight row).  Host code with torch types: qmma_common.cuh.
#pragma once
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "act_device.cuh"
#include "cp_async_device.cuh"

namespace exl_mma {

constexpr int kMaxSplits = 8;   // portable cluster size

// Stages rows [0, rows) of x[:, perm[k0 .. k0 + L)] into xs [rows][xs_stride] fp16 in fragment order
// (the order the mma fragments read); rows >= M are zero-filled without
// loads.  Each thread takes 8 consecutive k at a time and issues all of its loads (one 16-byte load
// per row without perm, 8 independent gathers with perm) before its stores: the staging costs one or
// two memory latencies per block instead of one per element (the per-element loop was the kernels'
// fixed cost per call).  Lane t's mma k16 step j reads its pairs (q_p, q_p+4) of values 8t..8t+7 with
// p = 2j and 2j + 1: real k = 8a + 4b + 2j + c sits at slot 16j + 8c + 2a + b, so the pair (k, k + 4)
// is one 32-bit store.
__device__ __forceinline__ uint32_t half_bits(const uint4& v, int i) {
  const uint32_t w = i < 2 ? v.x : i < 4 ? v.y : i < 6 ? v.z : v.w;
  return (i & 1) ? (w >> 16) : (w & 0xFFFFu);
}

// The 8 values of row m, staged pairs (k, k + 4) -> slots 16j + 8c of dst (i = 2j + c).
__device__ __forceinline__ void store_frag8(uint32_t* dst, const uint4& v) {
#pragma unroll
  for (int i = 0; i < 4; ++i) dst[(16 * (i >> 1) + 8 * (i & 1)) >> 1] = half_bits(v, i) | half_bits(v, i + 4) << 16;
}

__device__ __forceinline__ void stage_x_frag(__half* xs, int xs_stride, const __half* __restrict__ x, int M, int rows,
                                             int64_t K, int64_t k0, int L, const int64_t* __restrict__ perm) {
  const unsigned short* __restrict__ xu = reinterpret_cast<const unsigned short*>(x);
  const bool vec = perm == nullptr && (reinterpret_cast<uintptr_t>(x) & 15) == 0 && (K & 7) == 0;
  const int rs = xs_stride >> 1;                               // row stride in 32-bit words
  for (int s = threadIdx.x; s < (L >> 3); s += blockDim.x) {
    const int64_t kk = k0 + (s << 3);
    uint32_t* dst = reinterpret_cast<uint32_t*>(xs + ((s << 3) & ~31) + 2 * (s & 3));
    if (vec) {
      constexpr int RB = 4;                                    // rows loaded before their stores
      for (int m0 = 0; m0 < rows; m0 += RB) {
        uint4 v[RB];
#pragma unroll
        for (int r = 0; r < RB; ++r)
          v[r] = m0 + r < M ? __ldg(reinterpret_cast<const uint4*>(x + (m0 + r) * K + kk)) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < RB; ++r)
          if (m0 + r < rows) store_frag8(dst + (m0 + r) * rs, v[r]);
      }
    } else {
      int src[8];                                              // K < 2^31
#pragma unroll
      for (int i = 0; i < 8; ++i) src[i] = static_cast<int>(perm ? __ldg(perm + kk + i) : kk + i);
      for (int m = 0; m < rows; ++m) {
        uint32_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (m < M) {
#pragma unroll
          for (int i = 0; i < 8; ++i) h[i] = __ldg(xu + m * K + src[i]);
        }
        store_frag8(dst + m * rs, make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16));
      }
    }
  }
}

// p itself, but opaque to the compiler: a pointer computed once stays in its registers instead of being re-derived
// from its expression before every use (ptxas does that under register pressure, in 64-bit arithmetic).
template <typename T>
__device__ __forceinline__ T* opaque_ptr(T* p) {
  asm volatile("" : "+l"(p));
  return p;
}

struct Raw {        // one chunk's words for a lane's 4 columns
  int4 lo, hi;
};

// Where word (row, col) of a packed weight lives: row-major [Q, N] (ldq = N, tstride = 128), or
// column-tiled [N/128, Q, 128] (ldq = 128, tstride = Q*128) so one 128-column strip is contiguous.
struct QPtr {
  const int32_t* q;
  int64_t ldq, tstride;
  __device__ __forceinline__ const int32_t* at(int64_t row, int64_t col) const {
    return q + (col >> 7) * tstride + row * ldq + (col & 127);
  }
};

// Words of chunk entry `tab` (bits, group, qrow) holding values 8t..8t+7 of columns col..col+3;
// `hi` only where those values straddle two words.
template <bool U4>
__device__ __forceinline__ void load_raw(Raw& r, bool exists, const int32_t* tab, const QPtr& qw, int64_t col,
                                         bool valid, int t) {
  if constexpr (U4) {
    r.lo = make_int4(0, 0, 0, 0);
    if (exists && valid) r.lo = __ldg(reinterpret_cast<const int4*>(qw.at(tab[2] + t, col)));
  } else {
    r.lo = r.hi = make_int4(0, 0, 0, 0);
    if (!exists || !valid) return;
    const int bits = tab[0], start = 8 * t * bits;
    const int32_t* p = qw.at(tab[2] + (start >> 5), col);
    r.lo = __ldg(reinterpret_cast<const int4*>(p));
    if ((start & 31) + 8 * bits > 32) r.hi = __ldg(reinterpret_cast<const int4*>(p + qw.ldq));
  }
}

// The words of chunk entry e (bits, group, qrow) holding a lane's values 8t..8t+7; `base` points at
// word (row 0, the lane's first column) and rows are `ldq` words apart.
// U4 (every chunk 4-bit, words in chunk order): chunk c's words are rows 4c..4c+3, no table read --
// the first loads of a launch do not wait for the table.
template <bool U4>
__device__ __forceinline__ void load_words(Raw& r, const int32_t* e, int c, const int32_t* base, int64_t ldq, int t) {
  if constexpr (U4) {
    r.lo = __ldg(reinterpret_cast<const int4*>(base + static_cast<int64_t>(4 * c + t) * ldq));
  } else {
    // 32-bit word offsets from `base` (build_mats checks every qweight has < 2^31 words): in 64 bits, with `base`
    // re-derived from the Mat, this address was ~37 of ~100 instructions a 4-bit chunk (SASS of qgemm_kslice's
    // mixed-width k8 ring-4 instance)
    const int bits = e[0], start = 8 * t * bits, ld = static_cast<int>(ldq);
    const int off = (e[2] + (start >> 5)) * ld;
    r.lo = __ldg(reinterpret_cast<const int4*>(base + off));
    r.hi = (start & 31) + 8 * bits > 32 ? __ldg(reinterpret_cast<const int4*>(base + (off + ld))) : make_int4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// (a & mask) | bits in one LOP3: written as C, the two constants cannot both be immediates of one LOP3, and
// ptxas emits an AND and an OR (SASS of qgemm_wide's loop: 32 of its ~118 instructions a chunk were these pairs).
template <uint32_t MASK, uint32_t BITS>
__device__ __forceinline__ uint32_t and_or(uint32_t a) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "n"(MASK), "n"(BITS));   // 0xEA: (a & b) | c
  return d;
}

// Pair p of a lane's 8 values as fp16x2 bits of (1024 + q_p, 1024 + q_p+4), exact for q < 1024.
template <int BITS>
__device__ __forceinline__ uint32_t pair_bits(uint32_t wl, uint32_t wh, int sh, int p) {
  constexpr uint32_t mask = (1u << BITS) - 1u;
  if constexpr (BITS == 4) {
    return and_or<0x000F000Fu, 0x64006400u>(wl >> (4 * p));   // 8 values in one word, sh == 0
  } else if constexpr (BITS * 8 <= 32) {                      // 2, 3 bits: 16 / 24-bit window
    const uint32_t w = __funnelshift_r(wl, wh, sh);
    return ((w >> (BITS * p)) & mask) | (((w >> (BITS * (p + 4))) & mask) << 16) | 0x64006400u;
  } else {                                                    // 5, 6, 8 bits: up to 64-bit window
    const uint64_t w = ((static_cast<uint64_t>(wh) << 32) | wl) >> sh;
    const uint32_t a = static_cast<uint32_t>(w >> (BITS * p)) & mask;
    const uint32_t b = static_cast<uint32_t>(w >> (BITS * (p + 4))) & mask;
    return a | (b << 16) | 0x64006400u;
  }
}

// Sum of one staged chunk (32 fp16 values) in fp32, in a fixed order.
__device__ __forceinline__ float chunk_x_sum(const __half* xc) {
  const __half2* p = reinterpret_cast<const __half2*>(xc);
  float a = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float2 f = __half22float2(p[i]);
    a += f.x + f.y;
  }
  return a;
}

__device__ __forceinline__ uint32_t comp(const int4& v, int i) {
  return static_cast<uint32_t>(i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w);
}
__device__ __forceinline__ float compf(const float4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// A fragments of one chunk for the lane: a[v][p] = pair p (pair_bits) of its values 8t..8t+7 of column 4g+v.
template <int BITS>
__device__ __forceinline__ void a_frags(const Raw& r, int t, uint32_t (&a)[4][4]) {
  const int sh = (8 * t * BITS) & 31;
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    const uint32_t wl = comp(r.lo, v), wh = comp(r.hi, v);
#pragma unroll
    for (int p = 0; p < 4; ++p) a[v][p] = pair_bits<BITS>(wl, wh, sh, p);
  }
}

// a_frags for a width known only at run time (2..8 bits): one code path for every width, ~5 instructions a pair
// against 2 for a_frags<4>.  With a_frags<B> for each of the six widths qgemm_kslice's mixed-width instances held
// 110-112 KB of code (58-60 KB for its 4-bit ones) and ran 4-bit words at 83.60-87.72 us a decode layer against
// 60.78 with only a_frags<4> compiled in; a loop per width (237-242 KB) stalled under ncu 2.16 cycles a issue
// waiting for instructions against 0.36 for the 4-bit kernel (bench/gemv_probe.cu, csrc/cuda/NOTES.md).
__device__ __forceinline__ void a_frags_rt(int bits, const Raw& r, int t, uint32_t (&a)[4][4]) {
  const uint32_t sh = static_cast<uint32_t>(8 * t * bits) & 31u, mask = (1u << bits) - 1u, mask_hi = mask << 16;
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    const uint32_t wl = comp(r.lo, v), wh = comp(r.hi, v);
    const uint32_t lo = __funnelshift_rc(wl, wh, sh), hi = __funnelshift_rc(wh, 0u, sh);   // values 0..7 from bit 0
    const uint32_t lo4 = __funnelshift_rc(lo, hi, 4 * bits), hi4 = __funnelshift_rc(hi, 0u, 4 * bits);   // 4..7
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint32_t q0 = __funnelshift_rc(lo, hi, bits * p), q4 = __funnelshift_rc(lo4, hi4, bits * p);
      a[v][p] = (q0 & mask) | ((q4 << 16) & mask_hi) | 0x64006400u;
    }
  }
}

// Mixed-width tables: 4-bit chunks (most of an EXL2 matrix near 4 bpw) by a_frags<4>, every other width by the one
// runtime path, so a kernel holds two extractions instead of six.
__device__ __forceinline__ void a_frags_any(int bits, const Raw& r, int t, uint32_t (&a)[4][4]) {
  if (bits == 4) a_frags<4>(r, t, a);
  else a_frags_rt(bits, r, t, a);
}

__device__ __forceinline__ uint32_t h2u(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 u2h(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// "Pairs 1 and 3 by 16" (qgemm_kslice's staged rows of uniform 4-bit weights): A's pairs 1 and 3 are fp16 1024 + 16 q
// instead of 1024 + q and the staged x of those pairs is divided by 16, so x * A keeps q * x and its offset becomes
// 1024 * (x / 16).  Pair 1 is then mask 0x00F000F0 of the word itself and pair 3 of the word >> 8: one shift a word
// instead of three.  x / 16 is exact but for fp16 subnormals.
__device__ __forceinline__ void a_frags16(const Raw& r, uint32_t (&a)[4][4]) {
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    const uint32_t w = comp(r.lo, v), w8 = w >> 8;
    a[v][0] = and_or<0x000F000Fu, 0x64006400u>(w);
    a[v][1] = and_or<0x00F000F0u, 0x64006400u>(w);
    a[v][2] = and_or<0x000F000Fu, 0x64006400u>(w8);
    a[v][3] = and_or<0x00F000F0u, 0x64006400u>(w8);
  }
}

// The lane's scaled A fragments of one chunk: a[v][p] = (q - z) * s of pair p of column 4g+v, in fp16.
// (BITS 0: the width `bits` at run time.)
// 4-bit words: a_frags16's pairs (1 and 3 as fp16 1024 + 16 q, exact), made q by one HSUB2 / one HFMA2 (x / 16 - 64,
// exact), so a word costs one shift instead of three; the result is the same bits as the shifts'.
template <int BITS>
__device__ __forceinline__ void scaled_a(const Raw& r, int t, const __half2 (&sh)[4], const __half2 (&zs)[4],
                                         uint32_t (&a)[4][4], int bits = BITS) {
  const __half2 k1024 = __float2half2_rn(1024.f);
  if constexpr (BITS == 4) {
    const __half2 k16th = __float2half2_rn(0.0625f), km64 = __float2half2_rn(-64.f);
    a_frags16(r, a);
#pragma unroll
    for (int v = 0; v < 4; ++v)
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const __half2 q = (p & 1) ? __hfma2(u2h(a[v][p]), k16th, km64) : __hsub2(u2h(a[v][p]), k1024);
        a[v][p] = h2u(__hfma2(q, sh[v], zs[v]));
      }
    return;
  }
  if constexpr (BITS > 0) a_frags<BITS>(r, t, a);
  else a_frags_any(bits, r, t, a);
#pragma unroll
  for (int v = 0; v < 4; ++v)
#pragma unroll
    for (int p = 0; p < 4; ++p) a[v][p] = h2u(__hfma2(__hsub2(u2h(a[v][p]), k1024), sh[v], zs[v]));
}

// scaled_a<4> for a main chunk r and its twin chunk's words tw (qgemm_wide's TWIN: formats/uniform4.py extra rows):
// a[v][p] = (r + 16 h - z) * s with h the twin's value, zs = -z * s for the combined zero.  r, h and r + 16 h are exact
// in fp16 (at most 255); three instructions a pair more than scaled_a<4>.
__device__ __forceinline__ void scaled_a_twin(const Raw& r, const int4& tw, const __half2 (&sh)[4],
                                              const __half2 (&zs)[4], uint32_t (&a)[4][4]) {
  const __half2 k1024 = __float2half2_rn(1024.f), k16 = __float2half2_rn(16.f);
  const __half2 k16th = __float2half2_rn(0.0625f), km64 = __float2half2_rn(-64.f);
  uint32_t h[4][4];
  a_frags16(r, a);
  a_frags16(Raw{tw, make_int4(0, 0, 0, 0)}, h);
#pragma unroll
  for (int v = 0; v < 4; ++v)
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      // pairs 0, 2: fp16 1024 + value; pairs 1, 3: 1024 + 16 value (a_frags16)
      const __half2 q = (p & 1) ? __hfma2(u2h(a[v][p]), k16th, km64) : __hsub2(u2h(a[v][p]), k1024);
      const __half2 hq = (p & 1) ? __hfma2(u2h(h[v][p]), k16th, km64) : __hsub2(u2h(h[v][p]), k1024);
      a[v][p] = h2u(__hfma2(__hfma2(hq, k16, q), sh[v], zs[v]));
    }
}

// s and -z*s of a lane's 4 columns as fp16 pairs (both halves alike), the operands scaled_a takes.
__device__ __forceinline__ void half_scales(const float4& s4, const float4& z4, __half2 (&sh)[4], __half2 (&zs)[4]) {
  const float sv[4] = {s4.x, s4.y, s4.z, s4.w}, zv[4] = {z4.x, z4.y, z4.z, z4.w};
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    sh[v] = __float2half2_rn(sv[v]);
    zs[v] = __float2half2_rn(-zv[v] * sv[v]);
  }
}

// f(u, nt, i) for each of a lane's accumulator elements [2][NT][4]: element (u, nt, i) is output column
// 4g + 2u + (i >> 1) (C row g -> column 4g+2u, row g+8 -> 4g+2u+1) and x row 8 nt + 2t + (i & 1).
template <int NT, typename F>
__device__ __forceinline__ void for_each_acc(F&& f) {
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) f(u, nt, i);
}

// acc += s * (d - (1024 + z) * xg) for the lane's 4 columns (s4/z4) and its x rows 2t, 2t+1 per n-tile.
template <int NT>
__device__ __forceinline__ void flush_group(const float4& s4, const float4& z4, float (&xg)[NT][2],
                                            float (&d)[2][NT][4], float (&acc)[2][NT][4]) {
  for_each_acc<NT>([&](int u, int nt, int i) {
    const int v = 2 * u + (i >> 1);
    acc[u][nt][i] = fmaf(compf(s4, v), fmaf(-1024.f - compf(z4, v), xg[nt][i & 1], d[u][nt][i]), acc[u][nt][i]);
    d[u][nt][i] = 0.f;
  });
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) xg[nt][0] = xg[nt][1] = 0.f;
}

// The lane's accumulators into a row-major partial tile: part[row * ld + column within the warp's 32], rows
// below M only.
template <int NT>
__device__ __forceinline__ void store_partials(const float (&acc)[2][NT][4], float* part, int ld, int M, int g, int t) {
  for_each_acc<NT>([&](int u, int nt, int i) {
    const int row = 8 * nt + 2 * t + (i & 1);
    if (row < M) part[row * ld + 4 * g + 2 * u + (i >> 1)] = acc[u][nt][i];
  });
}

// Several weights that read the same x (q/k/v, gate/up) run in one launch: the grid's x dimension
// walks the column tiles of matrix 0, then matrix 1, ...; every block serves one matrix.
constexpr int kMaxMats = 4;
struct Mat {
  QPtr qw;
  const int32_t* chunks;      // [K/32, 3]
  const float* scale;
  const float* zero;
  const int64_t* perm;        // or null
  const __half* bias;         // or null
  __half* y;                  // [M, N]
  int64_t N;
  int tile0;                  // first blockIdx.x of this matrix
  const __half* x;            // this matrix's own x (qgemm_kslice: x permuted for act-order), or null
};
// The residual add and the RMSNorm folded into the decode GEMMs (norm_fold_device.cuh; all zero: a plain GEMM).
struct NormFold {
  float* ss_out;              // producer (qgemm_kslice, one matrix): [tiles, M] per output tile and row, the sum of
                              // squares of the values stored, or null
  const float* ss_in;         // consumer: [ss_tiles, M], a producer's ss_out over x's columns
  const __half* nw;           // consumer: the RMSNorm weight [K] (null: x is staged as it is)
  int ss_tiles;
  float eps;
  int add;                    // producer: y += the product (y is the residual stream; one thread reads and writes
                              // each value)
};
struct Mats {
  Mat m[kMaxMats];
  int n;
  NormFold nf;
  // qgemm_wide_swiglu with tails (its TAILS instances): y's row stride ldy, and tails[c] >= 0 where the product's
  // 32-column chunk c is also stored at columns tails[c] .. + 31 (the down projection's extra rows read it again:
  // formats/uniform4.py); null / 0 elsewhere
  const int32_t* tails;
  int64_t ldy;
  // qgemm_wide's TWIN instances: per group of the main rows, its twin group (extra rows, formats/uniform4.py) or -1
  const int32_t* twins;
};

__device__ __forceinline__ const Mat& block_mat(const Mats& mats) {
  int mi = 0;
#pragma unroll
  for (int i = 1; i < kMaxMats; ++i)
    if (i < mats.n && static_cast<int>(blockIdx.x) >= mats.m[i].tile0) mi = i;
  return mats.m[mi];
}

// Sets tile0 of every matrix for tiles of `tile_n` columns; returns the total number of tiles.
inline int64_t assign_tiles(Mats& mats, int tile_n) {
  int64_t tiles = 0;
  for (int i = 0; i < mats.n; ++i) {
    mats.m[i].tile0 = static_cast<int>(tiles);
    tiles += (mats.m[i].N + tile_n - 1) / tile_n;
  }
  return tiles;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// out[w] = the sum over the cluster's S ranks, in rank order, of float4 piece idx[w] of each rank's `red` (zeros,
// nothing read, where !ok[w]); every remote read is in flight before the adds.
template <int W>
__device__ __forceinline__ void rank_sums(cooperative_groups::cluster_group& cluster, float* red, int S,
                                          const int (&idx)[W], const bool (&ok)[W], float4 (&out)[W]) {
  float4 v[W][kMaxSplits];
#pragma unroll
  for (int q = 0; q < kMaxSplits; ++q) {
    const float4* r = reinterpret_cast<const float4*>(cluster.map_shared_rank(red, q < S ? q : 0));
#pragma unroll
    for (int w = 0; w < W; ++w) v[w][q] = q < S && ok[w] ? r[idx[w]] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int w = 0; w < W; ++w) {
    float4 a = v[w][0];
#pragma unroll
    for (int q = 1; q < kMaxSplits; ++q) {
      a.x += v[w][q].x;
      a.y += v[w][q].y;
      a.z += v[w][q].z;
      a.w += v[w][q].w;
    }
    out[w] = a;
  }
}

// A split-K epilogue's cluster part: once every block's `red` is final (cluster.sync), body(cluster, rank, S *
// nthreads) reads the ranks' partials; then `red` is kept alive until every rank's reads are done (their values are
// used already, so no ordering is needed).
template <typename Body>
__device__ __forceinline__ void over_cluster(int S, int nthreads, Body&& body) {
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  cluster.sync();
  body(cluster, static_cast<int>(cluster.block_rank()), S * nthreads);
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}
#endif

// red [E] holds this block's partial tile (E = rows * tile_n, row-major over tile_n columns, 16-byte aligned); the
// gridDim.y blocks of a column tile (one cluster on sm_90) add theirs in rank order and write y (+ bias) once:
// deterministic, no atomics.  Every thread of the block must call this.  Four columns a thread at a time (tile_n %
// 4 == 0 and N % 4 == 0, so a piece is all in range or all out): a 16-byte read per rank and an 8-byte store, a
// quarter of the remote round trips of one float at a time.
// row_scale (qgemm_wide with the norm folded in, norm_fold_device.cuh): row m's sums times row_scale[m], before the bias.
__device__ __forceinline__ void cluster_store(float* red, int E, int tile_n, int nthreads, int64_t tile,
                                              const Mat& mat, const float* row_scale = nullptr) {
  const int64_t N = mat.N;
  auto store4 = [&](int idx, float4 a) {                      // idx: the piece's first element
    const int m = idx / tile_n;
    const int64_t n = tile * tile_n + idx % tile_n;
    if (n < N) {
      if (row_scale != nullptr) {
        const float r = row_scale[m];
        a.x *= r;
        a.y *= r;
        a.z *= r;
        a.w *= r;
      }
      if (mat.bias) {
        a.x += __half2float(mat.bias[n]);
        a.y += __half2float(mat.bias[n + 1]);
        a.z += __half2float(mat.bias[n + 2]);
        a.w += __half2float(mat.bias[n + 3]);
      }
      const __half2 lo = __floats2half2_rn(a.x, a.y), hi = __floats2half2_rn(a.z, a.w);
      *reinterpret_cast<uint2*>(mat.y + m * N + n) = make_uint2(h2u(lo), h2u(hi));
    }
  };
  const int S = gridDim.y, E4 = E / 4;
  if (S == 1) {
    __syncthreads();
    for (int i = threadIdx.x; i < E4; i += nthreads) store4(4 * i, reinterpret_cast<const float4*>(red)[i]);
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  over_cluster(S, nthreads, [&](cooperative_groups::cluster_group& cluster, int rank, int step) {
    // two pieces an iteration, every remote read of both in flight before the sums (at 32 rows of 128 columns a
    // thread has at most 4 pieces: the loop's latency is 1-2 round trips)
    for (int i = rank * nthreads + threadIdx.x; i < E4; i += 2 * step) {
      const bool two = i + step < E4;
      const int idx[2] = {i, i + step};
      const bool ok[2] = {true, two};
      float4 a[2];
      rank_sums<2>(cluster, red, S, idx, ok, a);
      store4(4 * i, a[0]);
      if (two) store4(4 * (i + step), a[1]);
    }
  });
#endif
}

// cluster_store for qgemm_wide_swiglu: red [M][tile_n] holds the gate's tile_n / 2 columns of this tile, then the up's
// same columns; mg.y [M, N] gets silu(gate) * up rounded as the unfused launches round it -- each sum (+ bias) to
// fp16 as cluster_store stores it, then exl_act::silu_mul -- from the same rank-order sums: the same bits.
template <bool TAILS = false>
__device__ __forceinline__ void cluster_store_swiglu(float* red, int M, int tile_n, int nthreads, int64_t tile,
                                                     const Mat& mg, const Mat& mu, const int32_t* tails = nullptr,
                                                     int64_t ldy = 0) {
  const int64_t N = mg.N, ld = TAILS ? ldy : N;
  const int hw4 = tile_n / 8, P = M * hw4;                    // 4-column pieces of a row's half, of all rows
  auto store = [&](int p, float4 gs, float4 us) {
    const int m = p / hw4, c = 4 * (p % hw4);
    const int64_t n = tile * (tile_n / 2) + c;
    if (n >= N) return;
    float ga[4] = {gs.x, gs.y, gs.z, gs.w}, ua[4] = {us.x, us.y, us.z, us.w};
    __half o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (mg.bias) ga[e] += __half2float(mg.bias[n + e]);
      if (mu.bias) ua[e] += __half2float(mu.bias[n + e]);
      o[e] = exl_act::silu_mul<__half>(__float2half_rn(ga[e]), __float2half_rn(ua[e]));
    }
    *reinterpret_cast<uint2*>(mg.y + m * ld + n) = *reinterpret_cast<const uint2*>(o);
    if constexpr (TAILS) {                                     // a piece of 4 columns lies within one chunk
      const int d = __ldg(tails + (n >> 5));
      if (d >= 0) *reinterpret_cast<uint2*>(mg.y + m * ld + d + (n & 31)) = *reinterpret_cast<const uint2*>(o);
    }
  };
  auto gate4 = [&](int p) { return (p / hw4) * (tile_n / 4) + p % hw4; };   // float4 index of piece p's gate part
  const int S = gridDim.y;
  if (S == 1) {
    __syncthreads();
    const float4* r4 = reinterpret_cast<const float4*>(red);
    for (int p = threadIdx.x; p < P; p += nthreads) store(p, r4[gate4(p)], r4[gate4(p) + hw4]);
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  over_cluster(S, nthreads, [&](cooperative_groups::cluster_group& cluster, int rank, int step) {
    for (int p = rank * nthreads + threadIdx.x; p < P; p += step) {
      const int idx[2] = {gate4(p), gate4(p) + hw4};
      const bool ok[2] = {true, true};
      float4 a[2];
      rank_sums<2>(cluster, red, S, idx, ok, a);
      store(p, a[0], a[1]);
    }
  });
#endif
}

// d[u][nt] += A(tile u of the chunk: a from a_frags, raw or scaled) x B(n-tile nt), both k16 steps of the chunk:
// one A fragment serves every n-tile.
template <int NT>
__device__ __forceinline__ void mma_chunk(const uint32_t (&a)[4][4], const uint32_t (&b)[NT][4], float (&d)[2][NT][4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        mma16816(d[u][nt], a[2 * u][2 * j], a[2 * u + 1][2 * j], a[2 * u][2 * j + 1], a[2 * u + 1][2 * j + 1],
                 b[nt][2 * j], b[nt][2 * j + 1]);
}

// Lane t's B fragments from its 8 values x[8t..8t+7] of a chunk: pair p = (x_p, x_p+4), the order a_frags gives
// the weights.
__device__ __forceinline__ void b_pairs(const uint4& v, uint32_t (&b)[4]) {
  b[0] = __byte_perm(v.x, v.z, 0x5410);
  b[1] = __byte_perm(v.x, v.z, 0x7632);
  b[2] = __byte_perm(v.y, v.w, 0x5410);
  b[3] = __byte_perm(v.y, v.w, 0x7632);
}

// 8 staged values x0..x7 (one 16-byte piece of a row) in b_pairs' order, stored so the loop reads a lane's B words
// with one shared load; BY16: pairs 1 and 3 divided by 16 (a_frags16).  pairs_slot / pairs_value: where value j of
// the piece lands (halves) and what is stored there.
template <bool BY16>
__device__ __forceinline__ uint4 stage_pairs(const uint4& v) {
  uint32_t b[4];
  b_pairs(v, b);
  if constexpr (BY16) {
    const __half2 k16th = __float2half2_rn(0.0625f);
    return make_uint4(b[0], h2u(__hmul2(u2h(b[1]), k16th)), b[2], h2u(__hmul2(u2h(b[3]), k16th)));
  } else {
    return make_uint4(b[0], b[1], b[2], b[3]);
  }
}
__device__ __forceinline__ int pairs_slot(int j) { return 2 * (j & 3) + (j >> 2); }
template <bool BY16>
__device__ __forceinline__ unsigned short pairs_value(int j, unsigned short h) {
  return BY16 && (j & 1) ? __half_as_ushort(__hmul(__ushort_as_half(h), __float2half_rn(0.0625f))) : h;
}

// Launch configuration for grid (tiles, S), clusters (1, S, 1) when S > 1; `attr` must outlive it.
inline cudaLaunchConfig_t split_config(int64_t tiles, int S, int threads, size_t smem, cudaStream_t stream,
                                       cudaLaunchAttribute (&attr)[1]) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(S), 1);
  cfg.blockDim = dim3(threads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = static_cast<unsigned>(S);
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = S > 1 ? 1 : 0;
  return cfg;
}

}  // namespace exl_mma
