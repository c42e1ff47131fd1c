// exl_core::paged_attention (schema in csrc/cpu/attention.cpp) and exl_core::paged_attention_rope (CUDA only, defined
// here), host side: the split plan, checks, launch and registration.  The kernels and how they split the work:
// paged_attention_kernel.cuh.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>

#include "paged_attention_kernel.cuh"
#include "pdl.cuh"

namespace {

using namespace exl_attn;

template <typename T, int D, int G, bool WAVE = false, bool ROPE = false>
void launch(const Args& a, int64_t rows, cudaStream_t stream, int dev) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = a.head_major ? dim3(static_cast<unsigned>(a.Hkv), static_cast<unsigned>(rows), static_cast<unsigned>(a.splits))
                             : dim3(static_cast<unsigned>(rows), static_cast<unsigned>(a.Hkv), static_cast<unsigned>(a.splits));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (a.cluster) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 1;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = static_cast<unsigned>(a.splits);
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  exl_pdl::launch_ex(cfg, dev, paged_attention_kernel<T, D, G, WAVE, ROPE>, a);
}

// The one-wave instance (WAVE) where an unsplit grid is more than one wave of the default G 1 instance and at most
// one of its own (H200, same process: batch 32 step 4.8054 vs 4.9490 ms GPTQ, 6.4831 vs 6.6489 EXL2; with key splits,
// batch 8's 256 pairs x 3, it lost: 3.2751 vs 3.2684, 4.7318 vs 4.7026).  EXL_CORE_ATTN_ONE_WAVE=0: never (A/B runs;
// read per call, so one process can time both).
bool one_wave(const Args& a, int64_t rows, int dev) {
  if (!exl_pdl::env_on("EXL_CORE_ATTN_ONE_WAVE")) return false;
  const int64_t blocks = rows * a.Hkv * a.splits, sms = exl_pdl::device_sm(dev, false);
  return a.splits == 1 && blocks > kMinBlocks<1, false> * sms && blocks <= kMinBlocks<1, true> * sms;
}

template <typename T, int D, bool ROPE>
void launch_g(const Args& a, int64_t rows, int g, cudaStream_t stream, int dev) {
  if (g == 1 && one_wave(a, rows, dev)) launch<T, D, 1, true, ROPE>(a, rows, stream, dev);
  else if (g == 1) launch<T, D, 1, false, ROPE>(a, rows, stream, dev);
  else if (g == 2) launch<T, D, 2, false, ROPE>(a, rows, stream, dev);
  else if (g <= 4) launch<T, D, 4, false, ROPE>(a, rows, stream, dev);
  else launch<T, D, 8, false, ROPE>(a, rows, stream, dev);
}

template <typename T, bool ROPE>
void launch_d(const Args& a, int64_t rows, int D, int g, cudaStream_t stream, int dev) {
  if (D == 64) launch_g<T, 64, ROPE>(a, rows, g, stream, dev);
  else if (D == 128) launch_g<T, 128, ROPE>(a, rows, g, stream, dev);
  else launch_g<T, 256, ROPE>(a, rows, g, stream, dev);
}

// Splits merged in-kernel through a cluster (sm_90); EXL_CORE_ATTN_CLUSTER=0: the combine kernel (A/B runs).
bool cluster_merge_enabled(int dev) {
  static const bool on = exl_pdl::env_on("EXL_CORE_ATTN_CLUSTER");
  return on && exl_pdl::device_sm(dev, true) >= 9;
}

// The fewest keys a split gets: 64, or EXL_CORE_ATTN_SPLIT_KEYS (16..1024, read once; an A/B knob: at batch 1 of the
// bench's 7B, 256 keys of pages give 4 splits of 64 keys, 8 of 32 at 32).
int split_min_keys() {
  static const int keys = [] {
    const char* v = std::getenv("EXL_CORE_ATTN_SPLIT_KEYS");
    const long n = v ? std::strtol(v, nullptr, 10) : 64;
    return n >= 16 && n <= 1024 ? static_cast<int>(n) : 64;
  }();
  return keys;
}

// Keys per split and split count: enough blocks for ~4 per SM, at least split_min_keys() keys per split.
int pick_splits(int64_t rows, int64_t hkv, int64_t max_keys, int sms, int* chunk) {
  const int64_t base = rows * hkv;
  int64_t splits = (4LL * sms + base - 1) / base;
  const int64_t mk = split_min_keys();
  const int64_t most = (max_keys + mk - 1) / mk;
  if (splits > most) splits = most;
  if (splits < 1) splits = 1;
  int64_t c = (max_keys + splits - 1) / splits;
  c = (c + 15) / 16 * 16;
  splits = (max_keys + c - 1) / c;
  *chunk = static_cast<int>(c);
  return static_cast<int>(splits < 1 ? 1 : splits);
}

