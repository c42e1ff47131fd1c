// What the standalone CUDA probes (wide_probe.cu, gemv_probe.cu, dequant_probe.cu, persist_probe.cu, twin_probe.cu)
// share: the error check, the timing of a sequence of launches replayed from one CUDA graph, PDL launch configs and
// the bench's weight layouts.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#ifdef WITH_CUBLAS                   // the probes that chain cuBLAS GEMMs
#include <cublas_v2.h>
#define CB(x) do { cublasStatus_t e = (x); if (e != CUBLAS_STATUS_SUCCESS) { printf("%s:%d cublas %d\n", __FILE__, __LINE__, (int)e); exit(1); } } while (0)
#endif

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); exit(1); } } while (0)

float time_graph(cudaStream_t st, cudaGraphExec_t exec) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int r = 0; r < 12; ++r) {
    CK(cudaEventRecord(e0, st));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= 2) ts.push_back(ms);
  }
  std::sort(ts.begin(), ts.end());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ts[ts.size() / 2] * 1000.f;
}

// Called on each captured graph before it is instantiated, when set (dequant_probe's L2 window on every kernel node).
inline void (*g_after_capture)(cudaGraph_t) = nullptr;

// us of the whole sequence launch_all(stream) issues, replayed from one CUDA graph: median of 10 replays after 2.
template <class F>
float time_seq(F&& launch_all) {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  launch_all(st);   // warm, and surfaces launch errors
  CK(cudaStreamSynchronize(st));
  CK(cudaGetLastError());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  launch_all(st);
  CK(cudaStreamEndCapture(st, &graph));
  if (g_after_capture) g_after_capture(graph);
  CK(cudaGraphInstantiate(&exec, graph, 0));
  const float us = time_graph(st, exec);
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(st));
  return us;
}

// Registers a thread of kernel `kern` (ptxas's count, as loaded).
template <typename Kern>
int regs_of(Kern* kern) {
  cudaFuncAttributes a;
  CK(cudaFuncGetAttributes(&a, kern));
  return a.numRegs;
}

