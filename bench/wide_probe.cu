// Probe for the 9..32-row decode GEMM (bs8-32 decode): the extension's qgemm_wide kernel
// (exl_core/csrc/cuda/qgemm_wide_kernel.cuh, no torch headers) built in seconds with plain nvcc and timed on the 7B
// decode shapes at other ring/stage depths and split counts, without the extension's build (minutes).
//   nvcc -O3 -arch=sm_90 -o /tmp/wide_probe bench/wide_probe.cu && /tmp/wide_probe
// (bench/gpu.sh phase `wide`; `wide_probe one` runs one launch set for ncu.)  Every figure: 16 distinct weight
// sets launched back to back in one CUDA graph (together beyond the 50 MB L2), median of 10 replays, us per launch;
// err: max |y - fp32 reference| / max |reference| on poisoned output.
//
// How the design got here (H200, calls of one session; bench/results/wide_probe_h200.json; the variants below
// lived in this file as their own kernels: `git show 601db62:bench/wide_probe.cu`), us at 32 rows for 4096x4096 /
// q/k/v / gate/up / 11008x4096, against qgemm_kslice's 12.9 / 38.4 / 66.0 / 30.2 of the previous session:
//   v1 (scale/zero loaded from global memory at each group, runtime divisions in the loops): 18.3 / 35.9 / 59.0 /
//      40.7 (call 1); scale/zero staged in shared memory by cp.async: 14.9 / 30.1 / 50.1 / 33.9 (call 3).
//   v2 loop (pointer increments, full stages without per-chunk bounds checks, compile-time divisors in the x
//      staging): 13.0 / 26.5 / 39.9 / 27.3 (call 4) -- the kernel in the extension.  ncu (ring 8, 4096x4096, 8
//      splits): 12.8 instructions per HMMA, stall samples prologue 28 % / loop 46 % / cluster reduction 26 %;
//      5.7 cycles between a warp's instructions, 8 warps per SM.
//   not kept: two 32-column sets per warp (one x fragment for both; 168 registers) 15.4 / 27.5 / 36.7 / 31.9
//      (call 4); weights through the shared-memory stages by cp.async (more bytes in flight, fewer blocks per SM)
//      18.5 / 35.1 / 57.5 / 38.7 at best (call 6); 8 warps per block; ring/stage depths 4/2 and 2/4 within ~1 us
//      of 4/3 (call 7); split counts 3, 5, 6 no better than the powers of two, 12 (a non-portable cluster) 25.3
//      vs 27.1 us on 11008x4096 only (call 7, not adopted: clusters above 8 need the non-portable attribute).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../exl_core/csrc/cuda/qgemm_wide_kernel.cuh"   // the extension's kernel (no torch headers)
#include "probe_common.cuh"

using namespace exl_mma;
using namespace exl_wide;

// fp32 reference: y[m][n] = sum_k x[m][k] * (q - z) * s
__global__ void ref_kernel(const __half* x, int M, int K, int N, const int* qw, const float* scale, const float* zero,
                           int gs, float* y) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
  if (n >= N) return;
  float a = 0.f;
  for (int k = 0; k < K; ++k) {
    const int q = (qw[static_cast<size_t>(k / 8) * N + n] >> (4 * (k % 8))) & 15;
    const int gi = k / gs;
    a += __half2float(x[static_cast<size_t>(m) * K + k]) * (q - zero[static_cast<size_t>(gi) * N + n]) *
         scale[static_cast<size_t>(gi) * N + n];
  }
  y[static_cast<size_t>(m) * N + n] = a;
}

struct Set {
  int* qw;
  float *s, *z;
  __half* y;
  int* chunks;                  // [K/32, 3]: bits 4, group c/4, first word row 4c
};

// qgemm_wide_kernel<4 n-tiles, uniform 4-bit, RING, STAGES> over one weight, K split S ways (clusters), as the
// extension launches it (without PDL).
template <int RING, int STAGES>
struct Launcher {
  static int groups(int cps) { return std::min(cps, (cps + 3) / 4 + 1); }     // groups of 128 rows
  static size_t smem(int M, int K = 4096, int S = 8) {
    const int cps = (K / 32 + S - 1) / S;
    return Smem<RING, STAGES>(32, M, cps, groups(cps)).total;
  }
  static auto kern() { return qgemm_wide_kernel<4, true, RING, STAGES>; }
  static void go(const __half* x, int M, int K, int N, const Set& w, int S, cudaStream_t st) {
    const size_t sm = smem(M, K, S);
    CK(cudaFuncSetAttribute(kern(), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sm)));
    const int n_chunks = K / 32, cps = (n_chunks + S - 1) / S;
    Mats mats{};
    mats.n = 1;
    Mat& m = mats.m[0];
    m.qw = QPtr{w.qw, N, 128};
    m.chunks = w.chunks;
    m.scale = w.s;
    m.zero = w.z;
    m.y = w.y;
    m.N = N;
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = split_config((N + kTile - 1) / kTile, S, kThreads, sm, st, attr);
    // groups of 128 rows: chunk c in group c >> 2, as the extension passes GPTQ g128 (group_shift)
    CK(cudaLaunchKernelEx(&cfg, kern(), x, M, static_cast<int64_t>(K), n_chunks, cps, groups(cps), 2, mats));
  }
  static int regs() {
    cudaFuncAttributes a;
    CK(cudaFuncGetAttributes(&a, kern()));
    return a.numRegs;
  }
};

