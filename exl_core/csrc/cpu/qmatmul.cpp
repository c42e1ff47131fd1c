// exl_core::qmatmul: fused dequantise-and-multiply over the PackedWeight layout
// (exl_core/formats/packed.py).  This file checks arguments, prepares x (bf16 -> fp32, input
// permutation), splits the output columns over threads and picks the ISA instance.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "qmatmul.h"
#include "kernels.h"
#include "qmatmul_prep.h"

namespace exl_cpu {

int detected_cpu_isa_level() {
  static const int level = [] {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("fma"))
      return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
  }();
  return level;
}

static std::atomic<int> g_isa_cap{2};

int cpu_isa_level() {
  const int d = detected_cpu_isa_level(), c = g_isa_cap.load();
  return d < c ? d : c;
}

int set_cpu_isa_cap(int cap) { return g_isa_cap.exchange(cap); }

// Argument checks, x preparation and the panel split, shared with qmatmul_int8.cpp
// (declared in qmatmul_prep.h).

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "exl_core::qmatmul: ", name, " must be a CPU tensor, got ", t.device());
}

// Validates `groups` against K and qweight rows; returns one ChunkInfo per 32 rows of K.
std::vector<ChunkInfo> chunk_table(const at::Tensor& groups, int64_t K, int64_t q_rows) {
  const int64_t G = groups.size(0);
  const int32_t* g = groups.data_ptr<int32_t>();
  std::vector<ChunkInfo> chunks;
  chunks.reserve(K / 32);
  int64_t expect_k = 0, expect_q = 0;
  for (int64_t i = 0; i < G; ++i) {
    const int32_t bits = g[4 * i], k_start = g[4 * i + 1], k_len = g[4 * i + 2], q_start = g[4 * i + 3];
    TORCH_CHECK(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8,
                "exl_core::qmatmul: groups[", i, "] has bit width ", bits, " (supported: 2,3,4,5,6,8)");
    TORCH_CHECK(k_start == expect_k && k_len > 0 && k_len % 32 == 0 && q_start == expect_q,
                "exl_core::qmatmul: groups[", i, "] = (bits ", bits, ", k_start ", k_start, ", k_len ", k_len,
                ", qrow ", q_start, ") breaks the layout: expected k_start ", expect_k, ", qrow ", expect_q,
                ", k_len a positive multiple of 32");
    for (int64_t c = 0; c < k_len / 32; ++c)
      chunks.push_back({bits, static_cast<int32_t>(i), q_start + c * bits});
    expect_k += k_len;
    expect_q += static_cast<int64_t>(k_len) * bits / 32;
  }
  TORCH_CHECK(expect_k == K, "exl_core::qmatmul: groups cover ", expect_k, " rows of K but x has K = ", K);
  TORCH_CHECK(expect_q == q_rows, "exl_core::qmatmul: groups need ", expect_q, " qweight rows, qweight has ",
              q_rows);
  return chunks;
}

Prepared prepare_weight(const std::string& who, int64_t M, int64_t K, const at::Tensor& qweight,
                        const at::Tensor& groups, const at::Tensor& scale, const at::Tensor& zero,
                        const std::optional<at::Tensor>& bias, bool int8_forms) {
  check_cpu(qweight, "qweight");
  check_cpu(groups, "groups");
  check_cpu(scale, "scale");
  check_cpu(zero, "zero");
  const bool panels = int8_forms && qweight.dim() == 3;
  TORCH_CHECK((qweight.dim() == 2 || (panels && qweight.size(2) == kPanel)) && qweight.scalar_type() == at::kInt &&
                  qweight.is_contiguous(),
              who, ": qweight must be a contiguous int32 [Q, N] tensor",
              int8_forms ? " (or panel-major [N/32, Q, 32])" : "", ", got ", qweight.scalar_type(), " ",
              qweight.sizes());
  TORCH_CHECK(groups.dim() == 2 && groups.size(1) == 4 && groups.scalar_type() == at::kInt && groups.is_contiguous(),
              who, ": groups must be a contiguous int32 [G, 4] tensor, got ", groups.scalar_type(), " ",
              groups.sizes());
  const int64_t N = panels ? qweight.size(0) * kPanel : qweight.size(1), G = groups.size(0);
  const int64_t Q = panels ? qweight.size(1) : qweight.size(0);
  const bool per_group = int8_forms && zero.dim() == 1;
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{scale, "scale"}, {zero, "zero"}}) {
    if (per_group && &t == &zero) {
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.size(0) == G, who,
                  ": a per-group zero must be a contiguous float32 [", G, "] tensor, got ", t.scalar_type(), " ",
                  t.sizes());
      continue;
    }
    const bool shaped = panels ? t.dim() == 3 && t.size(0) == N / kPanel && t.size(1) == G && t.size(2) == kPanel
                               : t.dim() == 2 && t.size(0) == G && t.size(1) == N;
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && shaped, who, ": ", name,
                " must be a contiguous float32 ",
                panels ? "[N/32, G, 32] = [" + std::to_string(N / kPanel) + ", " + std::to_string(G) + ", 32]"
                       : "[" + std::to_string(G) + ", " + std::to_string(N) + "]",
                " tensor", int8_forms && &t == &zero ? " (or [G] with one zero per group)" : "", ", got ",
                t.scalar_type(), " ", t.sizes());
  }
  Prepared p;
  p.chunks = chunk_table(groups, K, Q);
  if (bias.has_value()) {
    check_cpu(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && at::isFloatingType(bias->scalar_type()),
                who, ": bias must be a floating [", N, "] tensor, got ", bias->scalar_type(), " ", bias->sizes());
    p.bias_f = bias->to(at::kFloat).contiguous();
  }
  p.y = at::empty({M, N}, qweight.options().dtype(at::kFloat));
  p.a = exl_cpu::QGemmArgs{nullptr, K, M, K, N, qweight.data_ptr<int32_t>(), scale.data_ptr<float>(),
                           zero.data_ptr<float>(), p.chunks.data(),
                           p.bias_f.defined() ? p.bias_f.data_ptr<float>() : nullptr, p.y.data_ptr<float>(), N,
                           nullptr};
  p.a.zero_per_group = per_group;
  p.a.panel_major = panels;
  p.a.q_rows = Q;
  p.a.n_groups = G;
  return p;
}

