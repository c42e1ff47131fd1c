// exl_core::qmatmul_int8 / qmatmul_int8_multi: the int8-activation variant of qmatmul for small
// M (see qmatmul_int8.h for the arithmetic).  This file quantizes x, picks the ISA instance and
// splits output columns over threads; argument checks are qmatmul's own (qmatmul_prep.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "qmatmul_int8.h"
#include "kernels.h"
#include "qmatmul_prep.h"

namespace exl_cpu {

static bool cpu_has_avx512_vnni() {
  static const bool has = [] {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
#else
    return false;
#endif
  }();
  return has;
}

int int8_isa_level() {
  const int level = cpu_isa_level();  // 2: AVX-512 F/BW/VL/DQ, 1: AVX2+FMA, 0: scalar
  if (level >= 2 && cpu_has_avx512_vnni()) return 2;
  return level >= 1 ? 1 : 0;          // AVX-512 without VNNI runs the AVX2 instance
}

void qgemm_int8(const QGemmInt8Args& a, int64_t p0, int64_t p1) {
  switch (int8_isa_level()) {
    case 2: isa_avx512vnni::qgemm_int8(a, p0, p1); break;
    case 1: isa_avx2::qgemm_int8(a, p0, p1); break;
    default: isa_scalar::qgemm_int8(a, p0, p1); break;
  }
}

void quantize_x_int8(const float* x, int64_t ldx, int64_t M, int64_t K, int32_t* xq, float* sx, int32_t* qsum) {
  const int64_t nch = K / 32;
  // byte b of group g (4 values per int32) reads value idx[order][4g + b] of the chunk
  static const auto idx = [] {
    std::array<std::array<int, 32>, kInt8Orders> t{};
    for (int g = 0; g < 8; ++g)
      for (int b = 0; b < 4; ++b) {
        t[0][4 * g + b] = 4 * g + b;
        t[1][4 * g + b] = 8 * (g / 2) + 2 * b + g % 2;
        t[2][4 * g + b] = 16 * (g / 4) + 4 * b + g % 4;
      }
    return t;
  }();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < nch; ++c) {
      const float* xc = x + m * ldx + c * 32;
      float amax = 0.0f;
      bool finite = true;
      for (int k = 0; k < 32; ++k) {
        finite = finite && std::isfinite(xc[k]);
        amax = std::fmax(amax, std::fabs(xc[k]));
      }
      int8_t q[32] = {};
      int32_t s = 0;
      float scale = 0.0f;
      if (!finite) {
        scale = NAN;  // y becomes NaN, as the exact path would give NaN/inf
      } else if (amax > 0.0f) {
        scale = amax / 127.0f;
        for (int k = 0; k < 32; ++k) {
          // |v| <= 127 (+ rounding): adding and removing 1.5 * 2^23 rounds half to even, as
          // torch.round does, without a libm call (x86-64 baseline has no roundps)
          const float v = xc[k] / scale;
          const float r = (v + 12582912.0f) - 12582912.0f;
          q[k] = static_cast<int8_t>(r);
          s += q[k];
        }
      }
      sx[m * nch + c] = scale;
      qsum[m * nch + c] = s;
      for (int o = 0; o < kInt8Orders; ++o) {
        int32_t* dst = xq + ((o * M + m) * nch + c) * 8;
        for (int g = 0; g < 8; ++g) {
          uint32_t word = 0;
          for (int b = 0; b < 4; ++b)
            word |= static_cast<uint32_t>(static_cast<uint8_t>(q[idx[o][4 * g + b]])) << (8 * b);
          dst[g] = static_cast<int32_t>(word);
        }
      }
    }
}

Int8X Int8XTensors::view() const {
  return Int8X{M, K, xq.data_ptr<int32_t>(), sx.data_ptr<float>(), qsum.data_ptr<int32_t>()};
}

Int8XTensors quantize_x_int8(const at::Tensor& xf) {
  TORCH_CHECK(xf.dim() == 2 && xf.scalar_type() == at::kFloat && xf.is_contiguous() && xf.size(1) % 32 == 0,
              "exl_cpu::quantize_x_int8: x must be a contiguous float32 [M, K] tensor with K % 32 == 0, got ",
              xf.scalar_type(), " ", xf.sizes());
  Int8XTensors t;
  t.M = xf.size(0);
  t.K = xf.size(1);
  const int64_t nch = t.K / 32;
  const auto i32 = xf.options().dtype(at::kInt);
  t.xq = at::empty({kInt8Orders, t.M, nch, 8}, i32);
  t.sx = at::empty({t.M, nch}, xf.options());
  t.qsum = at::empty({t.M, nch}, i32);
  quantize_x_int8(xf.data_ptr<float>(), t.K, t.M, t.K, t.xq.data_ptr<int32_t>(), t.sx.data_ptr<float>(),
                  t.qsum.data_ptr<int32_t>());
  return t;
}

