// What batch-1 decode would gain from running a layer's attention in the tail of its q/k/v launch instead of in a
// launch of its own (csrc/cuda/NOTES.md, stop 47's next step 2).  In stop 39's timeline the attention launch adds
// 6.35 us to each layer of the GPTQ 7B step (203.43 of 1,925.46 us).  Here the last block to finish one of a kv
// head's q/k/v tiles (a counter per head, reset by that block) rotates the head's q and key, writes its key and value
// to the cache and attends over the cache, while the other tiles' weights still stream; only the last head's attention
// is left after the q/k/v stream.
//   nvcc -O3 -arch=sm_90 -o /tmp/attn_tail_probe bench/attn_tail_probe.cu && /tmp/attn_tail_probe
// (bench/gpu.sh phase `attntail`.)  Llama-2-7B's shapes: 32 heads of 128 (kv heads 32), q/k/v 28.3 MB of GPTQ 4-bit
// g128 words, scales and zeros, o 9.4 MB; the decode row at position 191 (192 keys) in one page of 264 slots, as
// bench/gpu_bench.py's batch-1 step half way through its 128 tokens.  The projections are read-only streams of those
// bytes shaped like qgemm_kslice's launches (q/k/v: 384 tiles of 32 columns, 8 warps; o: 128 tiles, 16 warps; the
// first 8 loads a thread before the PDL wait), whose 32 outputs a tile are made from the words read and the launch's
// input (so each depends on the one before).  Chains, 8 layers of distinct buffers in one CUDA graph, median of 10
// replays, us a layer:
//   E  q/k/v -> o (o reads q: no attention; the floor of the structure)
//   A  q/k/v -> the library's paged attention kernel (ROPE, 5 key splits merged in a cluster, early loads, STAGE2, as
//      ops/attention.py launches it here) -> o
//   B  q/k/v with the attention in its tail -> o;  B2 the same, each tile's block also asking L2 (prefetch.global.L2)
//      for a twelfth of its head's old keys and values before the PDL wait
// Check: B's and B2's attention outputs and cache writes against A's (the library's, tested against float64), max
// |difference| printed.  Stop 48 call 1 (bench/results/attn_tail_probe_h200_stop48_call1_e2db215.jsonl, where B2's
// rows are named P), us a layer in rounds 1 / 2: E 12.98 / 13.01, A 22.04 / 22.22, B 23.72 / 23.70, B2 20.98 / 21.30;
// checks: attention max |B - A| and |B2 - A| 3.051e-05 (max |A| printed 0.146), K/V rows equal.  The tail alone
// loses to A's launch; B2's gain over A (0.92-1.06 us a layer at this position) is likely the L2 prefetch's (A with
// it was not measured).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "../exl_core/csrc/cuda/paged_attention_kernel.cuh"   // the library's attention (no torch headers)
#include "probe_common.cuh"                                     // CK, time_seq, pdl_config

