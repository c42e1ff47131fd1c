// Programmatic dependent launch (sm_90): a kernel launched with the attribute may start while the
// kernel before it in the stream is still running.  Decode runs ~11 small kernels per layer, each
// paying launch latency and a drain before the next could begin; with PDL the next kernel's blocks
// are resident early and its weight loads (data fixed at load time) overlap the previous kernel.
//
// Contract for every kernel launched through launch_pdl: call pdl_wait() before the first read of
// anything an earlier kernel may write (activations, outputs, K/V) and before the first global
// write; pdl_wait() returns once the previous grid has completed and its writes are visible, so
// completion stays transitive along the stream.  Reads before pdl_wait() are allowed only for data
// that the kernel immediately before in the stream does not write: the decode kernels read their
// weights (qweight, chunk table) there, which the library writes by copies at load time, never by the
// kernel right before a matmul; paged_attention reads the sequences' lengths, tables and the K/V of keys older than
// its rows there, so the kernel before it may write only the rows' own K/V slots (the library's K/V writes do;
// paged_attention_rope writes those slots itself, after its wait); the norm kernel reads a model's RMSNorm weight there
// only when the caller says no kernel writes it (exl_core::rms_norm_static).  (Each
// of our kernels triggers only after its own wait, so a kernel's
// early reads can overlap only its direct predecessor.)  A caller that builds weights with a GPU kernel
// and calls torch.ops.exl_core.qgemm_* straight after must put a sync or a non-PDL op in between.  pdl_trigger() lets the next kernel launch
// (it still waits for this one's completion in its own pdl_wait()).
// EXL_CORE_PDL=0 turns the attribute off (A/B timing, debugging); kernels then run serialized.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include "pdl_device.cuh"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace exl_pdl {

// Device attributes the launch policies read, fetched once per device: every value is stored before the flag that says
// they are there (release / acquire), so a concurrent first caller fetches them again rather than reading a
// half-filled entry.
enum DeviceAttr { kCcMajor, kSmCount, kSmemPerSm, kSmemReservedPerBlock, kDeviceAttrs };
inline int device_attr(int dev, DeviceAttr a) {
  static int vals[64][kDeviceAttrs] = {};
  static std::atomic<bool> ready[64] = {};
  if (dev < 0 || dev >= 64) dev = 0;
  if (!ready[dev].load(std::memory_order_acquire)) {
    static const cudaDeviceAttr ids[kDeviceAttrs] = {
        cudaDevAttrComputeCapabilityMajor, cudaDevAttrMultiProcessorCount, cudaDevAttrMaxSharedMemoryPerMultiprocessor,
        cudaDevAttrReservedSharedMemoryPerBlock};
    for (int i = 0; i < kDeviceAttrs; ++i) {
      int v = 0;
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, ids[i], dev));
      vals[dev][i] = v;
    }
    ready[dev].store(true, std::memory_order_release);
  }
  return vals[dev][a];
}

// The device's compute-capability major (want_major) or multiprocessor count.
inline int device_sm(int dev, bool want_major) { return device_attr(dev, want_major ? kCcMajor : kSmCount); }

// An A/B switch of the kernels: on unless the environment variable `name` is "0".
inline bool env_on(const char* name) {
  const char* v = std::getenv(name);
  return !(v && std::strcmp(v, "0") == 0);
}

// PDL on for this device: sm_90 or newer and EXL_CORE_PDL not "0".
inline bool pdl_enabled(int dev) {
  static const bool on = env_on("EXL_CORE_PDL");
  return on && device_sm(dev, true) >= 9;
}

// cudaLaunchKernelEx with `cfg` (grid, block, smem, stream and up to one attribute already set)
// plus the programmatic-serialization attribute where PDL is on.
template <typename Kern, typename... Args>
void launch_ex(cudaLaunchConfig_t cfg, int dev, Kern* kern, Args... args) {
  cudaLaunchAttribute attrs[2];
  unsigned n = 0;
  for (unsigned i = 0; i < cfg.numAttrs && n < 1; ++i) attrs[n++] = cfg.attrs[i];
  if (pdl_enabled(dev)) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, args...));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// kern<<<grid, block, smem, stream>>>(args...) with PDL where it is on.
template <typename Kern, typename... Args>
void launch_pdl(Kern* kern, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int dev, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  launch_ex(cfg, dev, kern, args...);
}

}  // namespace exl_pdl
