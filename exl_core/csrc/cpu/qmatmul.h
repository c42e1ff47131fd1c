// Shared declarations of the CPU matmul kernels (quantized `qmatmul` and `dense_matmul`).
//
// Every ISA variant (AVX-512, AVX2/FMA, scalar) compiles the same generic body (simd.h) in its
// own translation unit and namespace, so the per-(row, column) arithmetic is the same
// everywhere:  for each chunk c of 32 rows of K in order: p = 0; for k in the chunk in order:
// p = fma(x[m,k], w[k,n], p);  y = (c == 0 ? p : y + p);  finally y = y + bias.
// For quantized weights w is the raw integer q (as float) and the chunk's p is then scaled once:
// p = fma(p, scale, (-(zero*scale)) * xsum[m,c]) with xsum[m,c] = x[m, 32c..32c+31] summed in
// order (see simd.h).  That fixed order is what makes results bit-identical whatever M is,
// wherever a row sits, and whichever ISA runs.
#pragma once
#include <cstdint>

namespace exl_cpu {

// Columns are processed in panels of 32 (2 AVX-512 vectors); threads own whole panels.
constexpr int kPanel = 32;

// One entry per 32 rows of K (group sizes are multiples of 32, so a chunk never straddles
// two groups): bit width, group index, and the qweight row holding the chunk's first word.
struct ChunkInfo {
  int32_t bits;
  int32_t group;
  int64_t qrow;
};

struct QGemmArgs {
  const float* x;          // fp32 [M, K] (already permuted), row stride ldx
  int64_t ldx, M, K, N;
  const int32_t* qweight;  // [Q, N]
  const float* scale;      // [G, N]
  const float* zero;       // [G, N]
  const ChunkInfo* chunks; // [K / 32]
  const float* bias;       // fp32 [N] or nullptr
  float* y;                // fp32 [M, N], row stride ldy
  int64_t ldy;
  const float* xsum;       // [M, K / 32]: sum of x[m, 32c .. 32c+31] in order (chunk_sums)
  // zero holds one value per group ([G]) instead of [G, N]: every column of a group shares its
  // zero point (EXL2, symmetric GPTQ). The int8 kernel only, where [G, N] zeros of 32-row groups
  // are a sixth of the bytes a decode step streams.
  bool zero_per_group = false;
  // Panel-major weight (the int8 kernel only; N % kPanel == 0): qweight [N/kPanel, Q, kPanel], scale
  // (and a [G, N] zero) [N/kPanel, G, kPanel], so one thread's panels are one contiguous stream.
  bool panel_major = false;
  int64_t q_rows = 0;       // Q (panel-major only)
  int64_t n_groups = 0;     // G (panel-major only: the scale panels' row count)
};

// K == 0 (an empty reduction): columns [n0, n0 + ncols) of every row of y are the bias, or 0
// (Args: QGemmArgs or DenseGemmArgs, which share M, y, ldy and bias).
template <typename Args>
inline void write_empty_reduction(const Args& a, int64_t n0, int64_t ncols) {
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t n = n0; n < n0 + ncols; ++n) a.y[m * a.ldy + n] = a.bias ? a.bias[n] : 0.0f;
}

struct DenseGemmArgs {
  const float* x;          // fp32 [M, K], row stride ldx
  int64_t ldx, M, K, N;
  const void* w;           // [K, N] row-major, fp32 or bf16 (w_bf16)
  bool w_bf16;
  const float* bias;       // fp32 [N] or nullptr
  float* y;                // fp32 [M, N], row stride ldy
  int64_t ldy;
};

// Each computes the output columns of panels [p0, p1) (columns p0*32 .. min(p1*32, N)).
#define EXL_CPU_DECLARE_ISA(ns)                                                 \
  namespace ns {                                                                \
  void qgemm(const QGemmArgs& a, int64_t p0, int64_t p1);                        \
  void dense_gemm(const DenseGemmArgs& a, int64_t p0, int64_t p1);               \
  }
EXL_CPU_DECLARE_ISA(isa_avx512)
EXL_CPU_DECLARE_ISA(isa_avx2)
EXL_CPU_DECLARE_ISA(isa_scalar)
#undef EXL_CPU_DECLARE_ISA

// ISA levels: 2 = AVX-512 (F/BW/VL/DQ), 1 = AVX2+FMA, 0 = scalar. `cpu_isa_level()` is what the
// kernels use: the detected level, capped by `set_cpu_isa_cap` (tests force every path).
int cpu_isa_level();
int detected_cpu_isa_level();
int set_cpu_isa_cap(int cap);  // returns the previous cap

}  // namespace exl_cpu