namespace {

constexpr int kLayers = 8, kHeads = 32, kD = 128, kHidden = kHeads * kD;
constexpr int kPos = 191, kSlots = 264;                  // the row's position; one page of kSlots slots
constexpr int kQkvTiles = 3 * kHidden / 32, kOTiles = kHidden / 32;
constexpr int kQkvThreads = 256, kOThreads = 512;
constexpr int kTilesPerHead = 3 * kD / 32;              // q, k and v tiles of one (kv) head: 12
constexpr int kPre = 8;                                  // 16-byte loads a thread issued before the PDL wait
constexpr float kScaleLog2 = 0.08838834764831845f * 1.4426950408889634f;   // 1 / sqrt(128) * log2(e)

int64_t w_bytes(int64_t K, int64_t N) { return K * N / 2 + 2 * (K / 128) * N * 4; }

struct Layer {
  const int4* wqkv;   // tile t's share: [t * per, (t + 1) * per) int4
  const int4* wo;
  __half *q, *k, *v;  // q/k/v outputs (kHidden each)
  __half* kc;         // K/V cache (kSlots, kHeads, kD)
  __half* vc;
  __half* att;        // attention output (kHidden)
  __half* x;          // o's output: the next layer's input (kHidden)
  int* cnt;           // kHeads arrival counters (B)
};

// blockIdx -> (matrix 0 q / 1 k / 2 v, head, tile in the head's 4): a head's 12 tiles run next to each other
__device__ __forceinline__ void tile_of(int b, int& mat, int& head, int& j) {
  head = b / kTilesPerHead;
  mat = (b % kTilesPerHead) / 4;
  j = b % 4;
}

__device__ __forceinline__ float bits_value(int acc) { return static_cast<float>(acc & 0xffff) / 32768.f - 1.f; }

// The xor of a block's share [b0, b1) of w, `first` loads issued by the caller before its PDL wait.
template <int NT>
__device__ __forceinline__ int stream_share(const int4* __restrict__ w, int64_t b0, int64_t b1,
                                            const int4 (&first)[kPre]) {
  int acc = 0;
#pragma unroll
  for (int u = 0; u < kPre; ++u) acc ^= first[u].x ^ first[u].y ^ first[u].z ^ first[u].w;
  acc ^= xor_stream<8>(w, b0 + static_cast<int64_t>(kPre) * NT + threadIdx.x, b1, NT);
  return acc;
}

template <int NT>
__device__ __forceinline__ void first_loads(const int4* __restrict__ w, int64_t b0, int64_t b1, int4 (&first)[kPre]) {
#pragma unroll
  for (int u = 0; u < kPre; ++u) {
    const int64_t i = b0 + static_cast<int64_t>(u) * NT + threadIdx.x;
    first[u] = i < b1 ? __ldg(w + i) : make_int4(0, 0, 0, 0);
  }
}

// A warp's xor, then lane l of warp 0 holds column l's value after the block's reduction (shared `red`).
template <int NT>
__device__ __forceinline__ int block_xor_col(int acc, int* red) {
  red[threadIdx.x] = acc;
  __syncthreads();
  int v = 0;
  if (threadIdx.x < 32)
    for (int w = 0; w < NT / 32; ++w) v ^= red[w * 32 + threadIdx.x] * (w + 1);
  return v;
}

// ---------------------------------------------------------------------------------------------- attention (B)

// Rotated values 8s..8s+7 of a head row at kPos (rope_kv_write's math), read with ld.global.cg: the row was written by
// other blocks of this launch, so not through the non-coherent path.
__device__ __forceinline__ void rope_row8(const __half* row, int s, const float* cos_sin, float (&out)[8]) {
  constexpr int kHalf = kD / 2;
  const int e0 = 8 * s;
  const bool lo = e0 < kHalf;
  const int i0 = lo ? e0 : e0 - kHalf;
  const uint4 a = __ldcg(reinterpret_cast<const uint4*>(row + e0));
  const uint4 b = __ldcg(reinterpret_cast<const uint4*>(row + (lo ? e0 + kHalf : i0)));
  const __half* ah = reinterpret_cast<const __half*>(&a);
  const __half* bh = reinterpret_cast<const __half*>(&b);
  const float* cr = cos_sin + static_cast<int64_t>(kPos) * kD + i0;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float own = __half2float(ah[e]), other = __half2float(bh[e]), c = cr[e], sn = cr[kHalf + e];
    const float r = lo ? exl_act::rope_lo(own, other, c, sn) : exl_act::rope_hi(other, own, c, sn);
    out[e] = __half2float(__float2half_rn(r));              // rounded to fp16 as rope_kv_write stores it
  }
}

