// exl_core::dense_matmul: y = x @ w_t (+ bias) with w_t [K, N] pre-transposed, fp32 or bf16.
// Same generic kernel body as qmatmul (simd.h): the tile is a converted copy of w_t instead of
// a dequantised one, so the same batch-invariance guarantee holds.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "qmatmul.h"
#include "kernels.h"

namespace {

at::Tensor dense_matmul_cpu(const at::Tensor& x, const at::Tensor& w_t, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w_t.device().is_cpu(), "exl_core::dense_matmul: x and w_t must be CPU "
              "tensors, got ", x.device(), " and ", w_t.device());
  TORCH_CHECK(x.dim() == 2, "exl_core::dense_matmul: x must be 2-D [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "exl_core::dense_matmul: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), "exl_core::dense_matmul: x must be contiguous");
  TORCH_CHECK(w_t.dim() == 2 && w_t.size(0) == x.size(1),
              "exl_core::dense_matmul: w_t must be [K, N] with K = ", x.size(1), " (pre-transposed weight), got ",
              w_t.sizes());
  TORCH_CHECK(w_t.scalar_type() == at::kFloat || w_t.scalar_type() == at::kBFloat16,
              "exl_core::dense_matmul: w_t must be float32 or bfloat16, got ", w_t.scalar_type());
  TORCH_CHECK(w_t.is_contiguous(), "exl_core::dense_matmul: w_t must be contiguous (call .t().contiguous() once "
              "at load time)");
  const int64_t M = x.size(0), K = x.size(1), N = w_t.size(1);
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N &&
                    at::isFloatingType(bias->scalar_type()),
                "exl_core::dense_matmul: bias must be a floating CPU [", N, "] tensor, got ", bias->scalar_type(),
                " ", bias->sizes());
    bf = bias->to(at::kFloat).contiguous();
  }
  at::Tensor xf = (x.scalar_type() == at::kFloat ? x : x.to(at::kFloat)).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0 && N > 0) {
    exl_cpu::DenseGemmArgs a{xf.data_ptr<float>(), K, M, K, N, w_t.data_ptr(),
                             w_t.scalar_type() == at::kBFloat16, bf.defined() ? bf.data_ptr<float>() : nullptr,
                             y.data_ptr<float>(), N};
    const int level = exl_cpu::cpu_isa_level();
    const int64_t npanels = (N + exl_cpu::kPanel - 1) / exl_cpu::kPanel;
    at::parallel_for(0, npanels, 1, [&](int64_t p0, int64_t p1) {
      if (level >= 2) exl_cpu::isa_avx512::dense_gemm(a, p0, p1);
      else if (level == 1) exl_cpu::isa_avx2::dense_gemm(a, p0, p1);
      else exl_cpu::isa_scalar::dense_gemm(a, p0, p1);
    });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

namespace exl_cpu::ops {  // plain C++ entry point (kernels.h)
at::Tensor dense_matmul(const at::Tensor& x, const at::Tensor& w_t, const std::optional<at::Tensor>& bias) {
  return dense_matmul_cpu(x, w_t, bias);
}
}  // namespace exl_cpu::ops

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("dense_matmul(Tensor x, Tensor w_t, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl_core, CPU, m) { m.impl("dense_matmul", &dense_matmul_cpu); }
