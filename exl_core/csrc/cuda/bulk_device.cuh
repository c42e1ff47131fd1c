// Bulk copies global -> shared by the Hopper copy engine (cp.async.bulk, no tensor map) waited on by an mbarrier,
// without torch headers (standalone probes build the kernels that use them).  Only on sm_90+: elsewhere they trap,
// and the host never selects an instance that uses them (qgemm_kslice's bulk weights).
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace exl_bulk {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// One arrival expected per phase (the thread that posts the phase's byte count).
__device__ __forceinline__ void bar_init(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bar)) : "memory");
#else
  __trap();
#endif
}

// After the inits, before the copy engine signals the barriers.
__device__ __forceinline__ void bar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Arrives on the barrier and adds `bytes` to the bytes its phase waits for (the copies may land before or after).
__device__ __forceinline__ void bar_expect(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#else
  __trap();
#endif
}

// Until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void bar_wait(uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#else
  __trap();
#endif
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared, completing on `bar`; the source
// is streamed once (L2 evict-first), so it does not push activations out of L2.
__device__ __forceinline__ void copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .b64 pol;\n"
      "createpolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], pol;\n"
      "}\n" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
#else
  __trap();
#endif
}

}  // namespace exl_bulk