// One kv head's decode attention by the whole block (kQkvThreads threads: 16 lane groups of 16 lanes, a key a group
// per step), keys 0..kPos, the own key from registers.  Online softmax per group, merged through shared memory.
__device__ void attend_head(const Layer& L, int head, const float* cos_sin) {
  constexpr int LPK = kD / 8, NG = kQkvThreads / LPK, U = 4;
  __shared__ float sm_acc[NG][kD];
  __shared__ float sm_m[NG], sm_l[NG];
  const int grp = threadIdx.x / LPK, sub = threadIdx.x % LPK;
  float qf[8], kown[8], vown[8];
  rope_row8(L.q + head * kD, sub, cos_sin, qf);
  rope_row8(L.k + head * kD, sub, cos_sin, kown);
  {
    const uint4 vv = __ldcg(reinterpret_cast<const uint4*>(L.v + head * kD + 8 * sub));
    const __half* vh = reinterpret_cast<const __half*>(&vv);
#pragma unroll
    for (int e = 0; e < 8; ++e) vown[e] = __half2float(vh[e]);
    if (grp == 0) {                                         // the row's key and value to their slot
      uint4 kk;
      __half* kh = reinterpret_cast<__half*>(&kk);
#pragma unroll
      for (int e = 0; e < 8; ++e) kh[e] = __float2half_rn(kown[e]);
      const int64_t off = (static_cast<int64_t>(kPos) * kHeads + head) * kD + 8 * sub;
      *reinterpret_cast<uint4*>(L.kc + off) = kk;
      *reinterpret_cast<uint4*>(L.vc + off) = vv;
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) qf[e] *= kScaleLog2;
  float m = -INFINITY, l = 0.f, acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  for (int t0 = 0; t0 <= kPos; t0 += U * NG) {
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {                           // old keys: U in flight a lane
      const int t = t0 + u * NG + grp;
      const int64_t off = (static_cast<int64_t>(t) * kHeads + head) * kD + 8 * sub;
      if (t < kPos) {
        kr[u] = __ldg(reinterpret_cast<const uint4*>(L.kc + off));
        vr[u] = __ldg(reinterpret_cast<const uint4*>(L.vc + off));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * NG + grp;
      float kf[8], vf[8];
      if (t < kPos) {
        exl_attn::Vec<__half>::to_f32(kr[u], kf);
        exl_attn::Vec<__half>::to_f32(vr[u], vf);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) kf[e] = kown[e], vf[e] = vown[e];
      }
      float x = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) x = fmaf(qf[e], kf[e], x);
#pragma unroll
      for (int o = LPK / 2; o; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
      if (t <= kPos) {                                      // group-uniform
        const float mn = fmaxf(m, x), c = exp2f(m - mn), p = exp2f(x - mn);
        l = l * c + p;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = fmaf(acc[e], c, p * vf[e]);
        m = mn;
      }
    }
  }
  if (sub == 0) sm_m[grp] = m, sm_l[grp] = l;
#pragma unroll
  for (int e = 0; e < 8; ++e) sm_acc[grp][8 * sub + e] = acc[e];
  __syncthreads();
  if (threadIdx.x < kD) {
    float mx = -INFINITY;
    for (int g = 0; g < NG; ++g) mx = fmaxf(mx, sm_m[g]);
    float sum = 0.f, o = 0.f;
    for (int g = 0; g < NG; ++g) {
      const float w = sm_m[g] == -INFINITY ? 0.f : exp2f(sm_m[g] - mx);
      sum = fmaf(sm_l[g], w, sum);
      o = fmaf(sm_acc[g][threadIdx.x], w, o);
    }
    L.att[head * kD + threadIdx.x] = __float2half_rn(o / sum);
  }
}

// ---------------------------------------------------------------------------------------------- the launches

// q/k/v: tile (mat, head, j) writes columns head * 128 + 32 j .. + 31 of q, k or v from its share of the words and
// the launch's input x.  TAIL: the attention of the head whose last tile this block finished; PREF: L2 prefetch of a
// twelfth of the head's old K/V lines before the wait.
template <bool TAIL, bool PREF>
__global__ void __launch_bounds__(kQkvThreads) qkv_kernel(Layer L, const __half* x, int64_t per, int64_t n,
                                                          const float* cos_sin) {
  __shared__ int red[kQkvThreads];
  __shared__ int last;
  int mat, head, j;
  tile_of(blockIdx.x, mat, head, j);
  const int t = mat * (kHidden / 32) + head * 4 + j;
  const int64_t b0 = t * per, b1 = b0 + per < n ? b0 + per : n;
  int4 first[kPre];
  first_loads<kQkvThreads>(L.wqkv, b0, b1, first);
  if constexpr (PREF) {                                   // 2 x 191 lines of 256 bytes a head, over its 12 tiles
    const int i = mat * 4 + j;
    for (int r = threadIdx.x; r < 2 * kPos; r += kQkvThreads)
      if (r % kTilesPerHead == i) {
        const __half* p = (r < kPos ? L.kc : L.vc) + (static_cast<int64_t>(r % kPos) * kHeads + head) * kD;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + 64));
      }
  }
  exl_pdl::pdl_wait();
  exl_pdl::pdl_trigger();
  const int acc = stream_share<kQkvThreads>(L.wqkv, b0, b1, first);
  const int v = block_xor_col<kQkvThreads>(acc, red);
  if (threadIdx.x < 32) {
    const int col = head * kD + 32 * j + threadIdx.x;
    __half* y = mat == 0 ? L.q : mat == 1 ? L.k : L.v;
    y[col] = __float2half_rn(bits_value(v) + 1e-3f * __half2float(x[col]));
  }
  if constexpr (TAIL) {
    __threadfence();                                      // this tile's columns, before its arrival
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(L.cnt + head, 1) == kTilesPerHead - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    attend_head(L, head, cos_sin);
    if (threadIdx.x == 0) L.cnt[head] = 0;                // for the next replay
  }
}

