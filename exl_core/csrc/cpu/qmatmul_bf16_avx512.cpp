// AVX512_BF16 instance of the bf16-activation quantized matmul: `vdpbf16ps` adds two bf16
// products per fp32 lane.  Raw q values (< 256) are integers and exact in bf16, so only x is
// rounded; sums over raw q are scaled in fp32 per group and the zero points enter through
// group sums of the ROUNDED x (see micro).  Per output the order depends only on K and the
// groups, never on M or the row's place: rows stay batch invariant.  Same rules as qmatmul_avx512.cpp: nothing from torch or the
// standard library is instantiated after the target pragma.
#include <immintrin.h>

#include <cstdint>
#include <utility>

#include "qmatmul_bf16.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,bmi2")

namespace exl_cpu {
namespace isa_avx512bf16 {

#include "simd_avx512_v.h"

#define EXL_SIMD_QUANT_TILE_ONLY  // unpacking (fill_tile_quant) and quant_partial only
#include "simd.h"
#undef EXL_SIMD_QUANT_TILE_ONLY

#define EXL_ALWAYS_INLINE inline __attribute__((always_inline))

constexpr int KC = 128;                 // K rows per tile (64 bf16 pairs)
constexpr int NBP = 2;                  // panels per tile: 64 columns
constexpr int MR = 6;                   // 6 rows x 4 vectors = 24 accumulators + 6 x + 1 weight (zmm)
static_assert(KC % 32 == 0 && VP == 2, "tile shape");

// Float tile of raw q [np][kc][32] (fill_tile_quant) -> pairs [np][kc/2][32] of u32: the low
// half holds row 2i, the high half row 2i+1, the lane order vdpbf16ps multiplies in.  q is a
// small integer, so dropping the low 16 bits of its fp32 pattern is exact.
static void pack_pairs(const float* tile, int kc, int np, uint32_t* pairs) {
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int p = 0; p < np; ++p)
    for (int i = 0; i < kc / 2; ++i)
      for (int v = 0; v < VP; ++v) {
        const float* e = tile + (static_cast<int64_t>(p) * kc + 2 * i) * kPanel + v * V::W;
        const __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(_mm512_load_ps(e)), 16);
        const __m512i hi = _mm512_and_si512(_mm512_castps_si512(_mm512_load_ps(e + kPanel)), hi_mask);
        _mm512_store_si512(pairs + (static_cast<int64_t>(p) * kc / 2 + i) * kPanel + v * V::W,
                           _mm512_or_si512(lo, hi));
      }
}

