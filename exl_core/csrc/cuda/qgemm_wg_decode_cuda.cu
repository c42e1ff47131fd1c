// exl_core::qgemm_wg_decode: y_i = x W_i at batch-decode rows (17..32) on Hopper's wgmma, stream-K
// (qgemm_wg_streamk_kernel.cuh): one block an SM over the launch's (column tile, 64-row k-tile) items.
// exl_core::qgemm_wg_swiglu: the same for SwiGLU's gate and up, writing only silu(x W_gate) * (x W_up) (ops/swiglu.py:
// tails as qgemm_wide_swiglu takes them; columns past N get values only where tails put a chunk's copy).
//
// Why: at 32 rows qgemm_wide's blocks issue their dequantise with ~2.5 warps a scheduler, and its grid of one block
// a (column tile, K split) leaves the tail of a wave idle. In bench/wgmma_probe.cu (stop 57 call 14, us a launch,
// against bench/wide_probe.cu's qgemm_wide in the same call): q/k/v 20.32 against 23.62, gate/up 32.42 against
// 33.79, 4096x4096 11.49 against 12.30, 11008x4096 18.78 against 25.35. In the model since stop 58
// (ops/cuda_wg_decode.py, EXL_CORE_WG_DECODE); EXL_CORE_WG_EARLY_W=0: the weight boxes after the PDL wait (A/B).
//
// Takes: x fp16 [M <= 32, K] contiguous (K % 64 == 0: the weights' rows, so an EXL2 rewrite's extra rows come with
// x already widened, as qgemm_wide's Prepermuted callers pass it); 1..3 weights with the same K, N (N % 8 == 0) and
// chunk table, uniform 4-bit words int32 [K / 8, N], scale and zero fp32 [G, N]. The caller guarantees what a check
// here would need a device sync for: every chunk 4-bit, every group 64 rows or more starting at a multiple of 64.
// sm_90 only (built for sm_90a: EXL_CORE_CUDA_ARCHS must hold 90a, which the first call on a device checks); that
// first call must not be inside a CUDA graph capture (it allocates the stream-K workspace, whose counters the kernel
// leaves zero for the next launch). One workspace a device: launches on two streams at once would race on it (the
// library decodes on one stream).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "pdl.cuh"
#include "qgemm_wg_streamk_kernel.cuh"
#include "qmma_common.cuh"
#include "tma_host.h"

namespace {

constexpr int kStages = 8;
constexpr int64_t kMaxTiles = 1024;                 // column tiles of 128 a launch the workspace covers

// A device's stream-K workspace: two partial-sum slots a block (the ordered finish), the atomics' tile sums (zero),
// SwiGLU's pair slots, and the tile and pair counters (zero; each launch leaves the sums and counters zero). The
// atomics' sums (16 MiB) and the pair's buffers (8 MiB) are made only when a call first needs them.
struct Work {
  at::Tensor ws, sum, count, pair_ws, pair_count;
};

// The workspace of x's device with what this call needs: every allocation must happen outside a CUDA graph capture
// (the graph would own it), so the first call on a device -- and the first with the atomics' finish or the SwiGLU
// pair -- must run eagerly (ops/cuda_wg_decode.py tracks which have).
Work& work_for(const char* op, const at::Device& dev, bool atomic, bool pair) {
  static std::mutex mu;
  static Work works[64];
  const int i = dev.index() < 0 ? 0 : dev.index() % 64;
  std::lock_guard<std::mutex> lock(mu);
  Work& w = works[i];
  if (w.ws.defined() && (!atomic || w.sum.defined()) && (!pair || w.pair_ws.defined())) return w;
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &cap));
  TORCH_CHECK(cap == cudaStreamCaptureStatusNone, op, ": the first call on a device (and the first with the atomics' "
              "finish or the SwiGLU pair) must run outside a CUDA graph capture: it allocates the stream-K workspace");
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  if (!w.ws.defined()) {
    w.count = at::zeros({kMaxTiles}, f32.dtype(at::kInt));
    exl_wg_sk::wg_streamk_built<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(w.count.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const bool built = w.count[0].item<int>() == 1;           // a sync, once a device
    w.count.zero_();
    TORCH_CHECK(built, op, ": this build has no sm_90a code for it (set EXL_CORE_CUDA_ARCHS to include 90a and "
                "rebuild)");
    w.ws = at::empty({2 * exl_pdl::device_sm(w.count.get_device(), false), exl_wg_sk::kPerTile}, f32);
  }
  if (atomic && !w.sum.defined()) w.sum = at::zeros({kMaxTiles, exl_wg_sk::kPerTile}, f32);
  if (pair && !w.pair_ws.defined()) {
    w.pair_ws = at::empty({kMaxTiles / 2, 2, exl_wg_sk::kPerTile / 2}, f32.dtype(at::kInt));
    w.pair_count = at::zeros({kMaxTiles / 2}, f32.dtype(at::kInt));
  }
  return w;
}

using exl_mma::aligned16;