// o: 128 tiles; x_next[col] from the words and in[col] (the attention output, or q in chain E)
__global__ void __launch_bounds__(kOThreads) o_kernel(Layer L, const __half* in, int64_t per, int64_t n) {
  __shared__ int red[kOThreads];
  const int64_t b0 = blockIdx.x * per, b1 = b0 + per < n ? b0 + per : n;
  int4 first[kPre];
  first_loads<kOThreads>(L.wo, b0, b1, first);
  exl_pdl::pdl_wait();
  exl_pdl::pdl_trigger();
  const int acc = stream_share<kOThreads>(L.wo, b0, b1, first);
  const int v = block_xor_col<kOThreads>(acc, red);
  if (threadIdx.x < 32) {
    const int col = blockIdx.x * 32 + threadIdx.x;
    L.x[col] = __float2half_rn(0.5f * bits_value(v) + __half2float(in[col]));
  }
}

__global__ void fill_kernel(int4* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    p[i] = make_int4(static_cast<int>(h), static_cast<int>(h * 3u), static_cast<int>(h * 5u), static_cast<int>(h * 7u));
  }
}

// fp16 values in [-1, 1) for the K/V caches and the first input
__global__ void fill_half_kernel(__half* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2246822519u ^ seed;
    h ^= h >> 15, h *= 0x2c1b3c6du, h ^= h >> 12;
    p[i] = __float2half_rn(static_cast<float>(h & 0xffff) / 32768.f - 1.f);
  }
}

}  // namespace

