// The device half of programmatic dependent launch (see pdl.cuh for the contract), without torch headers so
// standalone probes build kernels that use it.  Both are no-ops below sm_90 and when the kernel was launched
// without the attribute.
#pragma once

namespace exl_pdl {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace exl_pdl