// y_i = x W_i (h undefined: the outputs returned), or SwiGLU into h (two weights; tails as ops/swiglu.py says).
std::vector<at::Tensor> wg_launch(const char* op, const at::Tensor& x, at::TensorList qweight, at::TensorList chunks,
                                  at::TensorList scale, at::TensorList zero, const at::Tensor& h,
                                  const c10::optional<at::Tensor>& tails, int64_t finish) {
  const size_t n = qweight.size();
  TORCH_CHECK(n >= 1 && n <= static_cast<size_t>(exl_wg::kMaxWeights), op, ": 1..", exl_wg::kMaxWeights,
              " weights a call, got ", n);
  TORCH_CHECK(chunks.size() == n && scale.size() == n && zero.size() == n, op,
              ": qweight, chunks, scale and zero lists must have the same length");
  TORCH_CHECK(x.is_cuda() && x.dtype() == at::kHalf && x.dim() == 2 && x.is_contiguous() && aligned16(x),
              op, ": x must be contiguous, 16-byte aligned float16 [M, K] on the GPU, got ", x.dtype(), " ",
              x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= exl_wg_sk::kNT, op, ": 1..", exl_wg_sk::kNT, " rows of x, got ", M);
  TORCH_CHECK(K >= 64 && K % 64 == 0 && K / 32 <= exl_wg::kMaxChunks, op, ": K = ", K,
              " must be a multiple of 64 up to ", exl_wg::kMaxChunks * 32);
  const c10::cuda::CUDAGuard guard(x.device());
  const int dev = x.device().index();
  TORCH_CHECK(exl_pdl::device_sm(dev, true) == 9, op, ": needs an sm_90 GPU (wgmma), this one is sm_",
              exl_pdl::device_sm(dev, true), "x");
  const int64_t N = qweight[0].dim() == 2 ? qweight[0].size(1) : -1;
  TORCH_CHECK(N > 0 && N % 8 == 0, op, ": weight 0 must be int32 [K / 8, N] with N % 8 == 0, got ",
              qweight[0].sizes());
  exl_wg_sk::SkArgs sk{};
  sk.batch.n = static_cast<int>(n);
  std::vector<at::Tensor> ys;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor &q = qweight[i], &ch = chunks[i], &s = scale[i], &z = zero[i];
    TORCH_CHECK(q.device() == x.device() && ch.device() == x.device() && s.device() == x.device() &&
                    z.device() == x.device(), op, ": weight ", i, " must be on x's GPU");
    TORCH_CHECK(q.dtype() == at::kInt && q.dim() == 2 && q.size(0) * 8 == K && q.size(1) == N && q.is_contiguous() &&
                    aligned16(q), op, ": qweight ", i, " must be contiguous, 16-byte aligned int32 [",
                K / 8, ", ", N, "] (uniform 4-bit, every weight one shape), got ", q.sizes());
    TORCH_CHECK(ch.dtype() == at::kInt && ch.dim() == 2 && ch.size(0) * 32 == K && ch.size(1) == 3 &&
                    ch.is_contiguous(), op, ": chunk table ", i, " must be int32 [", K / 32, ", 3], got ", ch.sizes());
    for (const at::Tensor* t : {&s, &z})
      TORCH_CHECK(t->dtype() == at::kFloat && t->dim() == 2 && t->size(1) == N && t->is_contiguous() &&
                      aligned16(*t) && t->size(0) == scale[0].size(0), op, ": scale/zero ", i,
                  " must be contiguous, 16-byte aligned float32 [G, ", N, "] with weight 0's G");
    if (!h.defined()) ys.push_back(at::empty({M, N}, x.options()));
    exl_wg::WgArgs& a = sk.batch.w[i];
    const int64_t G = s.size(0);
    using exl_tma::make_map_2d;
    const bool ok =
        make_map_2d(&a.xmap, x.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_FLOAT16, K, M, K * 2, exl_wg::kBK, exl_wg_sk::kNT,
                    true) &&
        make_map_2d(&a.wmap, q.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_INT32, N, K / 8, N * 4, exl_wg::kBF, 8, false) &&
        make_map_2d(&a.smap, s.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_FLOAT32, N, G, N * 4, exl_wg::kBF, 1, false) &&
        make_map_2d(&a.zmap, z.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_FLOAT32, N, G, N * 4, exl_wg::kBF, 1, false);
    TORCH_CHECK(ok, op, ": the driver refused a tensor map for weight ", i,
                " (alignment, or no cuTensorMapEncodeTiled)");
    a.chunks = ch.data_ptr<int32_t>();
    a.y = h.defined() ? nullptr : reinterpret_cast<__half*>(ys.back().data_ptr());
    a.ldy = N;
    a.M = static_cast<int>(M), a.N = static_cast<int>(N), a.K = static_cast<int>(K), a.groups = static_cast<int>(G);
  }
  const int64_t tiles = static_cast<int64_t>(n) * ((N + exl_wg::kBF - 1) / exl_wg::kBF);
  TORCH_CHECK(tiles <= kMaxTiles, op, ": ", tiles, " column tiles of ", exl_wg::kBF, " in one call; at most ",
              kMaxTiles);
  // the finish checked before work_for, which allocates the atomics' sums only for finish 0
  TORCH_CHECK(finish == exl_wg_sk::kFinishAtomic || finish == exl_wg_sk::kFinishOrdered, op,
              ": finish must be 0 (atomics) or 1 (ordered), got ", finish);
  Work& w = work_for(op, x.device(), finish == exl_wg_sk::kFinishAtomic, h.defined());
  sk.ws = w.ws.data_ptr<float>();
  sk.finish = static_cast<int>(finish);
  sk.sum = finish == exl_wg_sk::kFinishAtomic ? w.sum.data_ptr<float>() : nullptr;
  sk.count = w.count.data_ptr<int>();
  sk.early_w = exl_pdl::env_on("EXL_CORE_WG_EARLY_W");     // read a call (graph captures fix it), for A/B runs
  if (h.defined()) {
    sk.pair_ws = reinterpret_cast<uint32_t*>(w.pair_ws.data_ptr<int>());
    sk.pair_count = w.pair_count.data_ptr<int>();
    sk.h = reinterpret_cast<__half*>(h.data_ptr());
    sk.ldh = h.size(1);
    if (tails && tails->defined()) sk.tails = tails->data_ptr<int>();
  }
  const int smem = exl_wg_sk::smem_bytes<kStages>();
  exl_mma::ensure_smem(exl_wg_sk::qgemm_wg_streamk<kStages>, smem, dev);
  const int64_t items = tiles * (K / exl_wg::kBK), blocks = std::min<int64_t>(w.ws.size(0) / 2, items);
  exl_pdl::launch_pdl(exl_wg_sk::qgemm_wg_streamk<kStages>, dim3(static_cast<unsigned>(blocks)),
                      dim3(exl_wg_sk::kThreads), smem,
                      c10::cuda::getCurrentCUDAStream(), dev, sk);
  return ys;
}

