// exl_core::qmatmul_bf16 / qmatmul_bf16_multi: the quantized matmul with x rounded to bf16
// (round to nearest even) and the weights exact, for prompt-sized calls that opt in
// (exl_core/ops/qmatmul.py, load_model(prefill="bf16")).  Same arguments and checks as
// exl_core::qmatmul (qmatmul_prep.h); the kernel is qmatmul_bf16_avx512.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "qmatmul_bf16.h"
#include "qmatmul_prep.h"

namespace exl_cpu {

bool bf16_dot_available() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return has && cpu_isa_level() >= 2;
#else
  return false;
#endif
}

}  // namespace exl_cpu

namespace {

using exl_cpu::Prepared;

// One pass over the rows of xf (fp32 [M, K], permuted), in parallel: xb = bf16(xf) rounded to
// nearest even, and per weight its group sums [M, G] of the ROUNDED values (each 32-value chunk
// summed in order, the chunks of a group added in order).  Serial, this preparation cost a third
// of the 2-thread matmul time at M = 512.
at::Tensor round_rows(const at::Tensor& xf, const std::vector<Prepared>& ws, std::vector<at::Tensor>& xsg) {
  const int64_t M = xf.size(0), K = xf.size(1), nch = K / 32;
  at::Tensor xb = at::empty({M, K}, xf.options().dtype(at::kBFloat16));
  for (const auto& w : ws) {
    const int64_t G = w.chunks.empty() ? 0 : w.chunks.back().group + 1;
    xsg.push_back(at::zeros({M, G}, xf.options()));
  }
  const float* src = xf.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> cs(nch);
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t c = 0; c < nch; ++c) {
        float acc = 0.0f;
        for (int k = 0; k < 32; ++k) {
          const c10::BFloat16 r(src[m * K + c * 32 + k]);   // round to nearest even, NaN kept
          dst[m * K + c * 32 + k] = r.x;
          acc = k == 0 ? static_cast<float>(r) : acc + static_cast<float>(r);
        }
        cs[c] = acc;
      }
      for (size_t i = 0; i < ws.size(); ++i) {
        const int64_t G = xsg[i].size(1);
        float* o = xsg[i].data_ptr<float>() + m * G;
        for (int64_t c = 0; c < nch; ++c) o[ws[i].chunks[c].group] += cs[c];
      }
    }
  });
  return xb;
}

std::vector<at::Tensor> qmatmul_bf16_many(const std::string& who, const at::Tensor& x, std::vector<Prepared>& ws,
                                          const std::optional<at::Tensor>& perm) {
  TORCH_CHECK(exl_cpu::bf16_dot_available(), who,
              ": needs AVX512_BF16 (vdpbf16ps), which this CPU lacks or the ISA cap hides; use exl_core::qmatmul");
  const at::Tensor xf = exl_cpu::prepare_x(who, x, perm);        // fp32 [M, K], permuted
  std::vector<at::Tensor> xsg;                                     // per weight [M, G]
  const at::Tensor xb = round_rows(xf, ws, xsg);                   // the rounding this op is about
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  std::vector<exl_cpu::Bf16X> bx;
  for (size_t i = 0; i < ws.size(); ++i) bx.push_back({xp, xsg[i].data_ptr<float>(), xsg[i].size(1)});
  exl_cpu::for_each_panel(ws, [&](size_t i, int64_t lo, int64_t hi) {
    exl_cpu::isa_avx512bf16::qgemm_bf16(ws[i].a, bx[i], lo, hi);
  });
  return exl_cpu::outputs_like(x, ws);
}

at::Tensor qmatmul_bf16_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& groups,
                            const at::Tensor& scale, const at::Tensor& zero, const std::optional<at::Tensor>& perm,
                            const std::optional<at::Tensor>& bias) {
  const std::string who = "exl_core::qmatmul_bf16";
  auto ws = exl_cpu::prepare_one(who, x, qweight, groups, scale, zero, bias);
  return qmatmul_bf16_many(who, x, ws, perm)[0];
}

std::vector<at::Tensor> qmatmul_bf16_multi_cpu(const at::Tensor& x, at::TensorList qweight, at::TensorList groups,
                                               at::TensorList scale, at::TensorList zero,
                                               const std::optional<at::Tensor>& perm,
                                               const c10::List<std::optional<at::Tensor>>& bias) {
  const std::string who = "exl_core::qmatmul_bf16_multi";
  auto ws = exl_cpu::prepare_list(who, x, qweight, groups, scale, zero, bias);
  return qmatmul_bf16_many(who, x, ws, perm);
}

bool qmatmul_bf16_supported() { return exl_cpu::bf16_dot_available(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("qmatmul_bf16(Tensor x, Tensor qweight, Tensor groups, Tensor scale, Tensor zero, Tensor? perm, "
        "Tensor? bias) -> Tensor");
  m.def("qmatmul_bf16_multi(Tensor x, Tensor[] qweight, Tensor[] groups, Tensor[] scale, Tensor[] zero, "
        "Tensor? perm, Tensor?[] bias) -> Tensor[]");
  m.def("qmatmul_bf16_supported() -> bool");
}

TORCH_LIBRARY_IMPL(exl_core, CPU, m) {
  m.impl("qmatmul_bf16", &qmatmul_bf16_cpu);
  m.impl("qmatmul_bf16_multi", &qmatmul_bf16_multi_cpu);
}

TORCH_LIBRARY_IMPL(exl_core, CompositeExplicitAutograd, m) {
  m.impl("qmatmul_bf16_supported", &qmatmul_bf16_supported);
}
