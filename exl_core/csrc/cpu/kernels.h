// Plain C++ entry points of the CPU kernels: the very functions the exl_core::* torch ops run,
// for fused callers (decoder_layer.cpp) that chain kernels with no dispatcher in between.
// Each is defined at the end of its kernel's file and forwards to that file's op function,
// so both routes compute the same bits.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>

#include <optional>
#include <tuple>
#include <vector>

namespace exl_cpu::ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rms_norm_residual(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                        const at::Tensor& cos_sin);
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);
at::Tensor dense_matmul(const at::Tensor& x, const at::Tensor& w_t, const std::optional<at::Tensor>& bias);
at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& groups, const at::Tensor& scale,
                   const at::Tensor& zero, const std::optional<at::Tensor>& perm,
                   const std::optional<at::Tensor>& bias);
std::vector<at::Tensor> qmatmul_multi(const at::Tensor& x, at::TensorList qweight, at::TensorList groups,
                                      at::TensorList scale, at::TensorList zero,
                                      const std::optional<at::Tensor>& perm,
                                      const c10::List<std::optional<at::Tensor>>& bias);
// int8 activations (qmatmul_int8.cpp): same arguments as qmatmul / qmatmul_multi
at::Tensor qmatmul_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& groups,
                        const at::Tensor& scale, const at::Tensor& zero, const std::optional<at::Tensor>& perm,
                        const std::optional<at::Tensor>& bias);
std::vector<at::Tensor> qmatmul_int8_multi(const at::Tensor& x, at::TensorList qweight, at::TensorList groups,
                                           at::TensorList scale, at::TensorList zero,
                                           const std::optional<at::Tensor>& perm,
                                           const c10::List<std::optional<at::Tensor>>& bias);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                           const at::Tensor& seq_lens_k, double scale, int64_t window);

}  // namespace exl_cpu::ops