// y[m0 : m0+R, n0 : n0+ncols] for the K block k0 .. k0+kc, NV column vectors (np = NV/2 panels).
// Sums over raw q run across a group's chunks and are scaled once per group (or block end):
//   y = sum_g s_g * sum_{k in g} x_k q_k  +  sum_g (-(z_g s_g)) * xsum_g  +  bias
// the first term folded into y in memory as groups end (y = acc*s on the first fold of the
// first block, else fma(acc, s, y)); the zero-point term and the bias once, after the last block.
// Not the exact kernel's order (that one closes every 32-row chunk): with g128 this leaves one
// fold per block and keeps all 24 registers for products.
template <int R, int NV>
static EXL_ALWAYS_INLINE void micro(const QGemmArgs& a, const Bf16X& bx, int64_t m0, int64_t k0, int kc,
                                    const uint32_t* pairs, int64_t n0, int64_t ncols, bool first, bool last) {
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(bx.xb);   // K is a multiple of 32: pairs stay aligned
  const int64_t ldx = a.K / 2;                                     // x as u32 pairs: row stride K/2
  const int64_t ps = static_cast<int64_t>(kc) / 2 * kPanel;        // pair-tile panel stride
  int nv[NV];
  for (int j = 0; j < NV; ++j) nv[j] = lanes_valid(ncols - j * V::W);
  __m512 acc[R][NV];
  bool init = first;  // next fold writes y instead of adding to it
  auto fold = [&](int32_t g) {
    const float* srow = a.scale + static_cast<int64_t>(g) * a.N + n0;
    for (int j = 0; j < NV; ++j) {
      if (nv[j] == 0) continue;
      const __m512 s = V::loadn(srow + j * V::W, nv[j]);
      for (int r = 0; r < R; ++r) {
        float* yp = a.y + (m0 + r) * a.ldy + n0 + j * V::W;
        V::storen(yp, init ? V::mul(acc[r][j], s) : V::fma(acc[r][j], s, V::loadn(yp, nv[j])), nv[j]);
      }
    }
    init = false;
  };
  int32_t group = a.chunks[k0 / 32].group;
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int kk = 0; kk < kc; kk += 32) {
    const int32_t g = a.chunks[(k0 + kk) / 32].group;
    if (g != group) {
      fold(group);
      group = g;
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
    }
    for (int i = kk / 2; i < kk / 2 + 16; ++i) {
      // x pairs of all rows first, then each weight vector once for every row (loaded next to
      // its uses: GCC otherwise re-loads it per row)
      __m512bh xv[R];
      for (int r = 0; r < R; ++r)
        xv[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(xw[(m0 + r) * ldx + k0 / 2 + i]));
      for (int j = 0; j < NV; ++j) {
        const __m512bh b =
            (__m512bh)_mm512_load_si512(pairs + (j / VP) * ps + static_cast<int64_t>(i) * kPanel + (j % VP) * V::W);
        for (int r = 0; r < R; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv[r], b);
      }
    }
  }
  fold(group);
  if (!last) return;
  for (int j = 0; j < NV; ++j) {  // zero points of every group, then the bias
    if (nv[j] == 0) continue;
    __m512 o[R];
    for (int r = 0; r < R; ++r) o[r] = V::loadn(a.y + (m0 + r) * a.ldy + n0 + j * V::W, nv[j]);
    for (int64_t g = 0; g < bx.G; ++g) {
      const __m512 s = V::loadn(a.scale + g * a.N + n0 + j * V::W, nv[j]);
      const __m512 z = V::loadn(a.zero + g * a.N + n0 + j * V::W, nv[j]);
      const __m512 nzs = V::mul(V::sub(V::zero(), z), s);
      for (int r = 0; r < R; ++r) o[r] = V::fma(V::bcast(bx.xsum_g[(m0 + r) * bx.G + g]), nzs, o[r]);
    }
    if (a.bias) {
      const __m512 b = V::loadn(a.bias + n0 + j * V::W, nv[j]);
      for (int r = 0; r < R; ++r) o[r] = V::add(o[r], b);
    }
    for (int r = 0; r < R; ++r) V::storen(a.y + (m0 + r) * a.ldy + n0 + j * V::W, o[r], nv[j]);
  }
}

template <int NV>
static void all_rows(const QGemmArgs& a, const Bf16X& bx, int64_t k0, int kc, const uint32_t* pairs,
                     int64_t n0, int64_t ncols, bool first, bool last) {
  int64_t m = 0;
  for (; m + MR <= a.M; m += MR) micro<MR, NV>(a, bx, m, k0, kc, pairs, n0, ncols, first, last);
  switch (a.M - m) {
    case 1: micro<1, NV>(a, bx, m, k0, kc, pairs, n0, ncols, first, last); break;
    case 2: micro<2, NV>(a, bx, m, k0, kc, pairs, n0, ncols, first, last); break;
    case 3: micro<3, NV>(a, bx, m, k0, kc, pairs, n0, ncols, first, last); break;
    case 4: micro<4, NV>(a, bx, m, k0, kc, pairs, n0, ncols, first, last); break;
    case 5: micro<5, NV>(a, bx, m, k0, kc, pairs, n0, ncols, first, last); break;
    default: break;
  }
}

void qgemm_bf16(const QGemmArgs& a, const Bf16X& bx, int64_t p0, int64_t p1) {
  alignas(64) float tile[KC * NBP * kPanel];
  alignas(64) uint32_t pairs[KC / 2 * NBP * kPanel];
  const int64_t c0 = p0 * kPanel, c1 = p1 * kPanel < a.N ? p1 * kPanel : a.N;
  for (int64_t n0 = c0; n0 < c1; n0 += NBP * kPanel) {
    const int64_t ncols = n0 + NBP * kPanel <= c1 ? NBP * kPanel : c1 - n0;
    const int np = static_cast<int>((ncols + kPanel - 1) / kPanel);
    if (a.K == 0) {
      write_empty_reduction(a, n0, ncols);
      continue;
    }
    for (int64_t k0 = 0; k0 < a.K; k0 += KC) {
      const int kc = static_cast<int>(k0 + KC <= a.K ? KC : a.K - k0);
      fill_tile_quant(a, k0, kc, n0, np, tile);
      pack_pairs(tile, kc, np, pairs);
      const bool first = k0 == 0, last = k0 + kc >= a.K;
      if (np == 2) all_rows<4>(a, bx, k0, kc, pairs, n0, ncols, first, last);
      else all_rows<2>(a, bx, k0, kc, pairs, n0, ncols, first, last);
    }
  }
}

#undef EXL_ALWAYS_INLINE

}  // namespace isa_avx512bf16
}  // namespace exl_cpu