// finish: how split tiles are added (exl_wg_sk::Finish): 0 fp32 atomics, 1 in block order (the same bits every run).
std::vector<at::Tensor> qgemm_wg_decode(const at::Tensor& x, at::TensorList qweight, at::TensorList chunks,
                                        at::TensorList scale, at::TensorList zero, int64_t finish) {
  return wg_launch("exl_core::qgemm_wg_decode", x, qweight, chunks, scale, zero, at::Tensor(), c10::nullopt, finish);
}

// silu(x W_gate) * (x W_up) as fp16 [M, out_cols] (out_cols 0: N); tails int32 [N / 32] on x's GPU or none: chunk c of
// the product also at columns tails[c] .. + 31 where tails[c] >= 0 (the caller checks the columns fit, as for
// qgemm_wide_swiglu). Columns past N that no tail covers are left unwritten (callers pass out_cols only with tails).
at::Tensor qgemm_wg_swiglu(const at::Tensor& x, at::TensorList qweight, at::TensorList chunks, at::TensorList scale,
                           at::TensorList zero, const c10::optional<at::Tensor>& tails, int64_t out_cols,
                           int64_t finish) {
  const char* op = "exl_core::qgemm_wg_swiglu";
  TORCH_CHECK(qweight.size() == 2, op, ": two weights (gate, up), got ", qweight.size());
  TORCH_CHECK(qweight[0].dim() == 2 && x.dim() == 2, op, ": x [M, K] and int32 [K / 8, N] weights");
  const int64_t N = qweight[0].size(1), cols = out_cols > 0 ? out_cols : N;
  TORCH_CHECK(cols >= N && cols % 2 == 0, op, ": out_cols ", cols, " must be at least N = ", N, " and even");
  if (tails && tails->defined())
    TORCH_CHECK(tails->is_cuda() && tails->device() == x.device() && tails->dtype() == at::kInt &&
                    tails->numel() * 32 == N && N % 32 == 0 && cols >= N + 32 && tails->is_contiguous(),
                op, ": tails must be contiguous int32 [N / 32] on x's GPU with out_cols >= N + 32");
  at::Tensor h = at::empty({x.size(0), cols}, x.options());
  wg_launch(op, x, qweight, chunks, scale, zero, h, tails, finish);
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("qgemm_wg_decode(Tensor x, Tensor[] qweight, Tensor[] chunks, Tensor[] scale, Tensor[] zero, "
        "int finish=1) -> Tensor[]");
  m.def("qgemm_wg_swiglu(Tensor x, Tensor[] qweight, Tensor[] chunks, Tensor[] scale, Tensor[] zero, "
        "Tensor? tails=None, int out_cols=0, int finish=1) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl_core, CUDA, m) {
  m.impl("qgemm_wg_decode", &qgemm_wg_decode);
  m.impl("qgemm_wg_swiglu", &qgemm_wg_swiglu);
}