void qmatmul_int8_prepared(const Int8XTensors& x, std::vector<Prepared>& ws) {
  std::vector<QGemmInt8Args> args;
  args.reserve(ws.size());
  const Int8X xv = x.view();
  for (const auto& w : ws) {
    TORCH_CHECK(w.a.M == x.M && w.a.K == x.K, "exl_cpu::qmatmul_int8_prepared: weight prepared for [", w.a.M,
                ", ", w.a.K, "], x is [", x.M, ", ", x.K, "]");
    args.push_back(QGemmInt8Args{xv, &w.a});
  }
  for_each_panel(ws, [&](size_t i, int64_t p0, int64_t p1) { qgemm_int8(args[i], p0, p1); });
}

}  // namespace exl_cpu

namespace {

std::vector<at::Tensor> int8_many(const std::string& who, const at::Tensor& x, std::vector<exl_cpu::Prepared>& ws,
                                  const std::optional<at::Tensor>& perm) {
  const at::Tensor xf = exl_cpu::prepare_x(who, x, perm);
  exl_cpu::qmatmul_int8_prepared(exl_cpu::quantize_x_int8(xf), ws);
  return exl_cpu::outputs_like(x, ws);
}

at::Tensor qmatmul_int8_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& groups,
                            const at::Tensor& scale, const at::Tensor& zero, const std::optional<at::Tensor>& perm,
                            const std::optional<at::Tensor>& bias) {
  const std::string who = "exl_core::qmatmul_int8";
  auto ws = exl_cpu::prepare_one(who, x, qweight, groups, scale, zero, bias, /*int8_forms=*/true);
  return int8_many(who, x, ws, perm)[0];
}

std::vector<at::Tensor> qmatmul_int8_multi_cpu(const at::Tensor& x, at::TensorList qweight, at::TensorList groups,
                                               at::TensorList scale, at::TensorList zero,
                                               const std::optional<at::Tensor>& perm,
                                               const c10::List<std::optional<at::Tensor>>& bias) {
  const std::string who = "exl_core::qmatmul_int8_multi";
  auto ws = exl_cpu::prepare_list(who, x, qweight, groups, scale, zero, bias, /*int8_forms=*/true);
  return int8_many(who, x, ws, perm);
}

int64_t qmatmul_int8_isa() { return exl_cpu::int8_isa_level(); }

}  // namespace

namespace exl_cpu::ops {  // plain C++ entry points (kernels.h)
at::Tensor qmatmul_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& groups,
                        const at::Tensor& scale, const at::Tensor& zero, const std::optional<at::Tensor>& perm,
                        const std::optional<at::Tensor>& bias) {
  return qmatmul_int8_cpu(x, qweight, groups, scale, zero, perm, bias);
}
std::vector<at::Tensor> qmatmul_int8_multi(const at::Tensor& x, at::TensorList qweight, at::TensorList groups,
                                           at::TensorList scale, at::TensorList zero,
                                           const std::optional<at::Tensor>& perm,
                                           const c10::List<std::optional<at::Tensor>>& bias) {
  return qmatmul_int8_multi_cpu(x, qweight, groups, scale, zero, perm, bias);
}
}  // namespace exl_cpu::ops

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("qmatmul_int8(Tensor x, Tensor qweight, Tensor groups, Tensor scale, Tensor zero, Tensor? perm, "
        "Tensor? bias) -> Tensor");
  m.def("qmatmul_int8_multi(Tensor x, Tensor[] qweight, Tensor[] groups, Tensor[] scale, Tensor[] zero, "
        "Tensor? perm, Tensor?[] bias) -> Tensor[]");
  m.def("qmatmul_int8_isa() -> int");
}

TORCH_LIBRARY_IMPL(exl_core, CPU, m) {
  m.impl("qmatmul_int8", &qmatmul_int8_cpu);
  m.impl("qmatmul_int8_multi", &qmatmul_int8_multi_cpu);
}

TORCH_LIBRARY_IMPL(exl_core, CompositeExplicitAutograd, m) { m.impl("qmatmul_int8_isa", &qmatmul_int8_isa); }