int main() {
  cudaDeviceProp prop;
  const int sms = probe_device(prop);
  const int64_t nqkv = 3 * w_bytes(kHidden, kHidden) / 16, no = w_bytes(kHidden, kHidden) / 16;
  const int64_t per_qkv = (nqkv + kQkvTiles - 1) / kQkvTiles, per_o = (no + kOTiles - 1) / kOTiles;
  const int64_t cache_n = static_cast<int64_t>(kSlots) * kHeads * kD;
  std::vector<Layer> layers(kLayers);
  auto halves = [](int64_t n) { __half* p; CK(cudaMalloc(&p, n * 2)); return p; };
  for (int l = 0; l < kLayers; ++l) {
    Layer& L = layers[l];
    int4 *a, *b;
    CK(cudaMalloc(&a, nqkv * 16));
    CK(cudaMalloc(&b, no * 16));
    fill_kernel<<<1024, 256>>>(a, nqkv, 11u + l);
    fill_kernel<<<1024, 256>>>(b, no, 101u + l);
    L.wqkv = a, L.wo = b;
    L.q = halves(kHidden), L.k = halves(kHidden), L.v = halves(kHidden), L.att = halves(kHidden), L.x = halves(kHidden);
    L.kc = halves(cache_n), L.vc = halves(cache_n);
    CK(cudaMalloc(&L.cnt, kHeads * 4));
    CK(cudaMemset(L.cnt, 0, kHeads * 4));
  }
  __half* x0 = halves(kHidden);
  fill_half_kernel<<<16, 256>>>(x0, kHidden, 7u);
  // cos/sin table (max_pos kSlots, D): cos of pair i at [i], sin at [D/2 + i], theta 10000
  std::vector<float> cs(static_cast<size_t>(kSlots) * kD);
  for (int p = 0; p < kSlots; ++p)
    for (int i = 0; i < kD / 2; ++i) {
      const double f = p * std::pow(10000.0, -2.0 * i / kD);
      cs[p * kD + i] = static_cast<float>(std::cos(f));
      cs[p * kD + kD / 2 + i] = static_cast<float>(std::sin(f));
    }
  float* cos_sin;
  CK(cudaMalloc(&cos_sin, cs.size() * 4));
  CK(cudaMemcpy(cos_sin, cs.data(), cs.size() * 4, cudaMemcpyHostToDevice));
  // the library's attention: one sequence, one page of kSlots slots, length kPos + 1
  int* table;
  int64_t *cu, *lens;
  CK(cudaMalloc(&table, 4));
  CK(cudaMemset(table, 0, 4));
  CK(cudaMalloc(&cu, 16));
  CK(cudaMalloc(&lens, 8));
  const int64_t cu_h[2] = {0, 1}, len_h = kPos + 1;
  CK(cudaMemcpy(cu, cu_h, 16, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(lens, &len_h, 8, cudaMemcpyHostToDevice));
  const int splits = 5, chunk = 64;     // ops/attention.py's choice here (pick_splits: 1 row x 32 kv heads, 264 keys)
  auto attn_args = [&](const Layer& L) {
    exl_attn::Args a{};
    a.q = L.q, a.k = L.kc, a.v = L.vc, a.table = table, a.cu_q = cu, a.lens = lens, a.out = L.att;
    a.out_map = exl_attn::OutMap{nullptr, nullptr, kHidden};
    a.S = 1, a.W = 1, a.page = kSlots, a.P = 1, a.Hq = kHeads, a.Hkv = kHeads, a.window = 0;
    a.chunk = chunk, a.splits = splits, a.scale_log2 = kScaleLog2;
    a.cluster = true, a.head_major = true, a.early = true, a.stage2 = true;
    a.k_new = L.k, a.v_new = L.v, a.cos_sin = cos_sin, a.max_pos = kSlots;
    return a;
  };
  auto reset_caches = [&]() {
    for (int l = 0; l < kLayers; ++l) {
      fill_half_kernel<<<512, 256>>>(layers[l].kc, cache_n, 1000u + l);
      fill_half_kernel<<<512, 256>>>(layers[l].vc, cache_n, 2000u + l);
    }
    CK(cudaDeviceSynchronize());
  };
  reset_caches();
  printf("GPU %s, %d SMs; q/k/v %.2f MB, o %.2f MB a layer; position %d, %d kv heads of %d\n", prop.name, sms,
         nqkv * 16 / 1e6, no * 16 / 1e6, kPos, kHeads, kD);

  cudaLaunchAttribute attr[1];
  auto launch_qkv = [&](auto kern, const Layer& L, const __half* in, cudaStream_t s) {
    cudaLaunchConfig_t cfg = pdl_config(dim3(kQkvTiles), dim3(kQkvThreads), 0, s, attr);
    CK(cudaLaunchKernelEx(&cfg, kern, L, in, per_qkv, nqkv, static_cast<const float*>(cos_sin)));
  };
  auto launch_o = [&](const Layer& L, const __half* in, cudaStream_t s) {
    cudaLaunchConfig_t cfg = pdl_config(dim3(kOTiles), dim3(kOThreads), 0, s, attr);
    CK(cudaLaunchKernelEx(&cfg, o_kernel, L, in, per_o, no));
  };
  auto launch_attn = [&](const Layer& L, cudaStream_t s) {
    cudaLaunchAttribute at2[2];
    cudaLaunchConfig_t cfg = pdl_config(dim3(kHeads, 1, splits), dim3(exl_attn::kThreads), 0, s, attr);
    at2[0] = attr[0];
    at2[1].id = cudaLaunchAttributeClusterDimension;
    at2[1].val.clusterDim.x = 1, at2[1].val.clusterDim.y = 1, at2[1].val.clusterDim.z = splits;
    cfg.attrs = at2;
    cfg.numAttrs = 2;
    CK(cudaLaunchKernelEx(&cfg, exl_attn::paged_attention_kernel<__half, kD, 1, false, true>, attn_args(L)));
  };
  auto chain = [&](char kind) {
    return [&, kind](cudaStream_t s) {
      const __half* in = x0;
      for (int l = 0; l < kLayers; ++l) {
        const Layer& L = layers[l];
        if (kind == 'E') launch_qkv(qkv_kernel<false, false>, L, in, s), launch_o(L, L.q, s);
        if (kind == 'A') launch_qkv(qkv_kernel<false, false>, L, in, s), launch_attn(L, s), launch_o(L, L.att, s);
        if (kind == 'B') launch_qkv(qkv_kernel<true, false>, L, in, s), launch_o(L, L.att, s);
        if (kind == 'P') launch_qkv(qkv_kernel<true, true>, L, in, s), launch_o(L, L.att, s);
        in = L.x;
      }
    };
  };
  // correctness first: one pass of A, keep the last layer's attention output and cache rows; then B and B2
  auto snapshot = [&](const Layer& L, std::vector<__half>& att, std::vector<__half>& krow) {
    att.resize(kHidden);
    krow.resize(2 * kHidden);
    CK(cudaMemcpy(att.data(), L.att, kHidden * 2, cudaMemcpyDeviceToHost));
    const int64_t off = static_cast<int64_t>(kPos) * kHeads * kD;
    CK(cudaMemcpy(krow.data(), L.kc + off, kHidden * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(krow.data() + kHidden, L.vc + off, kHidden * 2, cudaMemcpyDeviceToHost));
  };
  auto once = [&](char kind) {
    reset_caches();
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    chain(kind)(s);
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    CK(cudaStreamDestroy(s));
  };
  std::vector<__half> att_a, kv_a, att_b, kv_b;
  once('A');
  snapshot(layers[kLayers - 1], att_a, kv_a);
  for (char kind : {'B', 'P'}) {
    once(kind);
    snapshot(layers[kLayers - 1], att_b, kv_b);
    float da = 0.f, dk = 0.f, amax = 0.f;
    for (int i = 0; i < kHidden; ++i) {
      da = std::fmax(da, std::fabs(__half2float(att_a[i]) - __half2float(att_b[i])));
      amax = std::fmax(amax, std::fabs(__half2float(att_a[i])));
    }
    for (int i = 0; i < 2 * kHidden; ++i) dk = std::fmax(dk, std::fabs(__half2float(kv_a[i]) - __half2float(kv_b[i])));
    printf("check %c against A: attention max |diff| %.3e (max |A| %.3f), K/V row max |diff| %.3e\n", kind, da, amax,
           dk);
    printf("JSON {\"check\": \"%c\", \"att_max_diff\": %.4e, \"kv_max_diff\": %.4e}\n", kind, da, dk);
  }
  // timings (the caches' contents do not change the work: every key is read in every replay)
  const char* names[] = {"E: q/k/v -> o (no attention)", "A: q/k/v -> paged attention -> o",
                         "B: q/k/v with attention in the tail -> o", "B2: B + L2 prefetch of the old K/V"};
  const char kinds[] = {'E', 'A', 'B', 'P'};
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 4; ++i) {
      const float us = time_seq(chain(kinds[i])) / kLayers;
      printf("%-44s round %d  %8.2f us/layer\n", names[i], r + 1, us);
      printf("JSON {\"variant\": \"%c\", \"round\": %d, \"us_per_layer\": %.2f}\n", kinds[i], r + 1, us);
    }
  return 0;
}
