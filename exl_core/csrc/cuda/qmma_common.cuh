// Host-side pieces shared by the tensor-core quantized GEMM kernels (qgemm_mma, qgemm_skinny, qgemm_kslice,
// qgemm_wide): shared-memory limits, occupancy of cluster launches, the multi-weight launch table built from
// tensors with its argument checks, and the act-order gather.  Device pieces: qmma_device.cuh.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp16.h>

#include "pdl.cuh"
#include "qmma_device.cuh"

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace exl_mma {

using exl_pdl::device_sm;

inline std::mutex& host_mutex() {
  static std::mutex mu;
  return mu;
}

// Raises the kernel's dynamic shared memory limit on `dev` to at least `smem` (once per size).
template <typename Kern>
void ensure_smem(Kern* kern, size_t smem, int dev) {
  static std::map<std::pair<const void*, int>, size_t> granted;
  const std::lock_guard<std::mutex> lock(host_mutex());
  size_t& have = granted[{reinterpret_cast<const void*>(kern), dev}];
  if (smem > have) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    have = smem;
  }
}


// Co-resident blocks of `kern` with clusters of S blocks (cached per kernel, device, S and smem).
template <typename Kern>
int64_t resident_blocks(Kern* kern, int threads, int S, size_t smem, int dev) {
  ensure_smem(kern, smem, dev);
  static std::map<std::tuple<const void*, int, int, size_t>, int64_t> cache;
  const std::lock_guard<std::mutex> lock(host_mutex());
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kern), dev, S, smem);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int64_t blocks = 0;
  if (S == 1) {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, threads, smem));
    blocks = static_cast<int64_t>(per_sm) * device_sm(dev, false);
  } else {
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = split_config(1, S, threads, smem, nullptr, attr);
    int clusters = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kern, &cfg));
    blocks = static_cast<int64_t>(clusters) * S;
  }
  cache[key] = blocks;
  return blocks;
}

// Launches grid (tiles, S) with clusters (1, S, 1) when S > 1.
// The kernel is launched with PDL where it is on (pdl.cuh: it must call pdl_wait() before reading x).
template <typename Kern, typename... Args>
void launch_split(Kern* kern, int64_t tiles, int S, int threads, size_t smem, cudaStream_t stream, int dev,
                  Args... args) {
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = split_config(tiles, S, threads, smem, stream, attr);
  exl_pdl::launch_ex(cfg, dev, kern, args...);
}

inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Validates x fp16 [M, K] and up to kMaxMats weights sharing K; allocates ys[i] [M, N_i] and fills mats.
// rows (kernels that take it: qgemm_kslice, qgemm_wide): when not null, the weights may have R = *rows != K rows
// (PackedWeight.rows: a chunk table of R/32 chunks and a permutation of length R into x's K columns, on every
// weight, all with the same R -- or, with xchunks, no permutation: qgemm_kslice's caller then reads x by chunk
// offsets); set to R (K when they have K rows).  Null: R must be K.
inline Mats build_mats(const char* op, const at::Tensor& x, at::TensorList qweight, at::TensorList chunks,
                       at::TensorList scale, at::TensorList zero, const c10::List<c10::optional<at::Tensor>>& perm,
                       const c10::List<c10::optional<at::Tensor>>& bias, std::vector<at::Tensor>& ys,
                       int64_t* rows = nullptr, bool xchunks = false) {
  const size_t n = qweight.size();
  TORCH_CHECK(n >= 1 && n <= static_cast<size_t>(kMaxMats), op, ": 1..", kMaxMats, " weights per call, got ", n);
  TORCH_CHECK(chunks.size() == n && scale.size() == n && zero.size() == n && perm.size() == n && bias.size() == n,
              op, ": qweight, chunks, scale, zero, perm and bias lists must have the same length");
  TORCH_CHECK(x.is_cuda() && x.dtype() == at::kHalf && x.dim() == 2 && x.is_contiguous(), op,
              ": x must be contiguous float16 [M, K] on the GPU, got ", x.dtype(), " ", x.sizes());
  const int64_t M = x.size(0), Kx = x.size(1);
  TORCH_CHECK(Kx % 32 == 0, op, ": K = ", Kx, " must be a multiple of 32");
  TORCH_CHECK(n == 0 || chunks[0].dim() == 2, op, ": chunk table 0 must be 2-D");
  const int64_t K = rows != nullptr ? chunks[0].size(0) * 32 : Kx;   // the weights' rows
  TORCH_CHECK(K >= Kx, op, ": the weights have ", K, " rows, fewer than x's ", Kx, " columns");
  if (rows != nullptr) *rows = K;
  Mats mats{};
  mats.n = static_cast<int>(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor &q = qweight[i], &ch = chunks[i], &s = scale[i], &z = zero[i];
    TORCH_CHECK(q.is_cuda() && ch.is_cuda() && s.is_cuda() && z.is_cuda() && q.device() == x.device(), op,
                ": weight ", i, " must be on x's GPU");
    TORCH_CHECK(q.dtype() == at::kInt && (q.dim() == 2 || (q.dim() == 3 && q.size(2) == 128)) && q.is_contiguous() &&
                    aligned16(q), op, ": qweight ", i,
                " must be contiguous, 16-byte aligned int32 [rows, N] or column-tiled [N/128, rows, 128]");
    TORCH_CHECK(q.numel() < (int64_t(1) << 31), op, ": qweight ", i, " has ", q.numel(),
                " words; the decode kernels address a matrix's words with 32-bit offsets (< 2^31)");
    const bool tiled = q.dim() == 3;
    const int64_t N = tiled ? s.size(1) : q.size(1), Q = tiled ? q.size(1) : q.size(0);
    TORCH_CHECK(!tiled || q.size(0) * 128 == N, op, ": tiled qweight ", i, " has ", q.size(0), " tiles for N = ", N);
    TORCH_CHECK(N % 4 == 0, op, ": weight ", i, " has N = ", N, "; N must be a multiple of 4 (16-byte column loads)");
    TORCH_CHECK(ch.dtype() == at::kInt && ch.dim() == 2 && ch.size(1) == 3 && ch.is_contiguous() &&
                    ch.size(0) * 32 == K, op, ": chunk table ", i, " must be int32 [K/32 = ", K / 32, ", 3], got ",
                ch.sizes());
    for (const at::Tensor* t : {&s, &z})
      TORCH_CHECK(t->dtype() == at::kFloat && t->dim() == 2 && t->size(1) == N && t->is_contiguous() && aligned16(*t),
                  op, ": scale/zero ", i, " must be contiguous, 16-byte aligned float32 [G, ", N, "]");
    const c10::optional<at::Tensor> p = perm.get(i), b = bias.get(i);
    if (p) TORCH_CHECK(p->is_cuda() && p->dtype() == at::kLong && p->numel() == K && p->is_contiguous(), op,
                       ": perm ", i, " must be contiguous int64 [", K, "] on the GPU");
    TORCH_CHECK(K == Kx || p || xchunks, op, ": weight ", i, " has ", K, " rows for x's ", Kx,
                " columns and no permutation saying which column each row reads");
    if (b) TORCH_CHECK(b->is_cuda() && b->dtype() == at::kHalf && b->numel() == N && b->is_contiguous(), op,
                       ": bias ", i, " must be contiguous float16 [", N, "] on the GPU");
    ys.push_back(at::empty({M, N}, x.options()));
    const QPtr qp{q.data_ptr<int32_t>(), tiled ? 128 : N, tiled ? Q * 128 : 128};
    mats.m[i] = Mat{qp, ch.data_ptr<int32_t>(), s.data_ptr<float>(), z.data_ptr<float>(),
                    p ? p->data_ptr<int64_t>() : nullptr,
                    b ? reinterpret_cast<const __half*>(b->data_ptr()) : nullptr,
                    reinterpret_cast<__half*>(ys.back().data_ptr()), N, 0, nullptr};
  }
  return mats;
}

// xp[i][m][k] = x[m][perm_i[k]] for the act-order weights of one launch (blockIdx.z = weight, y = row): the
// permuted copies that kernels reading x straight from global memory (qgemm_kslice above 8 rows, qgemm_wide)
// take instead of gathering per element and block.  One launch instead of an index_select per weight (EXL2
// bs32: 224 calls, 1.42 ms per decode step); launched with PDL like the kernel it feeds, so it waits for x's
// producer and the matmul waits for it.  perm is read after the wait too: on a first call the op before may be
// the one that converted it (cuda_candidates._perm_of).
struct Gather {
  const int64_t* perm[kMaxMats];
  __half* out[kMaxMats];
};

