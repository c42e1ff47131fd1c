// exl_core::kv_write: a step's new keys and values into their cache slots, both in one launch.
// The torch path (two index_copy_ kernels) costs two launches per layer and decode runs ~10 small
// kernels per layer, so at batch 1 the launch count is what the step pays for. Each thread moves 16
// bytes of one row of k and the same 16 bytes of v; dtype-agnostic (rows are copied as bytes).
// Rows that are not 16-byte aligned multiples of 16 bytes, or k/v of another dtype than the cache, go
// through index_copy_ here (one place decides). Slots outside the cache are skipped by the kernel, where
// index_copy_ would raise (ops/attention.write_kv only sends slots of its own page tables).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "pdl.cuh"

namespace {

__global__ void kv_write_kernel(const uint4* __restrict__ k, int64_t k_row, const uint4* __restrict__ v, int64_t v_row,
                                const int64_t* __restrict__ slots, int64_t rows, int64_t vecs, int64_t num_slots,
                                uint4* __restrict__ kc, uint4* __restrict__ vc) {
  exl_pdl::pdl_wait();           // k (rope) and v (the projection) come from the kernels just before
  exl_pdl::pdl_trigger();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * vecs) return;
  const int64_t r = i / vecs, c = i - r * vecs;
  const int64_t slot = slots[r];
  if (slot < 0 || slot >= num_slots) return;
  kc[slot * vecs + c] = k[r * k_row + c];
  vc[slot * vecs + c] = v[r * v_row + c];
}

void kv_write_cuda(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& slots) {
  const char* op = "exl_core::kv_write (CUDA)";
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              op, ": caches must be contiguous (pages, page_size, Hkv, D) of one shape and dtype");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              op, ": k, v must be (T, Hkv, D) matching the cache, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k.size(0), op,
              ": slots must be int64 [T]");
  TORCH_CHECK(k.device() == k_cache.device() && v.device() == k_cache.device() && slots.device() == k_cache.device() &&
                  v_cache.device() == k_cache.device(),
              op, ": every tensor must be on the cache's GPU");
  const int64_t es = k_cache.element_size(), D = k.size(2), H = k.size(1);
  const int64_t row_bytes = H * D * es;
  auto rows_ok = [&](const at::Tensor& t) {
    return t.scalar_type() == k_cache.scalar_type() && t.stride(2) == 1 && t.stride(1) == D &&
           (t.stride(0) * es) % 16 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  const c10::cuda::CUDAGuard guard(k_cache.device());
  if (row_bytes % 16 != 0 || !rows_ok(k) || !rows_ok(v)) {      // other layouts and dtypes: torch's copy
    k_cache.view({-1, H, D}).index_copy_(0, slots, k.to(k_cache.scalar_type()));
    v_cache.view({-1, H, D}).index_copy_(0, slots, v.to(k_cache.scalar_type()));
    return;
  }
  const int64_t rows = k.size(0), vecs = row_bytes / 16;
  if (rows == 0) return;
  const int64_t n = rows * vecs;
  const int threads = 256;
  exl_pdl::launch_pdl(kv_write_kernel, dim3(static_cast<unsigned>((n + threads - 1) / threads)), dim3(threads), 0,
                      c10::cuda::getCurrentCUDAStream(), k_cache.device().index(),
                      static_cast<const uint4*>(k.data_ptr()), k.stride(0) * es / 16,
                      static_cast<const uint4*>(v.data_ptr()), v.stride(0) * es / 16, slots.data_ptr<int64_t>(), rows,
                      vecs, k_cache.size(0) * k_cache.size(1), static_cast<uint4*>(k_cache.data_ptr()),
                      static_cast<uint4*>(v_cache.data_ptr()));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("kv_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(exl_core, CUDA, m) { m.impl("kv_write", &kv_write_cuda); }
