// exl_core::qmatmul: fused dequantise-and-multiply over the PackedWeight layout
// (exl_core/formats/packed.py).  This file checks arguments, prepares x (bf16 -> fp32, input
// permutation), splits the output columns over threads and picks the ISA instance.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

#include "qmatmul.h"

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

// Threads own contiguous ranges of 32-column panels; results never depend on the split.
template <typename Fn>
void for_panels(int64_t N, Fn&& fn) {
  const int64_t npanels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, npanels, 1, [&](int64_t p0, int64_t p1) { fn(p0, p1); });
}

}  // namespace exl_cpu

namespace {

using exl_cpu::ChunkInfo;

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

at::Tensor qmatmul_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& groups,
                       const at::Tensor& scale, const at::Tensor& zero, const std::optional<at::Tensor>& perm,
                       const std::optional<at::Tensor>& bias) {
  check_cpu(x, "x");
  check_cpu(qweight, "qweight");
  check_cpu(groups, "groups");
  check_cpu(scale, "scale");
  check_cpu(zero, "zero");
  TORCH_CHECK(x.dim() == 2, "exl_core::qmatmul: x must be 2-D [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "exl_core::qmatmul: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), "exl_core::qmatmul: x must be contiguous");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kInt && qweight.is_contiguous(),
              "exl_core::qmatmul: qweight must be a contiguous int32 [Q, N] tensor, got ", qweight.scalar_type(),
              " ", qweight.sizes());
  TORCH_CHECK(groups.dim() == 2 && groups.size(1) == 4 && groups.scalar_type() == at::kInt && groups.is_contiguous(),
              "exl_core::qmatmul: groups must be a contiguous int32 [G, 4] tensor, got ", groups.scalar_type(), " ",
              groups.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(1), G = groups.size(0);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{scale, "scale"}, {zero, "zero"}}) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == G &&
                    t.size(1) == N,
                "exl_core::qmatmul: ", name, " must be a contiguous float32 [", G, ", ", N, "] tensor, got ",
                t.scalar_type(), " ", t.sizes());
  }
  std::vector<ChunkInfo> chunks = chunk_table(groups, K, qweight.size(0));

  at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  if (perm.has_value()) {
    const at::Tensor& p = *perm;
    check_cpu(p, "perm");
    TORCH_CHECK(p.dim() == 1 && p.size(0) == K && (p.scalar_type() == at::kLong || p.scalar_type() == at::kInt),
                "exl_core::qmatmul: perm must be an int64/int32 [", K, "] tensor, got ", p.scalar_type(), " ",
                p.sizes());
    xf = xf.index_select(1, p);  // x_perm = x[:, perm]; index_select checks the range
  }
  xf = xf.contiguous();
  at::Tensor bf;
  if (bias.has_value()) {
    check_cpu(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && at::isFloatingType(bias->scalar_type()),
                "exl_core::qmatmul: bias must be a floating [", N, "] tensor, got ", bias->scalar_type(), " ",
                bias->sizes());
    bf = bias->to(at::kFloat).contiguous();
  }

  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0 && N > 0) {
    exl_cpu::QGemmArgs a{xf.data_ptr<float>(), K, M, K, N, qweight.data_ptr<int32_t>(), scale.data_ptr<float>(),
                         zero.data_ptr<float>(), chunks.data(), bf.defined() ? bf.data_ptr<float>() : nullptr,
                         y.data_ptr<float>(), N};
    const int level = exl_cpu::cpu_isa_level();
    exl_cpu::for_panels(N, [&](int64_t p0, int64_t p1) {
      if (level >= 2) exl_cpu::isa_avx512::qgemm(a, p0, p1);
      else if (level == 1) exl_cpu::isa_avx2::qgemm(a, p0, p1);
      else exl_cpu::isa_scalar::qgemm(a, p0, p1);
    });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

int64_t matmul_isa(int64_t cap) {
  // cap < 0: only report the active level; else cap the level (tests run every path).
  if (cap >= 0) exl_cpu::set_cpu_isa_cap(static_cast<int>(cap));
  return exl_cpu::cpu_isa_level();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("qmatmul(Tensor x, Tensor qweight, Tensor groups, Tensor scale, Tensor zero, Tensor? perm, "
        "Tensor? bias) -> Tensor");
  m.def("matmul_isa(int cap=-1) -> int");
}

TORCH_LIBRARY_IMPL(exl_core, CPU, m) { m.impl("qmatmul", &qmatmul_cpu); }

TORCH_LIBRARY_IMPL(exl_core, CompositeExplicitAutograd, m) { m.impl("matmul_isa", &matmul_isa); }
