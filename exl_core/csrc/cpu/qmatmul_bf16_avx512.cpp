// AVX512_BF16 instance of the bf16-activation quantized matmul: `vdpbf16ps` adds two bf16
// products per fp32 lane.  Raw q values (< 256) are integers and exact in bf16, so only x is
// rounded; each 32-row chunk's sum over raw q is scaled in fp32 with the exact kernel's
// quant_partial (simd.h), whose xsum the caller takes over the ROUNDED x.  Per output the
// order is the exact kernel's (chunk partials from zero, folded into y in order, bias last),
// so rows stay batch invariant.  Same rules as qmatmul_avx512.cpp: nothing from torch or the
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
constexpr int MR = 3;                   // 3 rows x 4 vectors: 12 partials + 12 running y + 3 x + 1 weight (zmm)
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
// Each 32-row chunk's partial starts from zero, is scaled (quant_partial) and added to a
// running y held in registers for the whole block (y starts from 0 when `first`, else from
// memory); the bias goes on after the last chunk of K.  y touches memory once per block, not
// once per chunk: with 16 bf16 pairs per chunk the round trip cost as much as the products.
template <int R, int NV>
static EXL_ALWAYS_INLINE void micro(const QGemmArgs& a, const uint32_t* xw, int64_t m0, int64_t k0, int kc,
                                    const uint32_t* pairs, int64_t n0, int64_t ncols, bool first, bool last) {
  const int64_t ldx = a.K / 2, nch = a.K / 32;   // x as u32 pairs: row stride K/2
  const int64_t ps = static_cast<int64_t>(kc) / 2 * kPanel;   // pair-tile panel stride
  int nv[NV];
  for (int j = 0; j < NV; ++j) nv[j] = lanes_valid(ncols - j * V::W);
  __m512 y[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j)
      y[r][j] = first ? _mm512_setzero_ps() : V::loadn(a.y + (m0 + r) * a.ldy + n0 + j * V::W, nv[j]);
  for (int kk = 0; kk < kc; kk += 32) {
    __m512 acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
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
    const int64_t c = (k0 + kk) / 32;
    const ChunkInfo ch = a.chunks[c];
    const float* srow = a.scale + static_cast<int64_t>(ch.group) * a.N + n0;
    const float* zrow = a.zero + static_cast<int64_t>(ch.group) * a.N + n0;
    for (int j = 0; j < NV; ++j) {
      const __m512 s = V::loadn(srow + j * V::W, nv[j]), z = V::loadn(zrow + j * V::W, nv[j]);
      for (int r = 0; r < R; ++r) y[r][j] = V::add(y[r][j], quant_partial(acc[r][j], s, z, a.xsum[(m0 + r) * nch + c]));
    }
  }
  for (int j = 0; j < NV; ++j) {
    if (nv[j] == 0) continue;
    const __m512 bias = last && a.bias ? V::loadn(a.bias + n0 + j * V::W, nv[j]) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 o = last && a.bias ? V::add(y[r][j], bias) : y[r][j];
      V::storen(a.y + (m0 + r) * a.ldy + n0 + j * V::W, o, nv[j]);
    }
  }
}

template <int NV>
static void all_rows(const QGemmArgs& a, const uint32_t* xw, int64_t k0, int kc, const uint32_t* pairs,
                     int64_t n0, int64_t ncols, bool first, bool last) {
  int64_t m = 0;
  for (; m + MR <= a.M; m += MR) micro<MR, NV>(a, xw, m, k0, kc, pairs, n0, ncols, first, last);
  if (a.M - m == 2) micro<2, NV>(a, xw, m, k0, kc, pairs, n0, ncols, first, last);
  else if (a.M - m == 1) micro<1, NV>(a, xw, m, k0, kc, pairs, n0, ncols, first, last);
}

void qgemm_bf16(const QGemmArgs& a, const uint16_t* xb, int64_t p0, int64_t p1) {
  alignas(64) float tile[KC * NBP * kPanel];
  alignas(64) uint32_t pairs[KC / 2 * NBP * kPanel];
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(xb);  // K is a multiple of 32: pairs stay aligned
  const int64_t c0 = p0 * kPanel, c1 = p1 * kPanel < a.N ? p1 * kPanel : a.N;
  for (int64_t n0 = c0; n0 < c1; n0 += NBP * kPanel) {
    const int64_t ncols = n0 + NBP * kPanel <= c1 ? NBP * kPanel : c1 - n0;
    const int np = static_cast<int>((ncols + kPanel - 1) / kPanel);
    if (a.K == 0) {  // empty reduction: y = bias or 0
      for (int64_t m = 0; m < a.M; ++m)
        for (int64_t n = n0; n < n0 + ncols; ++n) a.y[m * a.ldy + n] = a.bias ? a.bias[n] : 0.0f;
      continue;
    }
    for (int64_t k0 = 0; k0 < a.K; k0 += KC) {
      const int kc = static_cast<int>(k0 + KC <= a.K ? KC : a.K - k0);
      fill_tile_quant(a, k0, kc, n0, np, tile);
      pack_pairs(tile, kc, np, pairs);
      const bool first = k0 == 0, last = k0 + kc >= a.K;
      if (np == 2) all_rows<4>(a, xw, k0, kc, pairs, n0, ncols, first, last);
      else all_rows<2>(a, xw, k0, kc, pairs, n0, ncols, first, last);
    }
  }
}

#undef EXL_ALWAYS_INLINE

}  // namespace isa_avx512bf16
}  // namespace exl_cpu
