// Probe for the prompt path's dequantise (packed weight -> fp16 W [K, N] for cuBLAS): the extension's kernels
// (exl_core/csrc/cuda/dequant_kernel.cuh, no torch headers) built with plain nvcc and timed as the prompt runs them,
// with programmatic dependent launch: per decoder layer of a Llama-2-7B shape, q/k/v/o (4096 x 4096), gate and up
// (4096 x 11008, each in column slices of 4096 as `_dequant_mm` takes them) and down (11008 x 4096), four layers of
// distinct weights in one CUDA graph, all writing one scratch W as the allocator hands the extension one block.
// Formats: GPTQ 4-bit g128 (the bench's: no act-order), the same with a random act-order, the bench's EXL2 widths
// (5/4/3-bit segments) without and with act-order.  Floors: cudaMemset of the same W bytes (write only) and a D2D copy.
// With -DWITH_CUBLAS (-lcublas) also the prompt's chain as it runs: each dequantise followed by its GEMM on 2048 rows
// of x (y = x W, cublasGemmEx, fp32 accumulate), against the GEMMs alone.
//   nvcc -O3 -arch=sm_90 -o /tmp/dequant_probe bench/dequant_probe.cu [-DWITH_CUBLAS -lcublas] && /tmp/dequant_probe
// (bench/gpu.sh phase `dequant`.)  Each output W is checked bit for bit against a host computation of the same
// formula (fp32 fma, one rounding to fp16) on the first layer.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#ifdef WITH_CUBLAS
#include <cublas_v2.h>
#endif

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../exl_core/csrc/cuda/dequant_kernel.cuh"   // the extension's kernels (no torch headers)
#include "probe_common.cuh"

using namespace exl_dequant;

struct DW {                       // one packed weight: K rows, ldq columns
  int K, ldq;
  int* qw;
  float *s, *z;
  int* chunks;                    // [K/32, 3]: bits, group c/4, first word row
  int64_t* perm;                  // or null
  std::vector<int> hq, hch;       // host copies (first layer only: the check)
  std::vector<float> hs, hz;
  std::vector<int64_t> hperm;
  int64_t bytes;                  // words + scale + zero
};

