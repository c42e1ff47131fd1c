// Portable scalar instance of the matmul kernels in simd.h: same arithmetic (fmaf is correctly
// rounded like the vector FMA), so it gives bit-identical results, only slower.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "qmatmul.h"

namespace exl_cpu {
namespace isa_scalar {

struct V {
  using f = float;
  using i = uint32_t;
  static constexpr int W = 1;
  static constexpr int MRMAX = 1;
  static inline f zero() { return 0.0f; }
  static inline f bcast(float v) { return v; }
  static inline f load(const float* p) { return *p; }
  static inline f loadn(const float* p, int n) { return n ? *p : 0.0f; }
  static inline void store(float* p, f v) { *p = v; }
  static inline void storen(float* p, f v, int n) { if (n) *p = v; }
  static inline f fma(f a, f b, f c) { return std::fma(a, b, c); }
  static inline f add(f a, f b) { return a + b; }
  static inline f sub(f a, f b) { return a - b; }
  static inline f mul(f a, f b) { return a * b; }
  static inline i iloadn(const int32_t* p, int n) { return n ? static_cast<uint32_t>(*p) : 0u; }
  template <int S> static inline i srl(i v) { return v >> S; }
  template <int S> static inline i sll(i v) { return v << S; }
  static inline i and_(i a, i b) { return a & b; }
  static inline i or_(i a, i b) { return a | b; }
  static inline i iset(int32_t v) { return static_cast<uint32_t>(v); }
  static inline f cvt(i v) { return static_cast<float>(static_cast<int32_t>(v)); }
  static inline f load_bf16n(const uint16_t* p, int n) {
    const uint32_t bits = n ? static_cast<uint32_t>(*p) << 16 : 0u;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  }
};

#include "simd.h"

}  // namespace isa_scalar
}  // namespace exl_cpu