// x [M, K] (bf16 widened, permuted) as contiguous fp32.
std::vector<Prepared> prepare_one(const std::string& who, const at::Tensor& x, const at::Tensor& qweight,
                                  const at::Tensor& groups, const at::Tensor& scale, const at::Tensor& zero,
                                  const std::optional<at::Tensor>& bias, bool int8_forms) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2, who, ": x must be 2-D [M, K], got ", x.sizes());
  std::vector<Prepared> ws;
  ws.push_back(prepare_weight(who, x.size(0), x.size(1), qweight, groups, scale, zero, bias, int8_forms));
  return ws;
}

std::vector<Prepared> prepare_list(const std::string& who, const at::Tensor& x, at::TensorList qweight,
                                   at::TensorList groups, at::TensorList scale, at::TensorList zero,
                                   const c10::List<std::optional<at::Tensor>>& bias, bool int8_forms) {
  const size_t n = qweight.size();
  TORCH_CHECK(n > 0 && groups.size() == n && scale.size() == n && zero.size() == n && bias.size() == n,
              who, ": qweight, groups, scale, zero, bias must be lists of one equal, non-zero length, got ", n,
              ", ", groups.size(), ", ", scale.size(), ", ", zero.size(), ", ", bias.size());
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2, who, ": x must be 2-D [M, K], got ", x.sizes());
  std::vector<Prepared> ws;
  ws.reserve(n);
  for (size_t i = 0; i < n; ++i)
    ws.push_back(prepare_weight(who + " weight " + std::to_string(i), x.size(0), x.size(1), qweight[i],
                                groups[i], scale[i], zero[i], bias.get(i), int8_forms));
  return ws;
}

std::vector<at::Tensor> outputs_like(const at::Tensor& x, const std::vector<Prepared>& ws) {
  std::vector<at::Tensor> out;
  for (const auto& w : ws) out.push_back(x.scalar_type() == at::kFloat ? w.y : w.y.to(x.scalar_type()));
  return out;
}

at::Tensor prepare_x(const std::string& who, const at::Tensor& x, const std::optional<at::Tensor>& perm) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2, who, ": x must be 2-D [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              who, ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), who, ": x must be contiguous");
  const int64_t K = x.size(1);
  at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  if (perm.has_value()) {
    const at::Tensor& p = *perm;
    check_cpu(p, "perm");
    TORCH_CHECK(p.dim() == 1 && p.size(0) == K && (p.scalar_type() == at::kLong || p.scalar_type() == at::kInt),
                who, ": perm must be an int64/int32 [", K, "] tensor, got ", p.scalar_type(), " ", p.sizes());
    xf = xf.index_select(1, p);  // x_perm = x[:, perm]; index_select checks the range
  }
  return xf.contiguous();
}

// xsum[m, c] = x[m, 32c] + x[m, 32c+1] + ... in this order (plain scalar adds, compiled once for
// every ISA path: the kernels' quantized partials depend on it bit for bit).
static at::Tensor chunk_sums(const at::Tensor& xf) {
  const int64_t M = xf.size(0), K = xf.size(1), nch = K / 32;
  at::Tensor out = at::empty({M, nch}, xf.options());
  const float* x = xf.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < nch; ++c) {
      const float* xc = x + m * K + c * 32;
      float acc = xc[0];
      for (int k = 1; k < 32; ++k) acc += xc[k];
      o[m * nch + c] = acc;
    }
  return out;
}

