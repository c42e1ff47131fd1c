// Portable scalar instance of the int8-activation matmul (qmatmul_int8_body.h): one column per
// "vector", bytes multiplied one by one; std::fma is correctly rounded like the vector FMA, so
// results are bit-identical to the SIMD paths.
#include <cmath>
#include <cstdint>
#include <utility>

#include "qmatmul_int8.h"

namespace exl_cpu {
namespace isa_scalar {

struct I8 {
  using i = uint32_t;
  using f = float;
  static constexpr int W = 1;
  static constexpr int MRMAX = 1;
  static constexpr int NVMAX = 4;
  static inline i iload(const int32_t* p) { return static_cast<uint32_t>(*p); }
  static inline i iloadn(const int32_t* p, int n) { return n ? static_cast<uint32_t>(*p) : 0u; }
  template <int S> static inline i srl(i v) { return v >> S; }
  template <int S> static inline i sll(i v) { return v << S; }
  static inline i and_(i a, i b) { return a & b; }
  static inline i or_(i a, i b) { return a | b; }
  static inline i iset(int32_t v) { return static_cast<uint32_t>(v); }
  static inline i izero() { return 0u; }
  static inline i bcast_i(int32_t v) { return static_cast<uint32_t>(v); }
  template <bool BIG> static inline i dot(i acc, i w, i x) {
    int32_t s = static_cast<int32_t>(acc);
    for (int b = 0; b < 4; ++b)
      s += static_cast<int32_t>((w >> (8 * b)) & 0xFF) * static_cast<int32_t>(static_cast<int8_t>((x >> (8 * b)) & 0xFF));
    return static_cast<uint32_t>(s);
  }
  static inline f zero() { return 0.0f; }
  static inline f bcast(float v) { return v; }
  static inline f load(const float* p) { return *p; }
  static inline f loadn(const float* p, int n) { return n ? *p : 0.0f; }
  static inline void store(float* p, f v) { *p = v; }
  static inline void storen(float* p, f v, int n) { if (n) *p = v; }
  static inline f mul(f a, f b) { return a * b; }
  static inline f add(f a, f b) { return a + b; }
  static inline f fma(f a, f b, f c) { return std::fma(a, b, c); }
  static inline f fnmadd(f a, f b, f c) { return std::fma(-a, b, c); }
  static inline f cvt(i v) { return static_cast<float>(static_cast<int32_t>(v)); }
};

#include "qmatmul_int8_body.h"

}  // namespace isa_scalar
}  // namespace exl_cpu
