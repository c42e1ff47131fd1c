// What a persistent decode kernel could gain at batch 1: the read floor of a layer's four projection streams
// (q/k/v -> o -> gate/up -> down, GPTQ 4-bit g128 7B bytes: words, fp32 scale and zero) as four launches with
// programmatic dependent launch -- the shape of today's step, whose read floor the GEMV probe measured at 35.59 us a
// layer (gemv_probe_h200.json) -- against one kernel whose blocks stay resident and pass grid barriers between the
// stages (where a real kernel's activations are ready), without and with the next stage's first loads issued
// before the barrier (weights do not depend on activations).
//   nvcc -O3 -arch=sm_90 -o /tmp/persist_probe bench/persist_probe.cu && /tmp/persist_probe
// (bench/gpu.sh phase `persist`.)  Every figure: 8 layers of distinct buffers (~911 MB, beyond the 50 MB L2) in one
// CUDA graph, median of 10 replays, us per layer and GB/s = bytes read / time.  Read-only kernels: they xor what
// they load into a value no one reads (kept by a never-true store).  The barrier: one counter per replay (zeroed by
// a memset node), each block's thread 0 adds 1 after a __threadfence and spins on an acquire load until all blocks
// of the stage have arrived; the grid is sized from the occupancy calculator so that every block is resident.
// Stop 48 (bench/results/persist_probe_h200_stop48_call{1,5,6,7}_*.jsonl), us a layer: A 35.19-35.24, E 27.47-27.68,
// F' 30.90-31.00; H (bulk copies of up to 200 KB before each barrier) 36.47-37.10 against H0's 36.83-37.03 (at most
// 0.55 less); I and I' (chunks by counter) 36.89-37.14, so a barrier's ~2.3 us is not the wait for the slowest fixed
// share; J (the next chunk's loads issued between the arrival and the wait) 32.37-32.44, Js (plus a block's stores
// before each arrival) 32.74: loads issued after the arrival recover ~1.1 us a barrier (the fence or the
// __syncthreads before it waiting for loads issued just before them; not separated).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "../exl_core/csrc/cuda/cp_async_device.cuh"   // cp_async16, cp_async_wait_all
#include "../exl_core/csrc/cuda/tma_device.cuh"        // mbarriers (H)
#include "probe_common.cuh"   // CK, time_seq, pdl_config

constexpr int kLayers = 8, kStages = 4, kThreads = 512;

// Bytes of the four streams of one layer (hidden 4096, intermediate 11008, groups of 128 rows).
int64_t stage_bytes(int s) {
  const int64_t H = 4096, I = 11008;
  auto w = [](int64_t K, int64_t N) { return K * N / 2 + 2 * (K / 128) * N * 4; };
  switch (s) {
    case 0: return 3 * w(H, H);      // q, k, v
    case 1: return w(H, H);          // o
    case 2: return 2 * w(H, I);      // gate, up
    default: return w(I, H);         // down
  }
}

struct Streams {
  const int4* p[kLayers * kStages];
  int64_t n[kLayers * kStages];      // int4 elements
};

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The grid barrier in two halves (J): the arrival (a fence, which waits for this thread's earlier loads too, then the
// count) and the wait for barrier number k's last arrival, so loads issued between them are not waited for by the
// fence.
__device__ __forceinline__ void grid_arrive(unsigned* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
  }
}
__device__ __forceinline__ void grid_wait(const unsigned* counter, unsigned k) {
  if (threadIdx.x == 0) {
    const unsigned target = (k + 1) * gridDim.x;
    while (ld_acquire(counter) < target) {
    }
  }
  __syncthreads();
}

