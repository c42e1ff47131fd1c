// exl_core::qgemm_skinny, host side: split plan, checks, launch and op registration.  The kernel and its design
// notes: qgemm_skinny_kernel.cuh.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "qgemm_skinny_kernel.cuh"
#include "qmma_common.cuh"

namespace {
using namespace exl_mma;
using namespace exl_skinny;

// ----------------------------------------------------------------------------- host side

// Largest K (multiple of 32) the kernel takes for M rows on this device: splits are capped at
// kMaxSplits on sm_90 (cluster size) and 1 elsewhere.
int64_t max_k_for(int64_t M, int dev) {
  const int S = device_sm(dev, true) >= 9 ? kMaxSplits : 1;
  return static_cast<int64_t>(max_cpb(static_cast<int>(M))) * S * 32;
}

// Split count and chunks per block for one launch shape: S = s_min (x must fit shared memory) or,
// on sm_90 without a forced `splits`, the largest S (>= 2 chunks per K warp) whose grid still fits
// one wave of co-resident clusters (more blocks in flight keep more weight bytes in flight; a
// partial second wave costs a block time). Returns {S, cpb}.
template <int NT, bool U4>
std::pair<int, int> plan_splits(int M, int C, int64_t tiles, int dev, int splits) {
  auto* kern = qgemm_skinny_kernel<NT, U4>;
  const bool clusters = device_sm(dev, true) >= 9;
  const int s_min = (C + max_cpb(M) - 1) / max_cpb(M);
  TORCH_CHECK(s_min <= (clusters ? kMaxSplits : 1), "exl_core::qgemm_skinny: K = ", int64_t(C) * 32,
              " too large for ", M, " rows (x does not fit shared memory; see qgemm_skinny_max_k)");
  int S = s_min;
  if (splits > 0) {
    S = std::max(s_min, std::min(splits, clusters ? kMaxSplits : 1));
  } else if (clusters) {
    for (int s = std::min(kMaxSplits, std::max(1, C / (2 * kKWarps))); s > s_min; --s) {
      if (tiles * s <= resident_blocks(kern, kThreads, s, smem_bytes(M, (C + s - 1) / s), dev)) {
        S = s;
        break;
      }
    }
  }
  const int cpb = (C + S - 1) / S;
  return {(C + cpb - 1) / cpb, cpb};
}

template <int NT, bool U4>
void launch(const __half* x, int M, int64_t K, Mats mats, int dev, int splits, cudaStream_t stream) {
  auto* kern = qgemm_skinny_kernel<NT, U4>;
  const int C = static_cast<int>(K / 32);
  const int64_t tiles = assign_tiles(mats, kTileN);
  // decode launches the same few shapes every step: plan each once (no occupancy queries per call)
  static std::map<std::tuple<int, int, int64_t, int, int>, std::pair<int, int>> plans;
  std::pair<int, int> plan;
  {
    const std::lock_guard<std::mutex> lock(host_mutex());
    const auto key = std::make_tuple(M, C, tiles, dev, splits);
    auto it = plans.find(key);
    if (it != plans.end()) plan = it->second;
  }
  if (plan.first == 0) {
    plan = plan_splits<NT, U4>(M, C, tiles, dev, splits);
    const std::lock_guard<std::mutex> lock(host_mutex());
    plans[std::make_tuple(M, C, tiles, dev, splits)] = plan;
  }
  const auto [S, cpb] = plan;
  const size_t smem = smem_bytes(M, cpb);
  ensure_smem(kern, smem, dev);
  launch_split(kern, tiles, S, kThreads, smem, stream, dev, x, M, K, C, cpb, mats);
}

// ys[i] [M, N_i] fp16 = x[:, perm_i] @ W_i (+ bias_i) for up to kMaxMats weights with the same K in
// one launch; x fp16 [M <= 32, K]. `uniform4`: every chunk of every weight is 4-bit and chunk c's words
// are rows 4c..4c+3 (GPTQ 4-bit; the caller checks, ops/cuda_dequant.py uniform4) -- selects the
// kernel without the per-chunk width switch or table reads for the weight loads.
std::vector<at::Tensor> qgemm_skinny_multi(const at::Tensor& x, at::TensorList qweight, at::TensorList chunks,
                                           at::TensorList scale, at::TensorList zero,
                                           const c10::List<c10::optional<at::Tensor>>& perm,
                                           const c10::List<c10::optional<at::Tensor>>& bias, bool uniform4,
                                           int64_t splits) {
  std::vector<at::Tensor> ys;
  const c10::cuda::CUDAGuard guard(x.device());
  const Mats mats = build_mats("exl_core::qgemm_skinny", x, qweight, chunks, scale, zero, perm, bias, ys);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M <= 32, "exl_core::qgemm_skinny: at most 32 rows of x, got ", M);
  if (M == 0) return ys;
  const int dev = x.device().index();
  const auto* xp = reinterpret_cast<const __half*>(x.data_ptr());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int m = static_cast<int>(M), sp = static_cast<int>(splits);
#define EXL_SKINNY_LAUNCH(NT)                                       \
  (uniform4 ? launch<NT, true>(xp, m, K, mats, dev, sp, stream)     \
            : launch<NT, false>(xp, m, K, mats, dev, sp, stream))
  if (M <= 8) EXL_SKINNY_LAUNCH(1);
  else if (M <= 16) EXL_SKINNY_LAUNCH(2);
  else EXL_SKINNY_LAUNCH(4);
#undef EXL_SKINNY_LAUNCH
  return ys;
}

at::Tensor qgemm_skinny(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& chunks,
                        const at::Tensor& scale, const at::Tensor& zero, const c10::optional<at::Tensor>& perm,
                        const c10::optional<at::Tensor>& bias, bool uniform4, int64_t splits) {
  c10::List<c10::optional<at::Tensor>> p, b;
  p.push_back(perm);
  b.push_back(bias);
  return qgemm_skinny_multi(x, {qweight}, {chunks}, {scale}, {zero}, p, b, uniform4, splits)[0];
}

int64_t qgemm_skinny_max_k(int64_t rows, int64_t device) { return max_k_for(rows, static_cast<int>(device)); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("qgemm_skinny(Tensor x, Tensor qweight, Tensor chunks, Tensor scale, Tensor zero, Tensor? perm, "
        "Tensor? bias, bool uniform4=False, int splits=0) -> Tensor");
  m.def("qgemm_skinny_multi(Tensor x, Tensor[] qweight, Tensor[] chunks, Tensor[] scale, Tensor[] zero, "
        "Tensor?[] perm, Tensor?[] bias, bool uniform4=False, int splits=0) -> Tensor[]");
  m.def("qgemm_skinny_max_k(int rows, int device) -> int", &qgemm_skinny_max_k);
}

TORCH_LIBRARY_IMPL(exl_core, CUDA, m) {
  m.impl("qgemm_skinny", &qgemm_skinny);
  m.impl("qgemm_skinny_multi", &qgemm_skinny_multi);
}