// The output's column map (OutMap, paged_attention_kernel.cuh): plain where out_pos is undefined, else out_pos /
// out_pos2 int32 [Hq * D] on q's GPU and out_cols columns.  Their values are the caller's contract (the kernel cannot
// check them without a host sync): ops/attention.py builds them once from o_proj's permutation and checks them there.
struct OutOrder {
  const at::Tensor* pos = nullptr;
  const at::Tensor* pos2 = nullptr;
  int64_t cols = 0;
};

OutMap out_map_of(const char* op, const OutOrder& order, const at::Tensor& q) {
  const int64_t width = q.size(1) * q.size(2);
  if (order.pos == nullptr || !order.pos->defined()) return OutMap{nullptr, nullptr, width};
  for (const at::Tensor* t : {order.pos, order.pos2}) {
    if (t == nullptr || !t->defined()) continue;
    TORCH_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->numel() == width && t->is_contiguous() &&
                    t->device() == q.device(),
                op, ": out_pos and out_pos2 must be contiguous int32 [Hq * D = ", width, "] on q's GPU, got ",
                t->sizes(), " ", t->scalar_type());
  }
  TORCH_CHECK(order.cols >= width && order.cols < (int64_t{1} << 31), op, ": out_cols ", order.cols,
              " must be at least Hq * D = ", width, " and below 2^31");
  const bool two = order.pos2 != nullptr && order.pos2->defined();
  return OutMap{order.pos->data_ptr<int>(), two ? order.pos2->data_ptr<int>() : nullptr, order.cols};
}

