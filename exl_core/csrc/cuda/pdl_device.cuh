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

// Where a kernel lets its dependant launch (EXL_PDL_EARLY, default 1): a kernel calls pdl_trigger_early() as its first
// statement and pdl_trigger_late() right after its pdl_wait(); one of the two is the trigger.  Early, the next launch
// is scheduled as soon as every block of this one is resident, not once they are all past their wait -- so with one
// wave its blocks sit beside this one's and have their weights (load-time data) in flight through this kernel's tail
// (bench/persist_probe.cu F/G: four read-only launches a layer, 31.92 against 34.72 us a layer).  The contract of
// pdl.cuh keeps completion transitive either way: nothing but load-time data is read, and nothing is written, before
// a kernel's wait, and its wait returns only once the kernel before it has completed.
#ifndef EXL_PDL_EARLY
#define EXL_PDL_EARLY 1
#endif

__device__ __forceinline__ void pdl_trigger_early() {
#if EXL_PDL_EARLY
  pdl_trigger();
#endif
}

__device__ __forceinline__ void pdl_trigger_late() {
#if !EXL_PDL_EARLY
  pdl_trigger();
#endif
}

}  // namespace exl_pdl
