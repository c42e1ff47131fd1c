// exl_core::qgemm_wide, host side: split plan, checks, launch and registration.  The kernel and what it is
// built from: qgemm_wide_kernel.cuh.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "qmma_common.cuh"
#include "qgemm_wide_kernel.cuh"

namespace {
using namespace exl_mma;
using namespace exl_wide;

// ----------------------------------------------------------------------------- host side

struct Plan {
  int nt, splits, cps, groups;
  size_t smem;
};

int n_tiles_for(int M) { return M <= 16 ? 2 : 4; }

// Splits of K from the grid: doubled until ~320 blocks (2-3 per SM), then more while shared memory is short.  The
// probe (bench/wide_probe.cu, results/wide_probe_h200.json call 7, us at 32 rows) found the rule within ~1 us of
// the best portable count: 4096x4096 32 tiles -> 8 splits (12.9), q/k/v 96 -> 4 (28.1; 8 splits 27.0), gate/up
// 172 -> 2 (40.9), 11008x4096 -> 8 (27.4; 12, a non-portable cluster, 25.3).  Clusters need sm_90: below it one
// split, so a K range that does not fit is refused and the policy takes qgemm_kslice.
Plan plan_for(int M, int64_t K, int64_t tiles, int splits, int64_t min_group, int dev, bool fold = false,
              bool twins = false) {
  const int nt = n_tiles_for(M), n_chunks = static_cast<int>(K / 32);
  const int max_splits = device_sm(dev, true) >= 9 ? kMaxSplits : 1;
  int S = splits;
  if (S <= 0) {
    S = 1;
    while (S < max_splits && tiles * S < 320) S *= 2;
  }
  S = std::max(1, std::min({S, max_splits, n_chunks}));
  const int per_group = static_cast<int>(std::max<int64_t>(1, (min_group > 0 ? min_group : 32) / 32));
  // an explicit split count is kept (less the splits that would get no chunks); a chosen one grows for smem
  for (;; S = std::min(max_splits, S * 2)) {
    const int cps = (n_chunks + S - 1) / S;
    S = (n_chunks + cps - 1) / cps;                                     // no split without chunks
    const int groups = std::min(cps, (cps + per_group - 1) / per_group + 1);
    const size_t smem = Smem<>(8 * nt, M, cps, groups, fold, twins).total;
    if (smem <= kSmemMax || splits > 0 || S >= max_splits || S >= n_chunks) return {nt, S, cps, groups, smem};
  }
}

// K < 2^26: the kernel steps over x's rows by 32-bit offsets (at most 31 rows, 31 * 2^26 < 2^31)
bool plan_usable(const Plan& p, int64_t K) {
  return p.smem <= kSmemMax && p.cps >= 1 && K % 32 == 0 && K < (int64_t(1) << 26);
}

// K: x's row length; k_loop: the rows the K loop covers (TWIN: the main rows; else K).
template <int NT, bool U4, bool FOLD = false, bool PAIR = false, bool TAILS = false, bool TWIN = false>
void launch_one(const __half* x, int M, int64_t K, int64_t tiles, const Plan& p, int gshift, const Mats& mats,
                int dev, int64_t k_loop = 0) {
  auto* kern = qgemm_wide_kernel<NT, U4, kRing, kStages, FOLD, PAIR, TAILS, TWIN>;
  ensure_smem(kern, p.smem, dev);
  launch_split(kern, tiles, p.splits, kThreads, p.smem, c10::cuda::getCurrentCUDAStream(), dev, x, M, K,
               static_cast<int>((k_loop > 0 ? k_loop : K) / 32), p.cps, p.groups, U4 ? gshift : -1, mats);
}

// The pair and plain uniform 4-bit launches with the twins folded in (TWIN) or not.
template <int NT, bool PAIR, bool TAILS>
void launch_u4(bool twin, const __half* x, int M, int64_t K, int64_t tiles, const Plan& p, int gshift,
               const Mats& mats, int dev, int64_t k_loop) {
  if (twin) launch_one<NT, true, false, PAIR, TAILS, true>(x, M, K, tiles, p, gshift, mats, dev, k_loop);
  else launch_one<NT, true, false, PAIR, TAILS>(x, M, K, tiles, p, gshift, mats, dev);
}

// ys[i] [M, N_i] fp16 = x[:, perm_i] @ W_i (+ bias_i), x fp16 [M <= 32, K], up to kMaxMats weights on one x in one
// launch.  splits 0 = chosen here; min_group: the weights' smallest group in rows (0 = unknown, assume 32);
// group_shift s >= 0: every weight's chunk c is in group c >> s (uniform 4-bit only; -1: the chunk table).
// Raises where the shape does not fit (see qgemm_wide_fits).
// norm_weight / norm_ss (uniform 4-bit without permutation): x is the residual stream and the kernel multiplies
// rmsnorm(x) * norm_weight instead (norm_fold_device.cuh; norm_ss from qgemm_kslice_add_).
// pair (qgemm_wide_swiglu): two weights, gate and up; returns [silu(x @ gate) * (x @ up)] (the kernel's PAIR) --
// with tails (int32 [ceil(N / 32)]) [M, out_cols], chunk c also at columns tails[c] .. + 31 where tails[c] >= 0.
// twins (int32 [k_main / group rows], uniform 4-bit weights with regular groups, no permutation, K = x's columns):
// the weights' rows past k_main are twin groups of main groups (formats/uniform4.py), twins[g] the twin of main group g
// or -1, folded into the main chunks (the kernel's TWIN; the same for every weight of the launch: the caller's promise,
// as the values of tails are).
std::vector<at::Tensor> wide_run(const at::Tensor& x, at::TensorList qweight, at::TensorList chunks,
                                 at::TensorList scale, at::TensorList zero,
                                 const c10::List<c10::optional<at::Tensor>>& perm,
                                 const c10::List<c10::optional<at::Tensor>>& bias, bool uniform4, int64_t splits,
                                 int64_t min_group, int64_t group_shift, const c10::optional<at::Tensor>& norm_weight,
                                 const c10::optional<at::Tensor>& norm_ss, double norm_eps, bool pair = false,
                                 const c10::optional<at::Tensor>& tails = c10::nullopt, int64_t out_cols = 0,
                                 const c10::optional<at::Tensor>& twins = c10::nullopt, int64_t k_main = 0) {
  std::vector<at::Tensor> ys;
  const c10::cuda::CUDAGuard guard(x.device());
  int64_t K = 0;                                                        // the weights' rows (x's K unless
  Mats mats = build_mats("exl_core::qgemm_wide", x, qweight, chunks, scale, zero, perm, bias, ys, &K);   // rows)
  const int64_t M = x.size(0);
  TORCH_CHECK(M <= kMaxRows, "exl_core::qgemm_wide: at most ", kMaxRows, " rows of x, got ", M);
  if (pair) {
    TORCH_CHECK(mats.n == 2 && mats.m[0].N == mats.m[1].N && uniform4 && group_shift >= 0 && K == x.size(1) &&
                    mats.m[0].perm == nullptr && mats.m[1].perm == nullptr,
                "exl_core::qgemm_wide_swiglu: gate and up of one N, uniform 4-bit with regular groups ",
                "(group_shift >= 0), no permutation");
    ys.resize(1);                                                       // silu(gate) * up goes to gate's output
    if (tails) {
      // the values are the caller's promise (ops/xchunks.py down_tails): each >= N, a multiple of 4, inside the row
      const int64_t N = mats.m[0].N;
      TORCH_CHECK(tails->is_cuda() && tails->device() == x.device() && tails->dtype() == at::kInt &&
                      tails->dim() == 1 && tails->numel() == (N + 31) / 32 && tails->is_contiguous() &&
                      out_cols >= N + 32 && out_cols % 4 == 0 && N % 32 == 0,
                  "exl_core::qgemm_wide_swiglu: tails must be contiguous int32 [ceil(N / 32) = ", (N + 31) / 32,
                  "] on x's GPU with out_cols >= N + 32 a multiple of 4 and N a multiple of 32; got ", tails->dtype(),
                  " ", tails->sizes(), ", out_cols ", out_cols, ", N ", N);
      ys[0] = at::empty({M, out_cols}, x.options());     // build_mats' [M, N] output goes unused (a small allocation)
      mats.m[0].y = reinterpret_cast<__half*>(ys[0].data_ptr());
      mats.tails = tails->data_ptr<int32_t>();
      mats.ldy = out_cols;
    }
  }
  TORCH_CHECK(!tails || pair, "exl_core::qgemm_wide: tails only with the SwiGLU pair");
  if (twins) {
    bool plain = uniform4 && group_shift >= 0 && group_shift < 16 && K == x.size(1);
    for (int i = 0; i < mats.n; ++i) plain = plain && mats.m[i].perm == nullptr;
    const int64_t grows = int64_t(32) << (plain ? group_shift : 0);
    TORCH_CHECK(plain && k_main >= 32 && k_main < K && k_main % grows == 0 && (K - k_main) % grows == 0 &&
                    twins->is_cuda() &&
                    twins->device() == x.device() && twins->dtype() == at::kInt && twins->dim() == 1 &&
                    twins->numel() == k_main / grows && twins->is_contiguous(),
                "exl_core::qgemm_wide: twins take uniform 4-bit weights with regular groups (group_shift >= 0), no ",
                "permutation, k_main (", k_main, ") a multiple of the group's rows below their rows (", K, ") and ",
                "contiguous int32 twins of k_main / group rows entries on x's GPU; got ", twins->dtype(), " ",
                twins->sizes());
    mats.twins = twins->data_ptr<int32_t>();
  }
  const bool twin = twins.has_value();
  const int64_t k_plan = twin ? k_main : K;                              // the K loop's rows
  if (M == 0) return ys;
  const int dev = x.device().index();
  // the plan from the two launches' tile count (the same K splits, so the same sums as qgemm_wide_multi);
  // the pair's grid: one tile = 64 columns of each weight
  const int64_t tiles = assign_tiles(mats, kTile);
  const int64_t grid_tiles = pair ? (mats.m[0].N + kTile / 2 - 1) / (kTile / 2) : tiles;
  if (pair) mats.m[1].tile0 = 0;
  const bool fold = set_norm_fold("exl_core::qgemm_wide", x, norm_weight, norm_ss, norm_eps, mats);
  TORCH_CHECK(!fold || (uniform4 && K == x.size(1)), "exl_core::qgemm_wide: the folded norm takes uniform 4-bit ",
              "weights of x's K rows");
  TORCH_CHECK(!fold || !twin, "exl_core::qgemm_wide: no folded norm with twins");
  const Plan plan = plan_for(static_cast<int>(M), k_plan, tiles, static_cast<int>(splits), min_group, dev, fold, twin);
  TORCH_CHECK(plan_usable(plan, K) && (splits <= 1 || device_sm(dev, true) >= 9),   // as qgemm_wide_fits
              "exl_core::qgemm_wide: no plan for M = ", M, ", K = ", K, ", splits = ", splits,
              " (shared memory, or splits without thread-block clusters below sm_90)");
  TORCH_CHECK(group_shift >= -1 && group_shift < 16, "exl_core::qgemm_wide: group_shift ", group_shift,
              " (-1: the chunk table; s: chunk c in group c >> s)");
  const int gs = static_cast<int>(group_shift);
  // checked before anything is launched: a refused call leaves no gather behind
  const at::Tensor xa = aligned16(x) ? x : x.clone();                   // cp.async reads 16 bytes
  // every weight reads its permuted copy (K columns) when K is not x's: build_mats saw a permutation on each
  const at::Tensor xperm = permute_x_per_weight(xa, perm, mats, dev, K);
  const __half* xp = reinterpret_cast<const __half*>(xa.data_ptr());
  if (pair) {
    TORCH_CHECK(!fold, "exl_core::qgemm_wide_swiglu: no folded norm");
    const int m = static_cast<int>(M);
    if (tails) {
      if (plan.nt == 2) launch_u4<2, true, true>(twin, xp, m, K, grid_tiles, plan, gs, mats, dev, k_plan);
      else launch_u4<4, true, true>(twin, xp, m, K, grid_tiles, plan, gs, mats, dev, k_plan);
    } else if (plan.nt == 2) {
      launch_u4<2, true, false>(twin, xp, m, K, grid_tiles, plan, gs, mats, dev, k_plan);
    } else {
      launch_u4<4, true, false>(twin, xp, m, K, grid_tiles, plan, gs, mats, dev, k_plan);
    }
  } else if (fold) {
    if (plan.nt == 2) launch_one<2, true, true>(xp, static_cast<int>(M), K, tiles, plan, gs, mats, dev);
    else launch_one<4, true, true>(xp, static_cast<int>(M), K, tiles, plan, gs, mats, dev);
  } else if (plan.nt == 2) {
    if (uniform4) launch_u4<2, false, false>(twin, xp, static_cast<int>(M), K, tiles, plan, gs, mats, dev, k_plan);
    else launch_one<2, false>(xp, static_cast<int>(M), K, tiles, plan, gs, mats, dev);
  } else {
    if (uniform4) launch_u4<4, false, false>(twin, xp, static_cast<int>(M), K, tiles, plan, gs, mats, dev, k_plan);
    else launch_one<4, false>(xp, static_cast<int>(M), K, tiles, plan, gs, mats, dev);
  }
  return ys;
}

std::vector<at::Tensor> qgemm_wide_multi(const at::Tensor& x, at::TensorList qweight, at::TensorList chunks,
                                         at::TensorList scale, at::TensorList zero,
                                         const c10::List<c10::optional<at::Tensor>>& perm,
                                         const c10::List<c10::optional<at::Tensor>>& bias, bool uniform4,
                                         int64_t splits, int64_t min_group, int64_t group_shift,
                                         const c10::optional<at::Tensor>& norm_weight,
                                         const c10::optional<at::Tensor>& norm_ss, double norm_eps,
                                         const c10::optional<at::Tensor>& twins, int64_t k_main) {
  return wide_run(x, qweight, chunks, scale, zero, perm, bias, uniform4, splits, min_group, group_shift, norm_weight,
                  norm_ss, norm_eps, false, c10::nullopt, 0, twins, k_main);
}

// silu(x @ gate) * (x @ up) [M, N] fp16 in one launch, rounded as qgemm_wide_multi then silu_mul round it (the MLP
// at batch-decode rows: no silu_mul launch).  Uniform 4-bit gate and up of one N with regular groups, no
// permutation (group_shift >= 0: its default -1 is refused, never guessed); ops/cuda_swiglu.py checks first.
at::Tensor qgemm_wide_swiglu(const at::Tensor& x, at::TensorList qweight, at::TensorList chunks, at::TensorList scale,
                             at::TensorList zero, const c10::List<c10::optional<at::Tensor>>& bias, int64_t splits,
                             int64_t min_group, int64_t group_shift, const c10::optional<at::Tensor>& tails,
                             int64_t out_cols, const c10::optional<at::Tensor>& twins, int64_t k_main) {
  c10::List<c10::optional<at::Tensor>> perm;
  for (size_t i = 0; i < qweight.size(); ++i) perm.push_back(c10::nullopt);
  return wide_run(x, qweight, chunks, scale, zero, perm, bias, true, splits, min_group, group_shift, c10::nullopt,
                  c10::nullopt, 0.0, true, tails, out_cols, twins, k_main)[0];
}

at::Tensor qgemm_wide(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& chunks, const at::Tensor& scale,
                      const at::Tensor& zero, const c10::optional<at::Tensor>& perm,
                      const c10::optional<at::Tensor>& bias, bool uniform4, int64_t splits, int64_t min_group,
                      int64_t group_shift) {
  c10::List<c10::optional<at::Tensor>> p, b;
  p.push_back(perm);
  b.push_back(bias);
  return qgemm_wide_multi(x, {qweight}, {chunks}, {scale}, {zero}, p, b, uniform4, splits, min_group,
                          group_shift, c10::nullopt, c10::nullopt, 0.0, c10::nullopt, 0)[0];
}

// Whether qgemm_wide takes M rows of K over `tiles` 128-column tiles on `device` (splits 0: its own choice); a
// call it refuses raises, which on some images kills the process (see NOTES.md), so callers ask first.
// twins: K the main rows (the K loop's), with the twin words' shared memory.
bool qgemm_wide_fits(int64_t rows, int64_t K, int64_t tiles, int64_t min_group, int64_t device, int64_t splits,
                     bool fold, bool twins) {
  if (rows < 1 || rows > kMaxRows || K < 32 || K % 32 != 0 || tiles < 1 || splits < 0 || splits > kMaxSplits)
    return false;
  const int dev = static_cast<int>(device);
  if (splits > 1 && device_sm(dev, true) < 9) return false;             // no clusters to reduce the splits
  return plan_usable(plan_for(static_cast<int>(rows), K, tiles, static_cast<int>(splits), min_group, dev, fold, twins),
                     K);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("qgemm_wide(Tensor x, Tensor qweight, Tensor chunks, Tensor scale, Tensor zero, Tensor? perm, "
        "Tensor? bias, bool uniform4=False, int splits=0, int min_group=0, int group_shift=-1) -> Tensor");
  m.def("qgemm_wide_multi(Tensor x, Tensor[] qweight, Tensor[] chunks, Tensor[] scale, Tensor[] zero, "
        "Tensor?[] perm, Tensor?[] bias, bool uniform4=False, int splits=0, int min_group=0, "
        "int group_shift=-1, Tensor? norm_weight=None, Tensor? norm_ss=None, float norm_eps=0.0, Tensor? twins=None, "
        "int k_main=0) -> Tensor[]");
  m.def("qgemm_wide_swiglu(Tensor x, Tensor[] qweight, Tensor[] chunks, Tensor[] scale, Tensor[] zero, "
        "Tensor?[] bias, int splits=0, int min_group=0, int group_shift=-1, Tensor? tails=None, int out_cols=0, "
        "Tensor? twins=None, int k_main=0) -> Tensor");
  m.def("qgemm_wide_fits(int rows, int K, int tiles, int min_group, int device, int splits=0, bool fold=False, "
        "bool twins=False) -> bool", &qgemm_wide_fits);
}

TORCH_LIBRARY_IMPL(exl_core, CUDA, m) {
  m.impl("qgemm_wide", &qgemm_wide);
  m.impl("qgemm_wide_multi", &qgemm_wide_multi);
  m.impl("qgemm_wide_swiglu", &qgemm_wide_swiglu);
}