// static: one copy per translation unit that launches it.  K: the weights' rows (the copies' width), Kx: x's.
static __global__ void gather_cols_kernel(const __half* __restrict__ x, int64_t K, int64_t Kx, const Gather gs) {
  const int i = blockIdx.z, m = blockIdx.y;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  exl_pdl::pdl_wait();
  exl_pdl::pdl_trigger();
  if (k < K) gs.out[i][m * K + k] = x[m * Kx + __ldg(gs.perm[i] + k)];
}

// Gives every act-order weight of `mats` its own permuted copy of x (mats.m[i].x, perm cleared) with one launch;
// returns the tensor holding the copies (undefined when no weight has a permutation).  rows: the weights' rows
// (build_mats; 0: x's K), the copies' width.
inline at::Tensor permute_x_per_weight(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& perm,
                                       Mats& mats, int dev, int64_t rows = 0) {
  const int64_t M = x.size(0), Kx = x.size(1), K = rows > 0 ? rows : Kx;
  int n = 0;
  for (int i = 0; i < mats.n; ++i) n += perm.get(i).has_value();
  if (n == 0) return at::Tensor();
  at::Tensor xperm = at::empty({n, M, K}, x.options());
  Gather gs{};
  n = 0;
  for (int i = 0; i < mats.n; ++i) {
    const c10::optional<at::Tensor> p = perm.get(i);
    if (!p) continue;
    gs.perm[n] = p->data_ptr<int64_t>();
    gs.out[n] = reinterpret_cast<__half*>(xperm[n].data_ptr());
    mats.m[i].x = gs.out[n];
    mats.m[i].perm = nullptr;
    ++n;
  }
  const dim3 grid(static_cast<unsigned>((K + 255) / 256), static_cast<unsigned>(M), static_cast<unsigned>(n));
  exl_pdl::launch_pdl(gather_cols_kernel, grid, dim3(256), 0, c10::cuda::getCurrentCUDAStream(), dev,
                      static_cast<const __half*>(reinterpret_cast<const __half*>(x.data_ptr())), K, Kx, gs);
  return xperm;
}

// The norm folded into a consumer launch (norm_fold_device.cuh; qgemm_kslice's staged rows, qgemm_wide): x is the
// residual stream [M, K], nw the RMSNorm weight [K], ss the producer's sums of squares [ceil(K / 32), M]
// (qgemm_kslice_add_).  Checks them and fills mats.nf; undefined nw: no fold.  Returns whether it folds.
inline bool set_norm_fold(const char* op, const at::Tensor& x, const c10::optional<at::Tensor>& nw,
                          const c10::optional<at::Tensor>& ss, double eps, Mats& mats) {
  TORCH_CHECK(nw.has_value() == ss.has_value(), op, ": norm_weight and norm_ss go together");
  if (!nw) return false;
  const int64_t M = x.size(0), K = x.size(1);
  for (int i = 0; i < mats.n; ++i)
    TORCH_CHECK(mats.m[i].perm == nullptr && mats.m[i].x == nullptr, op,
                ": the folded norm takes weights without a permutation (weight ", i, " has one)");
  TORCH_CHECK(aligned16(x), op, ": the folded norm needs x 16-byte aligned");
  TORCH_CHECK(nw->is_cuda() && nw->device() == x.device() && nw->dtype() == at::kHalf && nw->dim() == 1 &&
                  nw->size(0) == K && nw->is_contiguous() && aligned16(*nw),
              op, ": norm_weight must be contiguous, 16-byte aligned float16 [", K, "] on x's GPU, got ", nw->dtype(),
              " ", nw->sizes());
  TORCH_CHECK(ss->is_cuda() && ss->device() == x.device() && ss->dtype() == at::kFloat && ss->dim() == 2 &&
                  ss->size(0) == (K + 31) / 32 && ss->size(1) == M && ss->is_contiguous(),
              op, ": norm_ss must be contiguous float32 [", (K + 31) / 32, ", ", M, "] on x's GPU (a producer's sums ",
              "of squares over 32-column tiles), got ", ss->dtype(), " ", ss->sizes());
  TORCH_CHECK(eps >= 0.0, op, ": norm_eps ", eps, " must be >= 0");
  mats.nf.nw = reinterpret_cast<const __half*>(nw->data_ptr());
  mats.nf.ss_in = ss->data_ptr<float>();
  mats.nf.ss_tiles = static_cast<int>(ss->size(0));
  mats.nf.eps = static_cast<float>(eps);
  return true;
}

}  // namespace exl_mma
