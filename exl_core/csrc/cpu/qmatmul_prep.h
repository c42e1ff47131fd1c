// ATen-level helpers shared by the quantized matmul ops (qmatmul.cpp, qmatmul_int8.cpp) and
// usable by other C++ ops that call them: argument checks of one PackedWeight, x preparation
// and the split of output panels over threads.  Not included by the ISA translation units.
#pragma once
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "qmatmul.h"
#include "qmatmul_int8.h"

namespace exl_cpu {

void check_cpu(const at::Tensor& t, const char* name);

// Validates `groups` [G, 4] against K and qweight rows; returns one ChunkInfo per 32 rows of K.
std::vector<ChunkInfo> chunk_table(const at::Tensor& groups, int64_t K, int64_t q_rows);

// One weight's checked arguments and fp32 output y [M, N]; `a` points into `chunks` and the
// tensors kept here (a.x / a.xsum are left for the caller to set).
struct Prepared {
  std::vector<ChunkInfo> chunks;
  at::Tensor bias_f, y;
  QGemmArgs a;
};

// int8_forms: the int8 kernel's extra argument forms are accepted: zero [G], one zero point per
// group (QGemmArgs::zero_per_group), and panel-major weights (QGemmArgs::panel_major: qweight
// [N/32, Q, 32], scale and a [G, N]-shaped zero as [N/32, G, 32]; DecoderStack::set_panel_major).
Prepared prepare_weight(const std::string& who, int64_t M, int64_t K, const at::Tensor& qweight,
                        const at::Tensor& groups, const at::Tensor& scale, const at::Tensor& zero,
                        const std::optional<at::Tensor>& bias, bool int8_forms = false);

// The argument handling every quantized matmul op shares: x checked (CPU, 2-D) and its weights
// prepared, one (the single-weight ops) or a list (the *_multi ops: equal, non-empty lists; errors
// name "who weight i").
std::vector<Prepared> prepare_one(const std::string& who, const at::Tensor& x, const at::Tensor& qweight,
                                  const at::Tensor& groups, const at::Tensor& scale, const at::Tensor& zero,
                                  const std::optional<at::Tensor>& bias, bool int8_forms = false);
std::vector<Prepared> prepare_list(const std::string& who, const at::Tensor& x, at::TensorList qweight,
                                   at::TensorList groups, at::TensorList scale, at::TensorList zero,
                                   const c10::List<std::optional<at::Tensor>>& bias, bool int8_forms = false);

// Each weight's fp32 y in x's dtype (the ops' return value).
std::vector<at::Tensor> outputs_like(const at::Tensor& x, const std::vector<Prepared>& ws);

// x [M, K] (bf16 widened, permuted by `perm` when given) as contiguous fp32.
at::Tensor prepare_x(const std::string& who, const at::Tensor& x, const std::optional<at::Tensor>& perm);

// Calls fn(weight index, p0, p1) for the 32-column panels [p0, p1) of every weight, all
// weights in one parallel region (one thread fork for q/k/v).
void for_each_panel(const std::vector<Prepared>& ws,
                    const std::function<void(size_t w, int64_t p0, int64_t p1)>& fn);

}  // namespace exl_cpu

// ---- int8 activations (qmatmul_int8.h): the tensors behind an Int8X, for C++ callers -------
// From another C++ op (e.g. a fused decoder layer), with the PackedWeight tensors:
//   at::Tensor xf = exl_cpu::prepare_x(who, x, perm);           // fp32 [M, K], permuted
//   exl_cpu::Int8XTensors xq = exl_cpu::quantize_x_int8(xf);    // once per x
//   std::vector<exl_cpu::Prepared> ws;
//   ws.push_back(exl_cpu::prepare_weight(who, M, K, qweight, groups, scale, zero, bias));  // per weight
//   exl_cpu::qmatmul_int8_prepared(xq, ws);                     // ws[i].y = fp32 [M, N]
// (One thread fork for all of ws; call it from outside a parallel region.)

namespace exl_cpu {

struct Int8XTensors {
  at::Tensor xq, sx, qsum;  // int32 [3, M, K/32, 8], float [M, K/32], int32 [M, K/32]
  int64_t M = 0, K = 0;
  Int8X view() const;
};

// Quantizes fp32 x [M, K] (contiguous, already permuted: prepare_x's output) once; the result
// serves every weight that reads this x.
Int8XTensors quantize_x_int8(const at::Tensor& xf);

// Writes each prepared weight's y (fp32 [M, N]) with the int8-activation kernel, all weights
// in one parallel region.  ws[i].a.M and K must equal x's.
void qmatmul_int8_prepared(const Int8XTensors& x, std::vector<Prepared>& ws);

}  // namespace exl_cpu
