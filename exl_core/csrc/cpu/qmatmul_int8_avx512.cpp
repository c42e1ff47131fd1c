// AVX-512 VNNI instance of the int8-activation matmul (qmatmul_int8_body.h): `vpdpbusd` adds
// four u8 x s8 products per 32-bit lane in one instruction.  Same rules as qmatmul_avx512.cpp:
// nothing from torch or the standard library is instantiated after the target pragma.
#include <immintrin.h>

#include <cstdint>
#include <utility>

#include "qmatmul_int8.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")

namespace exl_cpu {
namespace isa_avx512vnni {

struct I8 {
  using i = __m512i;
  using f = __m512;
  static constexpr int W = 16;
  static constexpr int MRMAX = 4;  // 4 rows x 4 vectors = 16 int accumulators
  static constexpr int NVMAX = 4;
  static inline __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static inline i iload(const int32_t* p) { return _mm512_loadu_si512(p); }
  static inline i iloadn(const int32_t* p, int n) { return _mm512_maskz_loadu_epi32(mask(n), p); }
  template <int S> static inline i srl(i v) { return S == 0 ? v : _mm512_srli_epi32(v, S); }
  template <int S> static inline i sll(i v) { return _mm512_slli_epi32(v, S); }
  static inline i and_(i a, i b) { return _mm512_and_si512(a, b); }
  static inline i or_(i a, i b) { return _mm512_or_si512(a, b); }
  static inline i iset(int32_t v) { return _mm512_set1_epi32(v); }
  static inline i izero() { return _mm512_setzero_si512(); }
  static inline i bcast_i(int32_t v) { return _mm512_set1_epi32(v); }
  template <bool BIG> static inline i dot(i acc, i w, i x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static inline f zero() { return _mm512_setzero_ps(); }
  static inline f bcast(float v) { return _mm512_set1_ps(v); }
  static inline f load(const float* p) { return _mm512_loadu_ps(p); }
  static inline f loadn(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static inline void store(float* p, f v) { _mm512_storeu_ps(p, v); }
  static inline void storen(float* p, f v, int n) { _mm512_mask_storeu_ps(p, mask(n), v); }
  static inline f mul(f a, f b) { return _mm512_mul_ps(a, b); }
  static inline f add(f a, f b) { return _mm512_add_ps(a, b); }
  static inline f fma(f a, f b, f c) { return _mm512_fmadd_ps(a, b, c); }
  static inline f fnmadd(f a, f b, f c) { return _mm512_fnmadd_ps(a, b, c); }
  static inline f cvt(i v) { return _mm512_cvtepi32_ps(v); }
};

#include "qmatmul_int8_body.h"

}  // namespace isa_avx512vnni
}  // namespace exl_cpu
