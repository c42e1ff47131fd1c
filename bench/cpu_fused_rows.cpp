// The CPU matmuls' small-M paths (csrc/cpu/simd.h: fused_cols for a 4-bit g128 weight, dense_small for fp32 and bf16
// weights) alone, single thread, AVX2 instance: us a call at M = 1..4 rows for a K x N given on the command line.
// Built twice by bench/cpu_fused_rows.sh (the working tree's simd.h and a git revision's) to A/B a change to it.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>

#include "qmatmul.h"

using namespace exl_cpu;

// The best of `reps` means of `n` back-to-back calls, us a call, after a warm-up of n / 4 calls.
template <typename F>
double best_us(F call, int n, int reps) {
  for (int i = 0; i < n / 4; ++i) call();
  double best = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) call();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
    best = us < best ? us : best;
  }
  return best;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s K N  (K a multiple of 128)\n", argv[0]);
    return 2;
  }
  const int64_t K = std::atoll(argv[1]), N = std::atoll(argv[2]);
  const int bits = 4;
  std::vector<ChunkInfo> chunks;
  for (int64_t c = 0; c < K / 32; ++c) chunks.push_back({bits, static_cast<int32_t>(c / 4), c * bits});
  std::vector<int32_t> q(static_cast<size_t>(K / 32 * bits * N));
  std::srand(1);
  for (auto& v : q) v = std::rand();
  std::vector<float> scale(static_cast<size_t>(K / 128 * N), 0.01f), zero(scale.size(), 8.f);
  for (int M = 1; M <= 4; ++M) {
    std::vector<float> x(M * K), y(M * N), xs(M * (K / 32));
    for (auto& v : x) v = static_cast<float>(std::rand() % 1000) / 1000.f;
    for (int m = 0; m < M; ++m)
      for (int64_t c = 0; c < K / 32; ++c) {
        float s = 0;
        for (int i = 0; i < 32; ++i) s += x[m * K + c * 32 + i];
        xs[m * (K / 32) + c] = s;
      }
    QGemmArgs a{x.data(), K, M, K, N, q.data(), scale.data(), zero.data(), chunks.data(), nullptr, y.data(), N,
                xs.data()};
    const int64_t panels = (N + kPanel - 1) / kPanel;
    std::printf("q4 %lld %lld %d %.3f\n", static_cast<long long>(K), static_cast<long long>(N), M,
                best_us([&] { isa_avx2::qgemm(a, 0, panels); }, 200, 7));
    // the dense direct path (dense_small) on fp32 and bf16 weights of the same shape (bf16: the fp32 values' top
    // halves, so no denormal or NaN bit patterns)
    std::vector<float> wf(static_cast<size_t>(K * N));
    std::vector<uint16_t> wb(wf.size());
    for (size_t i = 0; i < wf.size(); ++i) {
      wf[i] = static_cast<float>(std::rand() % 1000) / 1000.f - 0.5f;
      uint32_t bits;
      std::memcpy(&bits, &wf[i], 4);
      wb[i] = static_cast<uint16_t>(bits >> 16);
    }
    for (const bool bf16 : {false, true}) {
      DenseGemmArgs d{x.data(), K, M, K, N, bf16 ? static_cast<const void*>(wb.data()) : wf.data(), bf16, nullptr,
                      y.data(), N};
      std::printf("%s %lld %lld %d %.3f\n", bf16 ? "bf16" : "fp32", static_cast<long long>(K),
                  static_cast<long long>(N), M, best_us([&] { isa_avx2::dense_gemm(d, 0, panels); }, 40, 5));
    }
  }
  return 0;
}