// rope: {k_new, v_new, cos_sin} for paged_attention_rope (checked by it), else empty.  order: the output's columns
// (plain: (T, Hq, D); with out_pos: (T, out_cols)).
at::Tensor paged_attention_impl(const char* op, const at::Tensor& q_, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_table_,
                                const at::Tensor& cu_seqlens_q_, const at::Tensor& seq_lens_k_, double scale,
                                int64_t window, std::initializer_list<const at::Tensor*> rope = {},
                                const OutOrder& order = OutOrder{}) {
  TORCH_CHECK(q_.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), op,
              ": q must be (T, Hq, D) and k/v caches (pages, page_size, Hkv, D), got ", q_.sizes(), ", ",
              k_cache.sizes(), ", ", v_cache.sizes());
  const int64_t D = q_.size(2), Hq = q_.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && (D == 64 || D == 128 || D == 256), op, ": head dim ", D,
              " (cache ", k_cache.size(3), "); the kernel takes 64, 128 or 256");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= 8, op, ": ", Hq, " query heads over ", Hkv,
              " kv heads; the kernel takes 1..8 query heads per kv head");
  TORCH_CHECK(q_.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (q_.scalar_type() == at::kHalf || q_.scalar_type() == at::kBFloat16),
              op, ": q and the caches must share dtype float16 or bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(0) > 0 && k_cache.size(1) > 0, op,
              ": caches must be contiguous and hold at least one slot");
  TORCH_CHECK(block_table_.scalar_type() == at::kInt && cu_seqlens_q_.scalar_type() == at::kLong &&
                  seq_lens_k_.scalar_type() == at::kLong && block_table_.dim() == 2,
              op, ": block_table int32 (S, W), cu_seqlens_q and seq_lens_k int64");
  const int64_t S = seq_lens_k_.size(0);
  TORCH_CHECK(cu_seqlens_q_.numel() == S + 1 && block_table_.size(0) == S, op, ": ", S,
              " sequences need cu_seqlens_q of ", S + 1, " and block_table of ", S, " rows");
  TORCH_CHECK(q_.is_cuda() && k_cache.device() == q_.device() && block_table_.device() == q_.device() &&
                  cu_seqlens_q_.device() == q_.device() && seq_lens_k_.device() == q_.device(),
              op, ": every tensor must be on the same GPU");
  TORCH_CHECK(v_cache.device() == q_.device(), op, ": v_cache must be on q's GPU");
  TORCH_CHECK(block_table_.size(1) * k_cache.size(1) < (int64_t{1} << 30), op,
              ": table width x page size must stay below 2^30 keys (32-bit key arithmetic)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(k_cache.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(v_cache.data_ptr()) % 16 == 0,
              op, ": caches must be 16-byte aligned (16-byte loads)");
  const c10::cuda::CUDAGuard guard(q_.device());
  auto q = q_.contiguous();
  if (reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 != 0) q = q.clone();   // 16-byte loads of q rows
  const OutMap out_map = out_map_of(op, order, q);
  const int64_t rows = q.size(0);
  auto out = out_map.pos == nullptr ? at::empty_like(q) : at::empty({rows, out_map.cols}, q.options());
  TORCH_CHECK(rows == 0 || S > 0, op, ": ", rows, " query rows but no sequence");
  if (rows == 0) return out;
  auto table = block_table_.contiguous(), cu = cu_seqlens_q_.contiguous(), lens = seq_lens_k_.contiguous();
  const int dev = q.device().index();
  auto stream = c10::cuda::getCurrentCUDAStream();

  Args a{};
  a.q = q.data_ptr();
  a.k = k_cache.data_ptr();
  a.v = v_cache.data_ptr();
  a.table = table.data_ptr<int>();
  a.cu_q = cu.data_ptr<int64_t>();
  a.lens = lens.data_ptr<int64_t>();
  a.out = out.data_ptr();
  a.out_map = out_map;
  a.S = static_cast<int>(S);
  a.W = static_cast<int>(table.size(1));
  a.page = static_cast<int>(k_cache.size(1));
  a.P = static_cast<int>(k_cache.size(0));
  a.Hq = static_cast<int>(Hq);
  a.Hkv = static_cast<int>(Hkv);
  a.window = static_cast<int>(window > 0 ? std::min<int64_t>(window, int64_t{1} << 30) : 0);   // wider = no window
  a.scale_log2 = static_cast<float>(scale) * kLog2e;
  const int64_t max_keys = std::max<int64_t>(1, static_cast<int64_t>(a.W) * a.page);
  a.splits = pick_splits(rows, Hkv, max_keys, exl_pdl::device_sm(dev, false), &a.chunk);
  // The cluster merge where the grid is about one wave (batch 1: 32 (row, kv head) pairs x 5 splits on the bench's
  // 7B). At batch 8 (256 pairs x 3 splits), with it on at every grid, decode measured ~1 % slower than with the
  // combine kernel, in A/Bs that also turned the rope fusion off (not separated); NOTES.md has the figures.
  const int sms = exl_pdl::device_sm(dev, false);
  a.cluster = a.splits > 1 && a.splits <= kMaxClusterSplits && rows * Hkv * a.splits <= 2 * sms &&
              cluster_merge_enabled(dev);
  // EXL_CORE_ATTN_HEAD_MAJOR=0 / EXL_CORE_ATTN_EARLY=0: row-major launch order / every read after the PDL wait (A/B).
  static const bool head_major_on = exl_pdl::env_on("EXL_CORE_ATTN_HEAD_MAJOR"),
                    early_on = exl_pdl::env_on("EXL_CORE_ATTN_EARLY");
  a.head_major = head_major_on && rows <= 65535;              // rows on grid y
  a.early = early_on;
  // Read per call (a getenv, no CUDA call: safe under capture), so one process can time both (decode_timeline.py
  // stage2_off); a captured graph keeps the value it was captured with.  Needs early: EXL_CORE_ATTN_EARLY=0 turns it
  // off too.  At batch 32 of the bench's 7B the one-wave instance runs, which has no STAGE2.
  a.stage2 = exl_pdl::env_on("EXL_CORE_ATTN_STAGE2");
  at::Tensor part_o, part_ml;
  if (a.splits > 1 && !a.cluster) {
    part_o = at::empty({a.splits, rows, Hq, D}, q.options().dtype(at::kFloat));
    part_ml = at::empty({a.splits, rows, Hq, 2}, q.options().dtype(at::kFloat));
    a.part_o = part_o.data_ptr<float>();
    a.part_ml = part_ml.data_ptr<float>();
  }
  const int g = static_cast<int>(Hq / Hkv);
  if (rope.size() == 3) {
    const at::Tensor* r[3];
    std::copy(rope.begin(), rope.end(), r);
    a.k_new = r[0]->data_ptr();
    a.v_new = r[1]->data_ptr();
    a.cos_sin = r[2]->data_ptr<float>();
    a.max_pos = r[2]->size(0);
    if (q.scalar_type() == at::kHalf) launch_d<__half, true>(a, rows, static_cast<int>(D), g, stream, dev);
    else launch_d<__nv_bfloat16, true>(a, rows, static_cast<int>(D), g, stream, dev);
  } else if (q.scalar_type() == at::kHalf) {
    launch_d<__half, false>(a, rows, static_cast<int>(D), g, stream, dev);
  } else {
    launch_d<__nv_bfloat16, false>(a, rows, static_cast<int>(D), g, stream, dev);
  }
  if (a.splits > 1 && !a.cluster) {
    const int threads = static_cast<int>(D);
    if (q.scalar_type() == at::kHalf)
      exl_pdl::launch_pdl(paged_attention_combine_kernel<__half>, dim3(static_cast<unsigned>(rows * Hq)), dim3(threads),
                          0, stream, dev, static_cast<const float*>(a.part_o), static_cast<const float*>(a.part_ml),
                          a.splits, rows * Hq, threads, a.Hq, out_map, static_cast<__half*>(a.out));
    else
      exl_pdl::launch_pdl(paged_attention_combine_kernel<__nv_bfloat16>, dim3(static_cast<unsigned>(rows * Hq)),
                          dim3(threads), 0, stream, dev, static_cast<const float*>(a.part_o),
                          static_cast<const float*>(a.part_ml), a.splits, rows * Hq, threads, a.Hq, out_map,
                          static_cast<__nv_bfloat16*>(a.out));
  }
  return out;
}