// All weights share x (and its permutation): one parallel region over the panels of every
// output, so small projections (q/k/v, gate/up) cost one thread fork, not one each.
void for_each_panel(const std::vector<Prepared>& ws,
                    const std::function<void(size_t w, int64_t p0, int64_t p1)>& fn) {
  std::vector<int64_t> first_panel{0};
  for (const auto& w : ws)
    first_panel.push_back(first_panel.back() + (w.a.M > 0 ? (w.a.N + kPanel - 1) / kPanel : 0));
  if (first_panel.back() == 0) return;
  at::parallel_for(0, first_panel.back(), 1, [&](int64_t p0, int64_t p1) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t lo = std::max(p0, first_panel[i]) - first_panel[i];
      const int64_t hi = std::min(p1, first_panel[i + 1]) - first_panel[i];
      if (lo < hi) fn(i, lo, hi);
    }
  });
}

}  // namespace exl_cpu

namespace {

using exl_cpu::Prepared;

std::vector<at::Tensor> qmatmul_many(const std::string& who, const at::Tensor& x, std::vector<Prepared>& ws,
                                     const std::optional<at::Tensor>& perm) {
  const at::Tensor xf = exl_cpu::prepare_x(who, x, perm);
  const at::Tensor xs = exl_cpu::chunk_sums(xf);
  for (auto& w : ws) {
    w.a.x = xf.data_ptr<float>();
    w.a.xsum = xs.data_ptr<float>();
  }
  const int level = exl_cpu::cpu_isa_level();
  exl_cpu::for_each_panel(ws, [&](size_t i, int64_t lo, int64_t hi) {
    if (level >= 2) exl_cpu::isa_avx512::qgemm(ws[i].a, lo, hi);
    else if (level == 1) exl_cpu::isa_avx2::qgemm(ws[i].a, lo, hi);
    else exl_cpu::isa_scalar::qgemm(ws[i].a, lo, hi);
  });
  return exl_cpu::outputs_like(x, ws);
}

at::Tensor qmatmul_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& groups,
                       const at::Tensor& scale, const at::Tensor& zero, const std::optional<at::Tensor>& perm,
                       const std::optional<at::Tensor>& bias) {
  const std::string who = "exl_core::qmatmul";
  auto ws = exl_cpu::prepare_one(who, x, qweight, groups, scale, zero, bias);
  return qmatmul_many(who, x, ws, perm)[0];
}

std::vector<at::Tensor> qmatmul_multi_cpu(const at::Tensor& x, at::TensorList qweight, at::TensorList groups,
                                          at::TensorList scale, at::TensorList zero,
                                          const std::optional<at::Tensor>& perm,
                                          const c10::List<std::optional<at::Tensor>>& bias) {
  const std::string who = "exl_core::qmatmul_multi";
  auto ws = exl_cpu::prepare_list(who, x, qweight, groups, scale, zero, bias);
  return qmatmul_many(who, x, ws, perm);
}

int64_t matmul_isa(int64_t cap) {
  // cap < 0: only report the active level; else cap the level (tests run every path).
  if (cap >= 0) exl_cpu::set_cpu_isa_cap(static_cast<int>(cap));
  return exl_cpu::cpu_isa_level();
}

}  // namespace

namespace exl_cpu::ops {  // plain C++ entry points (kernels.h)
at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& groups, const at::Tensor& scale,
                   const at::Tensor& zero, const std::optional<at::Tensor>& perm,
                   const std::optional<at::Tensor>& bias) {
  return qmatmul_cpu(x, qweight, groups, scale, zero, perm, bias);
}
std::vector<at::Tensor> qmatmul_multi(const at::Tensor& x, at::TensorList qweight, at::TensorList groups,
                                      at::TensorList scale, at::TensorList zero,
                                      const std::optional<at::Tensor>& perm,
                                      const c10::List<std::optional<at::Tensor>>& bias) {
  return qmatmul_multi_cpu(x, qweight, groups, scale, zero, perm, bias);
}
}  // namespace exl_cpu::ops

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("qmatmul(Tensor x, Tensor qweight, Tensor groups, Tensor scale, Tensor zero, Tensor? perm, "
        "Tensor? bias) -> Tensor");
  m.def("qmatmul_multi(Tensor x, Tensor[] qweight, Tensor[] groups, Tensor[] scale, Tensor[] zero, Tensor? perm, "
        "Tensor?[] bias) -> Tensor[]");
  m.def("matmul_isa(int cap=-1) -> int");
}

TORCH_LIBRARY_IMPL(exl_core, CPU, m) {
  m.impl("qmatmul", &qmatmul_cpu);
  m.impl("qmatmul_multi", &qmatmul_multi_cpu);
}

TORCH_LIBRARY_IMPL(exl_core, CompositeExplicitAutograd, m) { m.impl("matmul_isa", &matmul_isa); }