#ifdef __CUDACC__
// The read-only probes' loop: the xor of the 16-byte units p[i], p[i + stride], ... below n, U loads in flight.
template <int U>
__device__ __forceinline__ int xor_stream(const int4* __restrict__ p, int64_t i, int64_t n, int64_t stride) {
  int acc = 0;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldg(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) { const int4 v = __ldg(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  return acc;
}
#endif

// The current device's properties and SM count.
inline int probe_device(cudaDeviceProp& prop) {
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  return sms;
}

// A launch config with programmatic dependent launch, as the extension launches its kernels.
inline cudaLaunchConfig_t pdl_config(dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                                     cudaLaunchAttribute (&attr)[1]) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Bits of chunk c (32 rows) of a K-row weight: 4, or the bench's EXL2 layout (bench/make_7b_checkpoint.py
// exl2_segments): the first ~K/11 rows 5-bit, the last ~K/11 3-bit, the rest 4-bit.
inline int chunk_bits(int c, int K, bool mixed) {
  const int edge = std::max(128, (K / 11) / 128 * 128);
  return !mixed ? 4 : 32 * c < edge ? 5 : 32 * c >= K - edge ? 3 : 4;
}

// A random act-order permutation of K rows, int64 on the device.
inline int64_t* random_perm(int K) {
  std::vector<int64_t> pm(K);
  for (int k = 0; k < K; ++k) pm[k] = k;
  for (int k = K - 1; k > 0; --k) std::swap(pm[k], pm[rand() % (k + 1)]);
  int64_t* d;
  CK(cudaMalloc(&d, static_cast<size_t>(K) * 8));
  CK(cudaMemcpy(d, pm.data(), static_cast<size_t>(K) * 8, cudaMemcpyHostToDevice));
  return d;
}

// A packed weight of K rows and ldq columns on the device, as the bench's checkpoints hold them: random words, scales
// in [0.002, 0.004], zeros 0..15, groups of 128 rows, the chunk table (bits, group, first word row) of chunk_bits's
// layout, and with act_order a random permutation; keep_host keeps the host copies (for references).
struct PackedDev {
  int K = 0, ldq = 0;
  int* qw = nullptr;
  float *s = nullptr, *z = nullptr;
  int* chunks = nullptr;
  int64_t* perm = nullptr;
  int* twin = nullptr;            // twin_every > 0: per main chunk, the chunk-table row of its twin or -1
  int64_t bytes = 0;              // words + scale + zero
  std::vector<int> hq, hch;
  std::vector<float> hs, hz;
  std::vector<int64_t> hperm;
};

// twin_every > 0 (4-bit, the prompt dequantise of EXL2 rewritten as uniform 4-bit rows, formats/uniform4.py): every
// twin_every-th of the K / 32 chunks gets an extra 4-bit chunk appended after them (its group's scale and zero), whose
// values the kernel adds in the same thread (DequantMat::twin).
inline PackedDev make_packed(int K, int ldq, bool mixed, bool act_order, bool keep_host = false, int twin_every = 0) {
  PackedDev w;
  w.K = K, w.ldq = ldq;
  const int G = K / 128, C = K / 32;
  std::vector<int> ch(static_cast<size_t>(C) * 3), tw(twin_every > 0 ? C : 0, -1);
  int qrow = 0;
  for (int c = 0; c < C; ++c) {
    const int bits = chunk_bits(c, K, mixed);
    ch[3 * c] = bits, ch[3 * c + 1] = c / 4, ch[3 * c + 2] = qrow;
    qrow += bits;
  }
  for (int c = 0; twin_every > 0 && c < C; c += twin_every) {
    tw[c] = static_cast<int>(ch.size() / 3);
    ch.insert(ch.end(), {4, c / 4, qrow});
    qrow += 4;
  }
  if (twin_every > 0) {
    CK(cudaMalloc(&w.twin, tw.size() * 4));
    CK(cudaMemcpy(w.twin, tw.data(), tw.size() * 4, cudaMemcpyHostToDevice));
  }
  std::vector<int> hq(static_cast<size_t>(qrow) * ldq);
  std::vector<float> hs(static_cast<size_t>(G) * ldq), hz(static_cast<size_t>(G) * ldq);
  for (auto& v : hq) v = static_cast<int>((static_cast<uint32_t>(rand()) << 16) ^ static_cast<uint32_t>(rand()));
  for (auto& v : hs) v = 0.002f + 0.002f * (rand() / static_cast<float>(RAND_MAX));
  for (auto& v : hz) v = static_cast<float>(rand() % 16);
  CK(cudaMalloc(&w.qw, hq.size() * 4));
  CK(cudaMalloc(&w.s, hs.size() * 4));
  CK(cudaMalloc(&w.z, hz.size() * 4));
  CK(cudaMalloc(&w.chunks, ch.size() * 4));
  CK(cudaMemcpy(w.qw, hq.data(), hq.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w.s, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w.z, hz.data(), hz.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w.chunks, ch.data(), ch.size() * 4, cudaMemcpyHostToDevice));
  if (act_order) w.perm = random_perm(K);
  w.bytes = static_cast<int64_t>(hq.size() + hs.size() + hz.size()) * 4;
  if (keep_host) {
    w.hq = std::move(hq), w.hch = std::move(ch), w.hs = std::move(hs), w.hz = std::move(hz);
    if (w.perm) {
      w.hperm.resize(K);
      CK(cudaMemcpy(w.hperm.data(), w.perm, static_cast<size_t>(K) * 8, cudaMemcpyDeviceToHost));
    }
  }
  return w;
}

inline void free_packed(PackedDev& w) {
  CK(cudaFree(w.qw));
  CK(cudaFree(w.s));
  CK(cudaFree(w.z));
  CK(cudaFree(w.chunks));
  if (w.twin) CK(cudaFree(w.twin));
  if (w.perm) CK(cudaFree(w.perm));
}