at::Tensor paged_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                                const at::Tensor& seq_lens_k, double scale, int64_t window) {
  return paged_attention_impl("exl_core::paged_attention (CUDA)", q, k_cache, v_cache, block_table, cu_seqlens_q,
                              seq_lens_k, scale, window);
}

// Decode's rope, K/V write and attention in one launch (ROPE instances above): q (T, Hq, D), k and v (T, Hkv, D) as the
// projections leave them; every sequence has at most one query row (the caller's max_q_len == 1: the kernel cannot
// check it), at position seq_lens_k - 1, and its key goes to that position's slot in block_table -- the positions and
// slots rope_kv_write would be given.  Equals rope_kv_write, then paged_attention, bit for bit (tested).
// out_pos (and out_pos2, out_cols): the output's columns in o_proj's act-order, (T, out_cols) (OutOrder above).
at::Tensor paged_attention_rope_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& cos_sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                                     const at::Tensor& seq_lens_k, double scale, int64_t window,
                                     const c10::optional<at::Tensor>& out_pos,
                                     const c10::optional<at::Tensor>& out_pos2, int64_t out_cols) {
  const char* op = "exl_core::paged_attention_rope (CUDA)";
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && k_cache.dim() == 4 && k.size(1) == k_cache.size(2),
              op, ": q (T, Hq, D), k and v (T, Hkv, D) matching the cache, got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == q.scalar_type() && t->device() == q.device() &&
                    reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                op, ": q, k and v must be contiguous, 16-byte aligned and of one dtype on one GPU");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.dim() == 2 && cos_sin.size(1) == q.size(2) &&
                  cos_sin.is_contiguous() && cos_sin.device() == q.device() &&
                  reinterpret_cast<uintptr_t>(cos_sin.data_ptr()) % 16 == 0,
              op, ": cos_sin must be contiguous, 16-byte aligned float32 [P, D] on q's GPU");
  OutOrder order;
  if (out_pos.has_value()) order = OutOrder{&*out_pos, out_pos2.has_value() ? &*out_pos2 : nullptr, out_cols};
  return paged_attention_impl(op, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, window,
                              {&k, &v, &cos_sin}, order);
}

int64_t paged_attention_cuda_splits(int64_t rows, int64_t hkv, int64_t max_keys, int64_t device) {
  int chunk = 0;
  return pick_splits(rows, hkv, std::max<int64_t>(1, max_keys), exl_pdl::device_sm(static_cast<int>(device), false),
                     &chunk);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("paged_attention_cuda_splits(int rows, int hkv, int max_keys, int device) -> int",
        &paged_attention_cuda_splits);
  m.def("paged_attention_rope(Tensor q, Tensor k, Tensor v, Tensor cos_sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor block_table, Tensor cu_seqlens_q, Tensor seq_lens_k, float scale, int window, Tensor? out_pos=None, "
        "Tensor? out_pos2=None, int out_cols=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl_core, CUDA, m) {
  m.impl("paged_attention", &paged_attention_cuda);
  m.impl("paged_attention_rope", &paged_attention_rope_cuda);
}