DW make(int K, int ldq, bool mixed, bool act_order, bool keep_host) {
  DW w{K, ldq};
  const int G = K / 128, C = K / 32;
  std::vector<int> ch(static_cast<size_t>(C) * 3);
  int qrow = 0;
  for (int c = 0; c < C; ++c) {
    const int bits = chunk_bits(c, K, mixed);
    ch[3 * c] = bits, ch[3 * c + 1] = c / 4, ch[3 * c + 2] = qrow;
    qrow += bits;
  }
  std::vector<int> hq(static_cast<size_t>(qrow) * ldq);
  std::vector<float> hs(static_cast<size_t>(G) * ldq), hz(static_cast<size_t>(G) * ldq);
  for (auto& v : hq) v = (rand() << 16) ^ rand();
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
  w.perm = act_order ? random_perm(K) : nullptr;
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

struct Launch {                   // one dequantise: columns [col0, col0 + N) of a weight
  DW* w;
  int col0, N;
};

enum Kern { kV8 = 0, kRows8 = 1 };
const char* kern_name[] = {"v8 (thread per chunk x 8 cols)", "rows8 (warp per 8 rows x 256 cols)"};

void launch(Kern k, const Launch& l, __half* W, cudaStream_t st) {
  const DW& w = *l.w;
  const int32_t* qp = w.qw + l.col0;
  const float *sp = w.s + l.col0, *zp = w.z + l.col0;
  cudaLaunchAttribute attr[1];
  const int64_t ldq = w.ldq, N = l.N;
  if (k == kRows8) {
    const cudaLaunchConfig_t cfg = pdl_config(dim3((N + kRows8Cols - 1) / kRows8Cols, w.K / 32),
                                              dim3(kRows8Threads), 0, st, attr);
    CK(cudaLaunchKernelEx(&cfg, dequant_rows8_kernel<__half>, (const int32_t*)w.chunks, qp, ldq, N, sp, zp,
                          (const int64_t*)w.perm, W));
  } else {
    const cudaLaunchConfig_t cfg = pdl_config(dim3((N + 511) / 512, w.K / 32), dim3(64), 0, st, attr);
    CK(cudaLaunchKernelEx(&cfg, dequant_kernel<__half, 8>, (const int32_t*)w.chunks, qp, ldq, N, sp, zp,
                          (const int64_t*)w.perm, W));
  }
}

struct Layer {
  DW m[7];                        // q, k, v, o, gate, up, down
  std::vector<Launch> all, attn, mlp_in, down;
};

void plan(Layer& L) {
  for (int i = 0; i < 4; ++i) L.attn.push_back({&L.m[i], 0, 4096});
  for (int i = 4; i < 6; ++i)
    for (int c0 = 0; c0 < 11008; c0 += 4096) L.mlp_in.push_back({&L.m[i], c0, std::min(4096, 11008 - c0)});
  L.down.push_back({&L.m[6], 0, 4096});
  for (auto* v : {&L.attn, &L.mlp_in, &L.down}) L.all.insert(L.all.end(), v->begin(), v->end());
}

Layer make_layer(bool mixed, bool act_order, bool keep_host) {
  Layer L;
  for (int i = 0; i < 4; ++i) L.m[i] = make(4096, 4096, mixed, act_order, keep_host);
  for (int i = 4; i < 6; ++i) L.m[i] = make(4096, 11008, mixed, act_order, keep_host);
  L.m[6] = make(11008, 4096, mixed, act_order, keep_host);
  plan(L);
  return L;
}

int64_t bytes_of(const std::vector<Launch>& ls, int64_t* w_bytes) {   // read (words, scale, zero of the slice) + write
  int64_t r = 0, wr = 0;
  for (const auto& l : ls) {
    r += l.w->bytes * l.N / l.w->ldq;
    wr += static_cast<int64_t>(l.w->K) * l.N * 2;
  }
  if (w_bytes) *w_bytes = wr;
  return r + wr;
}

// Host reference of one launch: the kernels' formula (fp32 fma of q, s and -z s, one rounding to fp16).
bool check(const Launch& l, const __half* W) {
  const DW& w = *l.w;
  std::vector<__half> got(static_cast<size_t>(w.K) * l.N);
  CK(cudaMemcpy(got.data(), W, got.size() * 2, cudaMemcpyDeviceToHost));
  for (int c = 0; c < w.K / 32; ++c) {
    const int bits = w.hch[3 * c], g = w.hch[3 * c + 1], qrow = w.hch[3 * c + 2];
    for (int n = 0; n < l.N; ++n) {
      const int col = l.col0 + n;
      const float s = w.hs[static_cast<size_t>(g) * w.ldq + col], zs = w.hz[static_cast<size_t>(g) * w.ldq + col] * s;
      for (int j = 0; j < 32; ++j) {
        const int pos = j * bits, wi = pos >> 5, off = pos & 31;
        uint64_t win = static_cast<uint32_t>(w.hq[static_cast<size_t>(qrow + wi) * w.ldq + col]);
        if (off + bits > 32) win |= static_cast<uint64_t>(static_cast<uint32_t>(
                                        w.hq[static_cast<size_t>(qrow + wi + 1) * w.ldq + col])) << 32;
        const uint32_t q = static_cast<uint32_t>((win >> off) & ((1u << bits) - 1u));
        const int64_t k = 32 * c + j, row = w.hperm.empty() ? k : w.hperm[k];
        const __half want = __float2half_rn(std::fmaf(static_cast<float>(q), s, -zs));
        const __half have = got[static_cast<size_t>(row) * l.N + n];
        if (memcmp(&want, &have, 2) != 0) {
          printf("MISMATCH K %d ldq %d col %d k %lld: %f vs %f\n", w.K, w.ldq, col, (long long)k,
                 __half2float(want), __half2float(have));
          return false;
        }
      }
    }
  }
  return true;
}

#ifdef WITH_CUBLAS
#define CB(x) do { cublasStatus_t e = (x); if (e != CUBLAS_STATUS_SUCCESS) { printf("%s:%d cublas %d\n", __FILE__, __LINE__, (int)e); exit(1); } } while (0)
#endif

int main() {
  srand(1234);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  for (auto kf : {dequant_kernel<__half, 8>}) {
    cudaFuncAttributes a;
    CK(cudaFuncGetAttributes(&a, kf));
    printf("v8 registers %d\n", a.numRegs);
  }
  {
    cudaFuncAttributes a;
    CK(cudaFuncGetAttributes(&a, dequant_rows8_kernel<__half>));
    printf("rows8 registers %d\n", a.numRegs);
  }
  __half* W;
  const size_t w_max = static_cast<size_t>(11008) * 4096;
  CK(cudaMalloc(&W, w_max * 2));

  // floors: cudaMemset over a layer's W sizes (write only), a D2D copy of the largest W
  const int n_layers = 4;
  struct Fmt { const char* name; bool mixed, act_order; };
  const Fmt fmts[] = {{"gptq", false, false}, {"gptq_actorder", false, true}, {"exl2_noperm", true, false},
                      {"exl2", true, true}};
  {
    Layer L = make_layer(false, false, false);
    int64_t wb;
    bytes_of(L.all, &wb);
    const float us = time_seq([&](cudaStream_t st) {
                       for (int r = 0; r < n_layers; ++r)
                         for (const auto& l : L.all) CK(cudaMemsetAsync(W, r, static_cast<size_t>(l.w->K) * l.N * 2, st));
                     }) / n_layers;
    printf("memset floor: %.2f us a layer, %.1f GB/s written\n", us, wb / us / 1e3);
    printf("JSON {\"row\": \"memset_floor\", \"us_per_layer\": %.3f, \"gb_s\": %.1f}\n", us, wb / us / 1e3);
    __half* W2;
    CK(cudaMalloc(&W2, w_max * 2));
    const float cus = time_seq([&](cudaStream_t st) { CK(cudaMemcpyAsync(W2, W, w_max * 2, cudaMemcpyDeviceToDevice, st)); });
    printf("copy: %.2f us for %zu MB, %.1f GB/s read+write\n", cus, w_max * 2 >> 20, 2.0 * w_max * 2 / cus / 1e3);
    printf("JSON {\"row\": \"copy\", \"us\": %.3f, \"gb_s_rw\": %.1f}\n", cus, 2.0 * w_max * 2 / cus / 1e3);
    CK(cudaFree(W2));
  }

#ifdef WITH_CUBLAS
  cublasHandle_t h;
  CB(cublasCreate(&h));
  const int M = 2048;
  __half *x, *y;
  CK(cudaMalloc(&x, static_cast<size_t>(M) * 11008 * 2));
  CK(cudaMalloc(&y, static_cast<size_t>(M) * 11008 * 2));
  {
    std::vector<__half> hx(static_cast<size_t>(M) * 11008);
    for (auto& v : hx) v = __float2half(rand() / static_cast<float>(RAND_MAX) - 0.5f);
    CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
  }
  // y[:, col0:col0+N] (row stride ldq) = x[:, :K] W, as _dequant_mm's column slices write y in place
  auto gemm = [&](const Launch& l, cudaStream_t st) {
    const float one = 1.f, zero = 0.f;
    CB(cublasSetStream(h, st));
    CB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, l.N, M, l.w->K, &one, W, CUDA_R_16F, l.N, x, CUDA_R_16F, 11008,
                    &zero, y + l.col0, CUDA_R_16F, l.w->ldq, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  bool gemm_done = false;
#endif

  for (const Fmt& f : fmts) {
    std::vector<Layer> layers;
    for (int r = 0; r < n_layers; ++r) layers.push_back(make_layer(f.mixed, f.act_order, r == 0));
    // bit-for-bit check of both kernels on the first layer: one of each shape
    for (Kern k : {kV8, kRows8}) {
      bool ok = true;
      for (const Launch* l : {&layers[0].attn[0], &layers[0].mlp_in[2], &layers[0].down[0]}) {
        CK(cudaMemset(W, 0xFF, w_max * 2));
        launch(k, *l, W, 0);
        CK(cudaDeviceSynchronize());
        ok = ok && check(*l, W);
      }
      printf("%s %s: check %s\n", f.name, kern_name[k], ok ? "ok" : "FAILED");
      if (!ok) exit(1);
    }
    for (Kern k : {kV8, kRows8}) {
      std::string row = std::string("{\"row\": \"dequant\", \"format\": \"") + f.name + "\", \"kernel\": \"" +
                        (k == kV8 ? "v8" : "rows8") + "\"";
      printf("%-14s %-36s", f.name, kern_name[k]);
      const char* part_names[] = {"layer", "qkvo", "gate_up", "down"};
      for (int p = 0; p < 4; ++p) {
        auto pick = [&](Layer& L) -> std::vector<Launch>& {
          return p == 0 ? L.all : p == 1 ? L.attn : p == 2 ? L.mlp_in : L.down;
        };
        const float us = time_seq([&](cudaStream_t st) {
                           for (auto& L : layers)
                             for (const auto& l : pick(L)) launch(k, l, W, st);
                         }) / n_layers;
        const double gbs = bytes_of(pick(layers[0]), nullptr) / us / 1e3;
        printf("  %s %8.2f us (%6.1f GB/s)", part_names[p], us, gbs);
        row += std::string(", \"") + part_names[p] + "_us\": " + std::to_string(us) + ", \"" + part_names[p] +
               "_gb_s\": " + std::to_string(gbs);
      }
      printf("\n");
      printf("JSON %s}\n", row.c_str());
    }
#ifdef WITH_CUBLAS
    // the prompt's chain: dequantise, then its GEMM, for every launch of the layer
    if (!gemm_done) {
      const float us = time_seq([&](cudaStream_t st) {
                         for (auto& L : layers)
                           for (const auto& l : L.all) gemm(l, st);
                       }) / n_layers;
      printf("GEMMs alone (M %d): %.2f us a layer\n", M, us);
      printf("JSON {\"row\": \"gemm_only\", \"us_per_layer\": %.3f}\n", us);
      gemm_done = true;
    }
    for (Kern k : {kV8, kRows8}) {
      const float us = time_seq([&](cudaStream_t st) {
                         for (auto& L : layers)
                           for (const auto& l : L.all) {
                             launch(k, l, W, st);
                             gemm(l, st);
                           }
                       }) / n_layers;
      printf("%s %s + GEMM: %.2f us a layer\n", f.name, k == kV8 ? "v8" : "rows8", us);
      printf("JSON {\"row\": \"dequant_gemm\", \"format\": \"%s\", \"kernel\": \"%s\", \"us_per_layer\": %.3f}\n", f.name,
             k == kV8 ? "v8" : "rows8", us);
    }
#endif
    for (auto& L : layers)
      for (auto& m : L.m) {
        CK(cudaFree(m.qw));
        CK(cudaFree(m.s));
        CK(cudaFree(m.z));
        CK(cudaFree(m.chunks));
        if (m.perm) CK(cudaFree(m.perm));
      }
  }
  printf("done\n");
  return 0;
}