// All blocks of the grid past barrier number `k` (counter counts arrivals since the replay's memset).
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned k) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    const unsigned target = (k + 1) * gridDim.x;
    while (ld_acquire(counter) < target) {
    }
  }
  __syncthreads();
}

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// One stream, grid-stride with U 16-byte loads in flight a thread; `first` (U loads of this stream, already issued
// by the caller when `have_first`) lets a caller put the first pass before a wait.
template <int U>
__device__ __forceinline__ int read_stream(const int4* __restrict__ p, int64_t n, int4 (&first)[U], bool have_first) {
  const int64_t T = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int acc = 0;
  if (!have_first) {
#pragma unroll
    for (int u = 0; u < U; ++u) first[u] = i + u * T < n ? __ldg(p + i + u * T) : make_int4(0, 0, 0, 0);
  }
  int4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) v[u] = first[u];
  i += U * T;
  for (; i + (U - 1) * T < n; i += U * T) {
    int4 nx[U];
#pragma unroll
    for (int u = 0; u < U; ++u) nx[u] = __ldg(p + i + u * T);
#pragma unroll
    for (int u = 0; u < U; ++u) { acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w; v[u] = nx[u]; }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  for (; i < n; i += T) { const int4 x = __ldg(p + i); acc ^= x.x ^ x.y ^ x.z ^ x.w; }
  return acc;
}

template <int U>
__device__ __forceinline__ void first_pass(const int4* __restrict__ p, int64_t n, int4 (&first)[U]) {
  const int64_t T = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
#pragma unroll
  for (int u = 0; u < U; ++u) first[u] = i + u * T < n ? __ldg(p + i + u * T) : make_int4(0, 0, 0, 0);
}

// A: one launch per stream (PDL): the first pass before the wait, as the extension's kernels load weights.
template <int U>
__global__ void __launch_bounds__(kThreads) stage_kernel(const int4* __restrict__ p, int64_t n, int* out) {
  int4 first[U];
  first_pass<U>(p, n, first);
  pdl_wait();
  pdl_trigger();
  const int acc = read_stream<U>(p, n, first, true);
  if (acc == 0x12345678) out[0] = acc;
}

// B/C/D: streams [s0, s1) in one kernel, a grid barrier before each stream but the first (barrier numbers from
// bar0); PREFETCH: the stream's first pass is issued before its barrier.  E (BARRIERS false): no barriers at all.
template <int U, bool PREFETCH, bool BARRIERS = true>
__global__ void __launch_bounds__(kThreads) persist_kernel(const Streams st, int s0, int s1, unsigned* counter,
                                                           unsigned bar0, int* out) {
  int acc = 0;
  int4 first[U];
  first_pass<U>(st.p[s0], st.n[s0], first);
  pdl_wait();
  pdl_trigger();
  for (int s = s0; s < s1; ++s) {
    if (s > s0) {
      if (PREFETCH) first_pass<U>(st.p[s], st.n[s], first);
      if (BARRIERS) grid_barrier(counter, bar0 + static_cast<unsigned>(s - s0 - 1));
    }
    acc ^= read_stream<U>(st.p[s], st.n[s], first, s == s0 || PREFETCH);
  }
  if (acc == 0x12345678) out[0] = acc;
}

// F/G: one launch per stream, one block an SM owning a contiguous share, whose first PRE x 512 16-byte loads go
// into shared memory by cp.async before the PDL wait (up to 96 KB an SM, against the 64 KB of A's registers).
// Launch bounds give two blocks an SM, so the next stream's block is resident while this one streams: with
// EARLY (F) each block triggers its dependents before its own wait, so the next launch's blocks take the SM's second
// slot at once and have their prefetch in flight through this stream's tail; G triggers after the wait, as the
// extension does today.  Stop 40 call 2 (bench/results/persist_probe_h200_stop40_call2.jsonl), us a layer: A 35.18,
// F' (48 KB) 30.63, G 34.41, E 27.05.
template <int PRE, bool EARLY>
__global__ void __launch_bounds__(kThreads, 2) staged_kernel(const int4* __restrict__ p, int64_t n, int* out) {
  extern __shared__ int4 sm[];
  if (EARLY) pdl_trigger();
  const int64_t per = (n + gridDim.x - 1) / gridDim.x;
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * per, b1 = b0 + per < n ? b0 + per : n;
#pragma unroll
  for (int u = 0; u < PRE; ++u) {
    const int64_t i = b0 + u * kThreads + threadIdx.x;
    if (i < b1) cp_async16(sm + u * kThreads + threadIdx.x, p + i);
  }
  pdl_wait();
  if (!EARLY) pdl_trigger();
  int acc = xor_stream<8>(p, b0 + static_cast<int64_t>(PRE) * kThreads + threadIdx.x, b1, kThreads);
  cp_async_wait_all();
#pragma unroll
  for (int u = 0; u < PRE; ++u)
    if (b0 + u * kThreads + threadIdx.x < b1) {
      const int4 x = sm[u * kThreads + threadIdx.x];
      acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
  if (acc == 0x12345678) out[0] = acc;
}

// H: one resident kernel for 8 layers, one block an SM owning a contiguous share of every stream.  At the end of each
// stage (and before the PDL wait, for the first) thread 0 starts one bulk copy (cp.async.bulk, the copy engine) of the
// first PRE16 16-byte units of the block's share of the next stage into shared memory, completing on an mbarrier;
// then the grid barrier.  So the next stage's bytes stream through this stage's tail and the barrier, as F's early
// launches do across launch boundaries, without a second block an SM.  After the barrier the block reads the rest of
// its share from global memory (8 loads in flight a thread), then waits for the copy and reads the staged part.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   exl_tma::smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(exl_tma::smem_addr(bar))
               : "memory");
}

