// Read-only bandwidth on the GPU, by access method: what can a decode kernel's weight stream reach?
//   nvcc -O3 -arch=sm_90 -o /tmp/read_bw bench/read_bw.cu && /tmp/read_bw
// (bench/gpu.sh phase `readbw`.)  Every figure: 16 distinct buffers of the size read back to back in one
// CUDA graph (together beyond the 50 MB L2), median of 10 replays, GB/s = bytes read / time.
//   ldg      grid-stride 16-byte loads, U independent loads in flight per thread (register ring)
//   gptq     the decode kernels' pattern on a [Q, N] int32 word matrix: a block = 32 columns x KW warps
//            along K, a lane loads 16 bytes of one row per 32-row chunk (4 rows x 128 bytes per warp)
//   bulk     cp.async.bulk (TMA engine) into a shared-memory ring of S stages, one mbarrier per stage
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "probe_common.cuh"   // CK, time_seq

template <int U>
__global__ void read_ldg(const int4* __restrict__ p, size_t n, int* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int acc = xor_stream<U>(p, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                                static_cast<int64_t>(n), stride);
  if (acc == 0x12345678) out[0] = acc;   // never true in practice: keeps the loads
}

// q [Q, N] int32, Q = K/8 rows; block: 32 columns x KW warps along the K/32 chunks.
template <int KW, int R>
__global__ void read_gptq(const int* __restrict__ q, int Q, int N, int* out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int col = blockIdx.x * 32 + 4 * g;
  const int C = Q / 4, c0 = C * warp / KW, c1 = C * (warp + 1) / KW;
  const int* base = q + col;
  int acc = 0;
  int4 ring[R];
#pragma unroll
  for (int i = 0; i < R; ++i) if (c0 + i < c1) ring[i] = __ldg(reinterpret_cast<const int4*>(base + (size_t)(4 * (c0 + i) + t) * N));
  int c = c0;
  for (; c + R <= c1; c += R) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      acc ^= ring[i].x ^ ring[i].y ^ ring[i].z ^ ring[i].w;
      if (c + i + R < c1) ring[i] = __ldg(reinterpret_cast<const int4*>(base + (size_t)(4 * (c + i + R) + t) * N));
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i) if (c + i < c1) acc ^= ring[i].x ^ ring[i].y ^ ring[i].z ^ ring[i].w;
  if (acc == 0x12345678) out[0] = acc;
}

__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// Block b streams bytes [b * per, (b + 1) * per) through S stages of SB bytes.
template <int S>
__global__ void read_bulk(const char* __restrict__ p, size_t per, int SB, int* out) {
  extern __shared__ __align__(128) char sm[];
  __shared__ __align__(8) unsigned long long bar[S];
  const char* src = p + blockIdx.x * per;
  const int n = static_cast<int>(per / SB);
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar[s])));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  auto issue = [&](int i) {
    const int s = i % S;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&bar[s])), "r"(SB));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(sm + s * SB)), "l"(src + static_cast<size_t>(i) * SB), "r"(SB), "r"(smem_u32(&bar[s]))
                 : "memory");
  };
  if (threadIdx.x == 0)
    for (int i = 0; i < S && i < n; ++i) issue(i);
  int acc = 0;
  for (int i = 0; i < n; ++i) {
    const int s = i % S;
    const unsigned phase = (i / S) & 1;
    unsigned done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(smem_u32(&bar[s])), "r"(phase) : "memory");
    const int4* v = reinterpret_cast<const int4*>(sm + s * SB);
    for (int j = threadIdx.x; j < SB / 16; j += blockDim.x) acc ^= v[j].x ^ v[j].w;
    __syncthreads();
    if (threadIdx.x == 0 && i + S < n) issue(i + S);
  }
  if (acc == 0x12345678) out[0] = acc;
}

template <typename F>
float graph_us(F launch16) {   // us of one launch: median replay of 16 launches (probe_common.cuh), / 16
  return time_seq(launch16) / 16;
}

int main() {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int* out;
  CK(cudaMalloc(&out, 4));
  const size_t max_bytes = 64ull << 20;
  std::vector<char*> bufs(16);
  for (auto& b : bufs) { CK(cudaMalloc(&b, max_bytes)); CK(cudaMemset(b, 1, max_bytes)); }
  const size_t sizes[] = {8ull << 20, 22ull << 20, 45ull << 20};
  for (size_t bytes : sizes) {
    printf("--- %zu MB per call\n", bytes >> 20);
    const size_t n = bytes / 16;
    for (int threads : {256, 512, 1024})
      for (int per_sm : {1, 2, 4}) {
        const int blocks = sms * per_sm;
        if (threads * per_sm > 2048) continue;
        float us4 = graph_us([&](cudaStream_t st) { for (auto b : bufs) read_ldg<4><<<blocks, threads, 0, st>>>((const int4*)b, n, out); });
        float us8 = graph_us([&](cudaStream_t st) { for (auto b : bufs) read_ldg<8><<<blocks, threads, 0, st>>>((const int4*)b, n, out); });
        printf("ldg  threads %4d x %d/SM: U4 %7.2f us %6.0f GB/s | U8 %7.2f us %6.0f GB/s\n", threads, per_sm, us4,
               bytes / us4 / 1e3, us8, bytes / us8 / 1e3);
      }
    // gptq pattern: N = 4096 columns, Q = bytes / (4 N) rows
    const int N = 4096, Q = static_cast<int>(bytes / (4ull * N)) & ~3;
    const double gb = 4.0 * Q * N;
    float a = graph_us([&](cudaStream_t st) { for (auto b : bufs) read_gptq<8, 8><<<N / 32, 256, 0, st>>>((const int*)b, Q, N, out); });
    float b = graph_us([&](cudaStream_t st) { for (auto b : bufs) read_gptq<16, 8><<<N / 32, 512, 0, st>>>((const int*)b, Q, N, out); });
    float c = graph_us([&](cudaStream_t st) { for (auto b : bufs) read_gptq<16, 16><<<N / 32, 512, 0, st>>>((const int*)b, Q, N, out); });
    float d = graph_us([&](cudaStream_t st) { for (auto b : bufs) read_gptq<32, 8><<<N / 32, 1024, 0, st>>>((const int*)b, Q, N, out); });
    printf("gptq N=4096 Q=%d: KW8R8 %6.2f us %5.0f GB/s | KW16R8 %6.2f us %5.0f | KW16R16 %6.2f us %5.0f | KW32R8 %6.2f us %5.0f\n",
           Q, a, gb / a / 1e3, b, gb / b / 1e3, c, gb / c / 1e3, d, gb / d / 1e3);
    for (int SB : {4096, 8192, 16384}) {
      for (int per_sm : {1, 2}) {
        const int blocks = sms * per_sm;
        const size_t per = (bytes / blocks) / SB * SB;
        const int S = 4;
        const size_t smem = static_cast<size_t>(S) * SB;
        CK(cudaFuncSetAttribute(read_bulk<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
        float us = graph_us([&](cudaStream_t st) { for (auto b : bufs) read_bulk<4><<<blocks, 256, smem, st>>>(b, per, SB, out); });
        printf("bulk S=4 SB=%5d x %d/SM: %7.2f us %6.0f GB/s (of %zu bytes)\n", SB, per_sm, us, per * blocks / us / 1e3,
               per * blocks);
      }
    }
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  return 0;
}
