// AVX2 + FMA instance of the matmul kernels in simd.h (see qmatmul_avx512.cpp for the rules).
#include <immintrin.h>

#include <cstdint>
#include <utility>

#include "qmatmul.h"

#pragma GCC target("avx2,fma,bmi2")

namespace exl_cpu {
namespace isa_avx2 {

struct V {
  using f = __m256;
  using i = __m256i;
  static constexpr int W = 8;
  static constexpr int MRMAX = 2;  // 2 rows x 4 vectors = 8 of the 16 ymm registers
  static inline i lane_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static inline f zero() { return _mm256_setzero_ps(); }
  static inline f bcast(float v) { return _mm256_set1_ps(v); }
  static inline f load(const float* p) { return _mm256_loadu_ps(p); }
  static inline f loadn(const float* p, int n) {
    return n == W ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask(n));
  }
  static inline void store(float* p, f v) { _mm256_storeu_ps(p, v); }
  static inline void storen(float* p, f v, int n) {
    if (n == W) _mm256_storeu_ps(p, v); else _mm256_maskstore_ps(p, lane_mask(n), v);
  }
  static inline f fma(f a, f b, f c) { return _mm256_fmadd_ps(a, b, c); }
  static inline f add(f a, f b) { return _mm256_add_ps(a, b); }
  static inline f sub(f a, f b) { return _mm256_sub_ps(a, b); }
  static inline f mul(f a, f b) { return _mm256_mul_ps(a, b); }
  static inline i iloadn(const int32_t* p, int n) {
    return n == W ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                  : _mm256_maskload_epi32(p, lane_mask(n));
  }
  template <int S> static inline i srl(i v) { return S == 0 ? v : _mm256_srli_epi32(v, S); }
  template <int S> static inline i sll(i v) { return _mm256_slli_epi32(v, S); }
  static inline i and_(i a, i b) { return _mm256_and_si256(a, b); }
  static inline i or_(i a, i b) { return _mm256_or_si256(a, b); }
  static inline i iset(int32_t v) { return _mm256_set1_epi32(v); }
  static inline f cvt(i v) { return _mm256_cvtepi32_ps(v); }
  static inline f load_bf16n(const uint16_t* p, int n) {
    __m128i h;
    if (n == W) {
      h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    } else {  // no 16-bit masked load in AVX2: go through a zeroed buffer
      alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int j = 0; j < n; ++j) tmp[j] = p[j];
      h = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

#include "simd.h"

}  // namespace isa_avx2
}  // namespace exl_cpu