__global__ void __launch_bounds__(kThreads, 1) bulk_kernel(const Streams st, int s0, int s1, unsigned* counter,
                                                           unsigned bar0, int64_t pre16, int* out) {
  extern __shared__ __align__(128) int4 smb[];
  __shared__ uint64_t bar;
  auto share = [&](int s, int64_t& b0, int64_t& b1) {
    const int64_t per = (st.n[s] + gridDim.x - 1) / gridDim.x;
    b0 = static_cast<int64_t>(blockIdx.x) * per;
    b1 = b0 + per < st.n[s] ? b0 + per : st.n[s];
    if (b0 > b1) b0 = b1;
  };
  auto staged = [&](int s) {
    int64_t b0, b1;
    share(s, b0, b1);
    return b1 - b0 < pre16 ? b1 - b0 : pre16;
  };
  auto issue = [&](int s) {                                   // thread 0: the next stage's first units
    if (threadIdx.x != 0) return;
    int64_t b0, b1;
    share(s, b0, b1);
    const int64_t k = staged(s);
    if (k > 0) {
      exl_tma::mbar_arrive_expect(&bar, static_cast<uint32_t>(k * 16));
      bulk_g2s(smb, st.p[s] + b0, static_cast<uint32_t>(k * 16), &bar);
    } else {
      exl_tma::mbar_arrive(&bar);
    }
  };
  if (threadIdx.x == 0) {
    exl_tma::mbar_init(&bar, 1);
    exl_tma::mbar_init_fence();
  }
  __syncthreads();
  issue(s0);
  pdl_wait();
  pdl_trigger();
  uint32_t phase = 0;
  int acc = 0;
  for (int s = s0; s < s1; ++s) {
    if (s > s0) grid_barrier(counter, bar0 + static_cast<unsigned>(s - s0 - 1));
    int64_t b0, b1;
    share(s, b0, b1);
    const int64_t k = staged(s);
    acc ^= xor_stream<8>(st.p[s], b0 + k + threadIdx.x, b1, kThreads);
    exl_tma::mbar_wait(&bar, phase);
    phase ^= 1;
    for (int64_t i = threadIdx.x; i < k; i += kThreads) {
      const int4 x = smb[i];
      acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
    __syncthreads();                                          // the buffer is read before the next copy fills it
    if (s + 1 < s1) issue(s + 1);
  }
  if (acc == 0x12345678) out[0] = acc;
}

// I: one kernel for 8 layers (grid sized from the occupancy calculator, as C/D), each stage's stream taken in chunks
// of kThreads x U 16-byte units (64 KB at U 8) handed out by an atomic counter per stage (zeroed by a memset node per
// replay), so a block that reads fast takes more chunks and a stage ends when its last chunk is read, not when the
// slowest block's fixed share is (C/D/H own fixed shares).  Thread 0 asks for the chunk after next while the block
// reads this chunk and loads the next one (a ring of 4 indices in shared memory, one __syncthreads a chunk).  The
// question: is the ~2.3 us a barrier costs in C/D/H the barrier's own latency, or the wait for the slowest fixed
// share?  BARRIERS false: the same chunks without barriers (against E).  NEXT: before each barrier the block takes a
// chunk of the next stage and has its loads in flight through the barrier (weights do not depend on activations).
// SPLIT (J, with NEXT): those loads issued after the block's arrival and before its wait (grid_arrive / grid_wait), so
// the arrival's fence does not wait for them.  STORES (Js): before each arrival the block's first warp stores 128 bytes
// (a stage's outputs, which the fence must make visible before the count, as a real kernel's would).
// DEFER0 (K, with NEXT and a combined barrier): warp 0, whose thread 0 runs the fence, loads its part of the next
// chunk only after the barrier; the other warps load theirs before it, as in I'.  Near J: the fence waited for
// thread 0's own loads; near I': something else (the __syncthreads, the other warps' loads) did.  Stop 49 call 1
// (bench/results/persist_probe_h200_stop49_call1_1dd63da.txt): K 35.81 against I' 36.92 and J 32.53 us a layer, so
// warp 0's loads (the fence's warp) explain ~1.1 of the 4.39 us J saves over I'; the rest waits elsewhere (not
// separated further).
template <int U, bool BARRIERS, bool NEXT, bool SPLIT = false, bool STORES = false, bool DEFER0 = false>
__global__ void __launch_bounds__(kThreads) dyn_kernel(const Streams st, int s0, int s1, unsigned* counter,
                                                       unsigned bar0, unsigned* chunk_ctr, int* out) {
  __shared__ unsigned slot[4];
  constexpr int64_t C = static_cast<int64_t>(kThreads) * U;
  int acc = 0;
  int4 cur[U];
  auto load = [&](int s, unsigned c, int4 (&v)[U]) {
    const int64_t base = static_cast<int64_t>(c) * C + threadIdx.x, n = st.n[s];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kThreads;
      v[u] = i < n ? __ldg(st.p[s] + i) : make_int4(0, 0, 0, 0);
    }
  };
  auto chunks = [&](int s) { return static_cast<unsigned>((st.n[s] + C - 1) / C); };
  // the stage's first two chunk indices (slot 0 and 1), and cur loaded from slot 0
  auto start = [&](int s, bool warp0_loads = true) {
    __syncthreads();                          // every warp has read the slots (Inb can reach here with no barrier)
    if (threadIdx.x == 0) {
      slot[0] = atomicAdd(chunk_ctr + s, 1u);
      slot[1] = atomicAdd(chunk_ctr + s, 1u);
    }
    __syncthreads();
    const unsigned c = slot[0];
    if (c < chunks(s) && (warp0_loads || threadIdx.x >= 32)) load(s, c, cur);
    return c;
  };
  pdl_wait();
  pdl_trigger();
  unsigned c = start(s0);
  for (int s = s0; s < s1; ++s) {
    const unsigned nch = chunks(s);
    for (int k = 0; c < nch; ++k) {
      const unsigned cn = slot[(k + 1) & 3];
      if (threadIdx.x == 0) slot[(k + 2) & 3] = atomicAdd(chunk_ctr + s, 1u);
      int4 nx[U];
      if (cn < nch) load(s, cn, nx);
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= cur[u].x ^ cur[u].y ^ cur[u].z ^ cur[u].w;
#pragma unroll
      for (int u = 0; u < U; ++u) cur[u] = nx[u];
      c = cn;
      __syncthreads();
    }
    if (s + 1 == s1) break;
    if (STORES && threadIdx.x < 32)
      out[1 + (static_cast<int64_t>(s) * gridDim.x + blockIdx.x) * 32 + threadIdx.x] = acc;
    if (NEXT && SPLIT && BARRIERS) {
      grid_arrive(counter);
      c = start(s + 1);
      grid_wait(counter, bar0 + static_cast<unsigned>(s - s0));
    } else if (NEXT) {
      c = start(s + 1, !DEFER0);              // the next stage's first chunk in flight through the barrier
      if (BARRIERS) grid_barrier(counter, bar0 + static_cast<unsigned>(s - s0));
      if (DEFER0 && threadIdx.x < 32 && c < chunks(s + 1)) load(s + 1, c, cur);
    } else {
      if (BARRIERS) grid_barrier(counter, bar0 + static_cast<unsigned>(s - s0));
      c = start(s + 1);
    }
  }
  if (acc == 0x12345678) out[0] = acc;
}

