// Shared helpers of the small CPU kernels (norm, rope, activation, attention).
//
// ISA choice happens at run time: vector helpers carry __attribute__((target(...))) and
// callers branch on cpu_isa(), so the baseline build runs on any x86-64. cpu_isa() can be
// capped (exl_core::cpu_isa_limit) so tests exercise every path on one machine.
//
// Every reduction here runs in a fixed order (fixed lanes, fixed tree) that depends only on
// the length of the row, never on how many rows share a call: batch invariance.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

namespace exl_cpu {

enum Isa : int { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

inline std::atomic<int> g_isa_limit{ISA_AVX512};

inline int detected_isa() {
  static const int isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return (int)ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return (int)ISA_AVX2;
    return (int)ISA_SCALAR;
  }();
  return isa;
}

inline int cpu_isa() { return std::min(detected_isa(), g_isa_limit.load(std::memory_order_relaxed)); }

// ---- scalar conversions (bf16 <-> fp32, round to nearest even like torch) ------------------
inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  uint32_t u = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <typename T> inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
template <> inline c10::BFloat16 from_f<c10::BFloat16>(float x) {
  return c10::BFloat16(x);  // c10 rounds to nearest even and keeps NaN
}

// ---- AVX-512 ---------------------------------------------------------------------------------
#define EXL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define EXL_AVX2 __attribute__((target("avx2,fma")))

EXL_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
EXL_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// Masked loads read nothing outside the mask (safe at the end of a row).
EXL_AVX512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
EXL_AVX512 inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 -> bf16 with round-to-nearest-even; NaN stays NaN (quiet).
EXL_AVX512 inline __m256i cvt_bf16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x00400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
EXL_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
EXL_AVX512 inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), cvt_bf16(v));
}
EXL_AVX512 inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
EXL_AVX512 inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, cvt_bf16(v));
}
// Round through the storage type (what torch does between two bf16 ops); identity for fp32.
EXL_AVX512 inline __m512 round_as(__m512 v, float*) { return v; }
EXL_AVX512 inline __m512 round_as(__m512 v, c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(cvt_bf16(v)), 16));
}

// exp(x) for fp32 lanes: Cody-Waite range reduction + degree-7 polynomial, ~1 ulp (degree 6
// left a one-sided truncation error of up to 1.3e-7 that sums of many terms accumulate).
// Lanes below -87.3 give exactly 0 (so -inf masks vanish), above 88.7 give +inf.
EXL_AVX512 inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.7f);
  __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  __mmask16 over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
  __m512 xc = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  // 2^n by building the exponent; n in [-126, 128] after the clamp. Split n to stay finite.
  __m512i ni = _mm512_cvtps_epi32(n);
  __m512i n1 = _mm512_srai_epi32(ni, 1);
  __m512i n2 = _mm512_sub_epi32(ni, n1);
  __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, _mm512_set1_epi32(127)), 23));
  __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, _mm512_set1_epi32(127)), 23));
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
  y = _mm512_mask_mov_ps(y, under, _mm512_setzero_ps());
  y = _mm512_mask_mov_ps(y, over, _mm512_set1_ps(INFINITY));
  return y;
}

// Fixed-tree horizontal sum / max of 16 lanes.
EXL_AVX512 inline float hsum16(__m512 v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}
EXL_AVX512 inline float hmax16(__m512 v) {
  __m256 a = _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_max_ps(b, _mm_movehl_ps(b, b));
  b = _mm_max_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

// ---- AVX2 ------------------------------------------------------------------------------------
EXL_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
EXL_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// fp32 -> bf16 (round to nearest even, NaN kept), 8 lanes.
EXL_AVX2 inline __m128i cvt_bf16_8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
  r = _mm256_srli_epi32(r, 16);
  // packus works per 128-bit half: [a0..a3 a0..a3 | b0..b3 b0..b3]; gather the halves' low words
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
EXL_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
EXL_AVX2 inline void store8(c10::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), cvt_bf16_8(v));
}
EXL_AVX2 inline __m256 round_as8(__m256 v, float*) { return v; }
EXL_AVX2 inline __m256 round_as8(__m256 v, c10::BFloat16*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(cvt_bf16_8(v)), 16));
}
EXL_AVX2 inline float hsum8(__m256 v) {
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

}  // namespace exl_cpu
