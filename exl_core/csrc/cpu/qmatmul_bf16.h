// bf16-activation variant of the quantized matmul (qmatmul_bf16.cpp, qmatmul_bf16_avx512.cpp):
// x rounded to bf16, weights exact.  Only an AVX512_BF16 instance exists; the op refuses on
// CPUs without it (exl_core::qmatmul_bf16_supported tells the dispatcher beforehand).
#pragma once
#include <cstdint>

#include "qmatmul.h"

namespace exl_cpu {

// True when the CPU has AVX512_BF16 and the ISA cap (set_cpu_isa_cap) allows AVX-512.
bool bf16_dot_available();

// The rounded activations as the kernel reads them (a.x and a.xsum are not read).
struct Bf16X {
  const uint16_t* xb;    // bf16 [M, K], permuted, row stride K
  const float* xsum_g;   // [M, G]: per group of the weight, its rows of the rounded x summed in order
  int64_t G;
};

namespace isa_avx512bf16 {
// Output columns of panels [p0, p1) (columns p0*32 .. min(p1*32, N)) of y = x @ W + bias.
void qgemm_bf16(const QGemmArgs& a, const Bf16X& x, int64_t p0, int64_t p1);
}  // namespace isa_avx512bf16

}  // namespace exl_cpu