int main() {
  cudaDeviceProp prop;
  const int sms = probe_device(prop);
  Streams st{};
  int64_t layer_bytes = 0;
  for (int s = 0; s < kStages; ++s) layer_bytes += stage_bytes(s);
  for (int l = 0; l < kLayers; ++l)
    for (int s = 0; s < kStages; ++s) {
      const int64_t b = stage_bytes(s);
      void* d;
      CK(cudaMalloc(&d, b));
      CK(cudaMemset(d, (l * 4 + s) & 0x7f, b));
      st.p[l * kStages + s] = static_cast<const int4*>(d);
      st.n[l * kStages + s] = b / 16;
    }
  int* out;
  unsigned* counter;
  CK(cudaMalloc(&out, (1 + static_cast<size_t>(kLayers) * kStages * 8 * sms * 32) * 4));   // Js's stores
  CK(cudaMalloc(&counter, 4));
  printf("GPU %s, %d SMs; a layer reads %.2f MB (q/k/v %.2f, o %.2f, gate/up %.2f, down %.2f)\n", prop.name, sms,
         layer_bytes / 1e6, stage_bytes(0) / 1e6, stage_bytes(1) / 1e6, stage_bytes(2) / 1e6, stage_bytes(3) / 1e6);

  constexpr int U = 8;
  auto report = [&](const char* name, int blocks, float us) {
    const float per_layer = us / kLayers;
    printf("%-44s blocks %4d  %8.2f us/layer  %6.0f GB/s\n", name, blocks, per_layer, layer_bytes / per_layer / 1e3);
    printf("JSON {\"variant\": \"%s\", \"blocks\": %d, \"us_per_layer\": %.2f, \"gb_s\": %.0f}\n", name, blocks,
           per_layer, layer_bytes / per_layer / 1e3);
  };
  cudaLaunchAttribute attr[1];
  int occ = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, stage_kernel<U>, kThreads, 0));
  const int grid_a = sms * occ;
  report("A: 4 launches a layer (PDL)", grid_a, time_seq([&](cudaStream_t s) {
    for (int i = 0; i < kLayers * kStages; ++i) {
      cudaLaunchConfig_t cfg = pdl_config(dim3(grid_a), dim3(kThreads), 0, s, attr);
      CK(cudaLaunchKernelEx(&cfg, stage_kernel<U>, st.p[i], st.n[i], out));
    }
  }));

  auto persist = [&](const char* name, auto kern, int per_launch) {
    int o = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, kern, kThreads, 0));
    const int grid = sms * o;                       // every block resident: the spin barrier needs it
    report(name, grid, time_seq([&](cudaStream_t s) {
      CK(cudaMemsetAsync(counter, 0, 4, s));
      // barriers are numbered across the replay's launches (the counter is zeroed once): launch j's are
      // j * (per_launch - 1) onwards
      for (int s0 = 0; s0 < kLayers * kStages; s0 += per_launch) {
        cudaLaunchConfig_t cfg = pdl_config(dim3(grid), dim3(kThreads), 0, s, attr);
        const unsigned bar0 = static_cast<unsigned>(s0 / per_launch) * static_cast<unsigned>(per_launch - 1);
        CK(cudaLaunchKernelEx(&cfg, kern, st, s0, s0 + per_launch, counter, bar0, out));
      }
    }));
  };
  persist("B: a kernel a layer, barriers", persist_kernel<U, false>, kStages);
  persist("B': a kernel a layer, barriers, prefetch", persist_kernel<U, true>, kStages);
  persist("C: one kernel, 8 layers, barriers", persist_kernel<U, false>, kLayers * kStages);
  persist("D: one kernel, 8 layers, barriers, prefetch", persist_kernel<U, true>, kLayers * kStages);
  persist("E: one kernel, 8 layers, no barriers", persist_kernel<U, true, false>, kLayers * kStages);
  auto staged = [&](const char* name, auto kern, int pre) {
    const size_t smem = static_cast<size_t>(pre) * kThreads * 16;
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    int o = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, kern, kThreads, smem));
    printf("  (%s: %d blocks an SM fit, %zu B shared each)\n", name, o, smem);
    report(name, sms, time_seq([&](cudaStream_t s) {
      for (int i = 0; i < kLayers * kStages; ++i) {
        cudaLaunchConfig_t cfg = pdl_config(dim3(sms), dim3(kThreads), smem, s, attr);
        CK(cudaLaunchKernelEx(&cfg, kern, st.p[i], st.n[i], out));
      }
    }));
  };
  staged("F: 4 launches, 96 KB staged, early trigger", staged_kernel<12, true>, 12);
  staged("F': 4 launches, 48 KB staged, early trigger", staged_kernel<6, true>, 6);
  staged("F'': 4 launches, 112 KB staged, early trigger", staged_kernel<14, true>, 14);
  staged("F2: 4 launches, 16 KB staged, early trigger", staged_kernel<2, true>, 2);
  staged("F4: 4 launches, 32 KB staged, early trigger", staged_kernel<4, true>, 4);
  staged("G: 4 launches, 96 KB staged, trigger after wait", staged_kernel<12, false>, 12);
  auto bulk = [&](const char* name, int pre_kb) {
    const size_t smem = static_cast<size_t>(pre_kb > 0 ? pre_kb : 1) * 1024;
    CK(cudaFuncSetAttribute(bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    int o = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, bulk_kernel, kThreads, smem));
    if (o < 1) { printf("  (%s: does not fit)\n", name); return; }
    const int64_t pre16 = static_cast<int64_t>(pre_kb) * 1024 / 16;
    report(name, sms, time_seq([&](cudaStream_t s) {
      CK(cudaMemsetAsync(counter, 0, 4, s));
      cudaLaunchConfig_t cfg = pdl_config(dim3(sms), dim3(kThreads), smem, s, attr);
      CK(cudaLaunchKernelEx(&cfg, bulk_kernel, st, 0, kLayers * kStages, counter, 0u, pre16, out));
    }));
  };
  bulk("H0: one kernel, 8 layers, a block an SM, no copy", 0);
  bulk("H32: ... 32 KB of the next stage by bulk copy", 32);
  bulk("H96: ... 96 KB", 96);
  bulk("H160: ... 160 KB", 160);
  bulk("H200: ... 200 KB", 200);
  unsigned* chunk_ctr;
  CK(cudaMalloc(&chunk_ctr, kLayers * kStages * sizeof(unsigned)));
  auto dyn = [&](const char* name, auto kern) {
    int o = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, kern, kThreads, 0));
    const int grid = sms * o;                       // every block resident: the spin barrier needs it
    report(name, grid, time_seq([&](cudaStream_t s) {
      CK(cudaMemsetAsync(counter, 0, 4, s));
      CK(cudaMemsetAsync(chunk_ctr, 0, kLayers * kStages * sizeof(unsigned), s));
      cudaLaunchConfig_t cfg = pdl_config(dim3(grid), dim3(kThreads), 0, s, attr);
      CK(cudaLaunchKernelEx(&cfg, kern, st, 0, kLayers * kStages, counter, 0u, chunk_ctr, out));
    }));
  };
  dyn("I: one kernel, 8 layers, barriers, chunks by counter", dyn_kernel<U, true, false>);
  dyn("I': ... the next stage's first chunk before the barrier", dyn_kernel<U, true, true>);
  dyn("I4: I at 32 KB chunks (U 4)", dyn_kernel<4, true, false>);
  dyn("I4': I' at 32 KB chunks", dyn_kernel<4, true, true>);
  dyn("Inb: chunks by counter, no barriers", dyn_kernel<U, false, false>);
  dyn("J: I', the chunk's loads between arrival and wait", dyn_kernel<U, true, true, true>);
  dyn("J4: J at 32 KB chunks", dyn_kernel<4, true, true, true>);
  dyn("Js: J with 128 B of stores a block before each arrival", dyn_kernel<U, true, true, true, true>);
  dyn("Js4: Js at 32 KB chunks", dyn_kernel<4, true, true, true, true>);
  dyn("K: I', warp 0 (the fence's) loading after the barrier", dyn_kernel<U, true, true, false, false, true>);
  return 0;
}