template <class L>
float time_us(const __half* x, int M, int K, int N, std::vector<Set>& sets, int S) {
  return time_seq([&](cudaStream_t st) {
           for (auto& w : sets) L::go(x, M, K, N, w, S, st);
         }) / sets.size();
}

template <class L>
double max_rel_err(const __half* x, int M, int K, int N, const Set& w) {
  float* ref;
  CK(cudaMalloc(&ref, sizeof(float) * M * N));
  ref_kernel<<<dim3((N + 127) / 128, M), 128>>>(x, M, K, N, w.qw, w.s, w.z, 128, ref);
  CK(cudaMemset(w.y, 0xFF, sizeof(__half) * M * N));   // poisoned: NaN where nothing is written
  L::go(x, M, K, N, w, 4, 0);
  CK(cudaDeviceSynchronize());
  std::vector<float> r(static_cast<size_t>(M) * N);
  std::vector<__half> o(static_cast<size_t>(M) * N);
  CK(cudaMemcpy(r.data(), ref, sizeof(float) * M * N, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(o.data(), w.y, sizeof(__half) * M * N, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    const double d = static_cast<double>(__half2float(o[i])) - r[i];
    num = std::max(num, std::isnan(d) ? 1e30 : std::fabs(d));
    den = std::max(den, static_cast<double>(std::fabs(r[i])));
  }
  CK(cudaFree(ref));
  return num / den;
}

template <class L>
void row(const char* name, const char* shape, const __half* x, int M, int K, int N, std::vector<Set>& sets) {
  float best = 1e30f;
  int best_s = 0;
  const double err = max_rel_err<L>(x, M, K, N, sets[0]);   // launches with 4 splits: sets the smem attribute
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, L::kern(), kThreads, L::smem(M, K, 4)));
  printf("%-16s %-12s M=%2d regs=%3d smem=%6zu occ=%d err=%.2e |", name, shape, M, L::regs(), L::smem(M), per_sm, err);
  for (int S : {1, 2, 4, 8}) {
    if (L::smem(M, K, S) > 200 * 1024) continue;
    const float us = time_us<L>(x, M, K, N, sets, S);
    printf(" S%d %6.1f", S, us);
    if (us < best) { best = us; best_s = S; }
  }
  printf(" | best %.1f us (S%d)\n", best, best_s);
  printf("JSON {\"kernel\": \"%s\", \"shape\": \"%s\", \"M\": %d, \"us\": %.2f, \"S\": %d, \"regs\": %d}\n", name, shape,
         M, best, best_s, L::regs());
}

static bool g_one = false;   // `wide_probe one`: only 4096x4096, M=32, the extension's instance, 8 splits (for ncu)

int main(int argc, char** argv) {
  g_one = argc > 1;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  struct Shape { const char* name; int K, N; };
  // q/k/v and gate/up as one matrix of the summed width: the same bytes and columns as one multi-weight launch
  const Shape shapes[] = {{"4096x4096", 4096, 4096}, {"qkv 4096x12288", 4096, 12288},
                          {"gu 4096x22016", 4096, 22016}, {"11008x4096", 11008, 4096}};
  srand(1);
  for (const Shape& sh : shapes) {
    if (g_one && sh.K != 4096) continue;
    if (g_one && sh.N != 4096) continue;
    const int K = sh.K, N = sh.N;
    const size_t wbytes = static_cast<size_t>(K) / 8 * N * 4;
    const int nsets = std::max<int>(2, static_cast<int>(std::min<size_t>(16, (400u << 20) / wbytes)));
    std::vector<Set> sets(nsets);
    for (auto& w : sets) {                            // GPTQ 4-bit g128 (probe_common.cuh)
      const PackedDev p = make_packed(K, N, false, false);
      w.qw = p.qw, w.s = p.s, w.z = p.z, w.chunks = p.chunks;
      CK(cudaMalloc(&w.y, static_cast<size_t>(32) * N * 2));
    }
    std::vector<__half> hx(static_cast<size_t>(32) * K);
    for (auto& v : hx) v = __float2half(2.f * rand() / RAND_MAX - 1.f);
    __half* x;
    CK(cudaMalloc(&x, hx.size() * 2));
    CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    if (g_one) {
      for (auto& w : sets) Launcher<4, 2>::go(x, 32, K, N, w, 8, 0);
      CK(cudaDeviceSynchronize());
      return 0;
    }
    for (int M : {17, 32}) {
      row<Launcher<4, 2>>("ring4 stages2", sh.name, x, M, K, N, sets);   // the extension's instance
      row<Launcher<4, 3>>("ring4 stages3", sh.name, x, M, K, N, sets);
      row<Launcher<2, 4>>("ring2 stages4", sh.name, x, M, K, N, sets);
    }
    for (auto& w : sets) {
      CK(cudaFree(w.qw));
      CK(cudaFree(w.s));
      CK(cudaFree(w.z));
      CK(cudaFree(w.y));
      CK(cudaFree(w.chunks));
    }
    CK(cudaFree(x));
  }
  return 0;
}
