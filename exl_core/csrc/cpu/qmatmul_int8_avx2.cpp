// AVX2 instance of the int8-activation matmul (qmatmul_int8_body.h).  `vpmaddubsw` multiplies
// u8 x s8 and adds pairs into saturating int16: exact for weights <= 63 (2 * 63 * 127 < 2^15);
// 8-bit weights are split into nibbles (two exact products, the high one weighted by 16), so
// the int32 sums equal the VNNI path's.  Same rules as qmatmul_avx2.cpp.
#include <immintrin.h>

#include <cstdint>
#include <utility>

#include "qmatmul_int8.h"

#pragma GCC target("avx2,fma")

namespace exl_cpu {
namespace isa_avx2 {

struct I8 {
  using i = __m256i;
  using f = __m256;
  static constexpr int W = 8;
  static constexpr int MRMAX = 2;  // 16 ymm registers: 2 rows x 2 vectors of accumulators
  static constexpr int NVMAX = 2;
  static inline i lane_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static inline i iload(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static inline i iloadn(const int32_t* p, int n) { return _mm256_maskload_epi32(p, lane_mask(n)); }
  template <int S> static inline i srl(i v) { return S == 0 ? v : _mm256_srli_epi32(v, S); }
  template <int S> static inline i sll(i v) { return _mm256_slli_epi32(v, S); }
  static inline i and_(i a, i b) { return _mm256_and_si256(a, b); }
  static inline i or_(i a, i b) { return _mm256_or_si256(a, b); }
  static inline i iset(int32_t v) { return _mm256_set1_epi32(v); }
  static inline i izero() { return _mm256_setzero_si256(); }
  static inline i bcast_i(int32_t v) { return _mm256_set1_epi32(v); }
  template <bool BIG> static inline i dot(i acc, i w, i x) {
    const i ones = _mm256_set1_epi16(1);
    if constexpr (!BIG) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
    const i nib = _mm256_set1_epi8(0x0F);
    const i lo = _mm256_maddubs_epi16(_mm256_and_si256(w, nib), x);
    const i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), nib), x);
    const i sum = _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, _mm256_set1_epi16(16)));
    return _mm256_add_epi32(acc, sum);
  }
  static inline f zero() { return _mm256_setzero_ps(); }
  static inline f bcast(float v) { return _mm256_set1_ps(v); }
  static inline f load(const float* p) { return _mm256_loadu_ps(p); }
  static inline f loadn(const float* p, int n) { return _mm256_maskload_ps(p, lane_mask(n)); }
  static inline void store(float* p, f v) { _mm256_storeu_ps(p, v); }
  static inline void storen(float* p, f v, int n) { _mm256_maskstore_ps(p, lane_mask(n), v); }
  static inline f mul(f a, f b) { return _mm256_mul_ps(a, b); }
  static inline f add(f a, f b) { return _mm256_add_ps(a, b); }
  static inline f fma(f a, f b, f c) { return _mm256_fmadd_ps(a, b, c); }
  static inline f fnmadd(f a, f b, f c) { return _mm256_fnmadd_ps(a, b, c); }
  static inline f cvt(i v) { return _mm256_cvtepi32_ps(v); }
};

#include "qmatmul_int8_body.h"

}  // namespace isa_avx2
}  // namespace exl_cpu
