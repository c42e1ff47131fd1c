// The prompt's dequantise writes W (a weight, or a column slice of one, in fp16) and the cuBLAS GEMM right after
// reads it, once per 128-row tile of x.  Between the GEMMs, whose x and y fill L2, W's lines were evicted before
// the GEMM read them: written back to DRAM and read in again.  Launched with an access-policy window over W, its
// lines persist in L2's set-aside until the GEMM has read them and the next slice overwrites them in place.
// bench/dequant_probe.cu `l2` (H200, four 7B layers a graph, the extension's slicing, us a layer): dequantise +
// GEMMs 1,582.50-1,625.39 -> 1,357.84-1,384.80 (GPTQ), 1,634.74-1,672.09 -> 1,404.97-1,411.98 (the rewritten EXL2).
// The caller asks per launch (qdequant_chunks' l2; ops/cuda_dequant.py DEQUANT_L2, EXL_CORE_DEQUANT_L2=1 on).
// Off by default: in the bench (stop 42 call 1, one process each) the prompt read GPTQ 43,900.9 against 43,707.2 off
// (1.0044x), EXL2 42,965.2 against 44,578.7 (0.9638x), and decode slower (batch 32 7,938.1 / 7,424.0 against
// 8,243.1 / 7,629.2; the 128-token prompt before it raises the set-aside): the set-aside and the last W's
// persisting lines shrink the L2 that everything else runs in.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

namespace exl_l2 {

struct SetAside {
  size_t bytes[64];
  bool asked[64];
};
inline SetAside& set_aside() {
  static SetAside s{};
  return s;
}

// Bytes of L2 set aside for persisting lines on device `dev` (the current device): raised to the device's maximum
// on first use; 0 where the device has none or the limit cannot be set.
inline size_t persist_bytes(int dev) {
  SetAside& s = set_aside();
  if (dev < 0 || dev >= 64) return 0;
  if (!s.asked[dev]) {
    size_t have = 0;
    int max = 0;
    if (cudaDeviceGetAttribute(&max, cudaDevAttrMaxPersistingL2CacheSize, dev) == cudaSuccess && max > 0 &&
        cudaDeviceGetLimit(&have, cudaLimitPersistingL2CacheSize) == cudaSuccess &&
        (have >= static_cast<size_t>(max) ||
         cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, static_cast<size_t>(max)) == cudaSuccess) &&
        cudaDeviceGetLimit(&have, cudaLimitPersistingL2CacheSize) == cudaSuccess) {
      s.bytes[dev] = have;
    }
    (void)cudaGetLastError();   // a refusal above only means no window
    s.asked[dev] = true;
  }
  return s.bytes[dev];
}

// Every persisting line of the current device `dev` back to normal and its set-aside back to 0 (raised again by the
// next window): L2 whole for what runs next (A/B timings in one process).  Not stream-ordered.
inline cudaError_t release(int dev) {
  cudaError_t e = cudaCtxResetPersistingL2Cache();
  if (e == cudaSuccess) e = cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 0);
  if (dev >= 0 && dev < 64) set_aside().asked[dev] = false;
  return e;
}

// A launch attribute: the `bytes` at `base` persisting in L2 (as much of them as the set-aside holds); false where
// the device has no set-aside (then launch without it).
inline bool window(cudaLaunchAttribute& attr, void* base, size_t bytes, int dev) {
  const size_t persist = persist_bytes(dev);
  int max_window = 0;
  if (!persist || !bytes ||
      cudaDeviceGetAttribute(&max_window, cudaDevAttrMaxAccessPolicyWindowSize, dev) != cudaSuccess || max_window <= 0)
    return false;
  attr.id = cudaLaunchAttributeAccessPolicyWindow;
  cudaAccessPolicyWindow& w = attr.val.accessPolicyWindow;
  w.base_ptr = base;
  w.num_bytes = std::min(bytes, static_cast<size_t>(max_window));
  w.hitRatio = std::min(1.f, static_cast<float>(persist) / static_cast<float>(w.num_bytes));
  w.hitProp = cudaAccessPropertyPersisting;
  w.missProp = cudaAccessPropertyNormal;
  return true;
}

}  // namespace exl_l2
