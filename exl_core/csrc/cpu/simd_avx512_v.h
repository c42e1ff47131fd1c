// AVX-512 (F/BW/VL/DQ + FMA) vector trait `V` of the generic matmul body (simd.h), shared by
// every translation unit that instantiates simd.h for AVX-512 (qmatmul_avx512.cpp,
// qmatmul_bf16_avx512.cpp).  Include it inside the TU's own ISA namespace, after its
// `#pragma GCC target`.
struct V {
  using f = __m512;
  using i = __m512i;
  static constexpr int W = 16;
  static constexpr int MRMAX = 12;  // 12 rows x 2 vectors = 24 of the 32 zmm registers
  static inline __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static inline f zero() { return _mm512_setzero_ps(); }
  static inline f bcast(float v) { return _mm512_set1_ps(v); }
  static inline f load(const float* p) { return _mm512_loadu_ps(p); }
  static inline f loadn(const float* p, int n) {
    return n == W ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask(n), p);
  }
  static inline void store(float* p, f v) { _mm512_storeu_ps(p, v); }
  static inline void storen(float* p, f v, int n) {
    if (n == W) _mm512_storeu_ps(p, v); else _mm512_mask_storeu_ps(p, mask(n), v);
  }
  static inline f fma(f a, f b, f c) { return _mm512_fmadd_ps(a, b, c); }
  static inline f add(f a, f b) { return _mm512_add_ps(a, b); }
  static inline f sub(f a, f b) { return _mm512_sub_ps(a, b); }
  static inline f mul(f a, f b) { return _mm512_mul_ps(a, b); }
  static inline i iloadn(const int32_t* p, int n) {
    return n == W ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi32(mask(n), p);
  }
  template <int S> static inline i srl(i v) { return S == 0 ? v : _mm512_srli_epi32(v, S); }
  template <int S> static inline i sll(i v) { return _mm512_slli_epi32(v, S); }
  static inline i and_(i a, i b) { return _mm512_and_si512(a, b); }
  static inline i or_(i a, i b) { return _mm512_or_si512(a, b); }
  static inline i iset(int32_t v) { return _mm512_set1_epi32(v); }
  static inline f cvt(i v) { return _mm512_cvtepi32_ps(v); }
  static inline f load_bf16n(const uint16_t* p, int n) {
    const __m256i h = n == W ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                             : _mm256_maskz_loadu_epi16(mask(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};
