// Int8-activation variant of the quantized matmul for small M (decode): x is quantized per row
// and per 32-row chunk of K to int8, the packed weights are unpacked to u8 in registers and the
// dot products run in integers (AVX-512 VNNI `vpdpbusd`, AVX2 `vpmaddubsw`, or scalar; all give
// the same integers and then the same fp32 arithmetic, so every ISA path is bit-identical).
//
// x quantization (per row m, chunk c of 32 values x_k, fp32 arithmetic, IEEE round-to-nearest):
//   amax = max_k |x_k|;  sx = amax / 127;  xq_k = round_half_even(x_k / sx)   (0 when amax == 0)
// Output, per column n and chunk c with weight w = (q - z) * s of the chunk's group:
//   t_c = fma(-(z*s), float(sum_k xq_k), float(sum_k xq_k * q_k) * s)      (int sums are exact)
//   y = fma(t_0, sx_0, 0); y = fma(t_c, sx_c, y) for c = 1, 2, ...; y = y + bias
// The only approximation against the exact fp32 path is xq * sx in place of x.
#pragma once
#include <cstdint>

#include "qmatmul.h"

namespace exl_cpu {

// x quantized for the kernel.  The 32 bytes of a chunk are stored three times, in the byte
// order each weight unpacking produces (so the kernel never shuffles bytes):
//   order 0 (natural; 8-bit and 3/5/6-bit): value k at byte k
//   order 1 (4-bit): word j's low nibbles are k = 8j+0,2,4,6, its high nibbles 8j+1,3,5,7
//   order 2 (2-bit): word j shifted by 2t holds k = 16j+t, 16j+4+t, 16j+8+t, 16j+12+t
struct Int8X {
  int64_t M, K;
  const int32_t* xq;    // [3, M, K/32, 8]: 4 int8 values per int32, see orders above
  const float* sx;      // [M, K/32] chunk scale
  const int32_t* qsum;  // [M, K/32] sum of the chunk's 32 int8 values
};

// x quantized, and the weight's fields of the exact kernel's arguments (w->x / w->xsum unused;
// w->M and w->K equal x's).
struct QGemmInt8Args {
  Int8X x;
  const QGemmArgs* w;
};

constexpr int kInt8Orders = 3;
// Which byte order (Int8X) a chunk of this bit width reads.
inline int int8_order(int bits) { return bits == 4 ? 1 : bits == 2 ? 2 : 0; }

// Fills xq, sx, qsum (sized as in Int8X) from fp32 x [M, K] (row stride ldx), K % 32 == 0.
void quantize_x_int8(const float* x, int64_t ldx, int64_t M, int64_t K, int32_t* xq, float* sx, int32_t* qsum);

// Output columns of panels [p0, p1) (kPanel columns each), with the ISA picked at run time
// (AVX-512 VNNI, else AVX2, else scalar; capped by set_cpu_isa_cap).
void qgemm_int8(const QGemmInt8Args& a, int64_t p0, int64_t p1);

// 2: AVX-512 VNNI, 1: AVX2, 0: scalar -- the path qgemm_int8 takes now.
int int8_isa_level();

#define EXL_CPU_DECLARE_INT8_ISA(ns) \
  namespace ns {                     \
  void qgemm_int8(const QGemmInt8Args& a, int64_t p0, int64_t p1); \
  }
EXL_CPU_DECLARE_INT8_ISA(isa_avx512vnni)
EXL_CPU_DECLARE_INT8_ISA(isa_avx2)
EXL_CPU_DECLARE_INT8_ISA(isa_scalar)
#undef EXL_CPU_DECLARE_INT8_ISA

}  // namespace exl_cpu
