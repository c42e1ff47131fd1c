// The kernels of exl_core::paged_attention (schema in csrc/cpu/attention.cpp) and exl_core::paged_attention_rope, without
// torch headers (host side, checks and registration: paged_attention_cuda.cu): attention of a few query rows per
// sequence straight over the paged K/V cache, for decode and speculative verification; with ROPE, decode's rope and
// K/V write in the same launch -- it writes the rows' own key and value to the cache (the ROPE instances, below).
// The gathering fallback (ops/attention_gathered.py) copies every sequence's pages into a padded (S, Hkv, L, D)
// tensor, zeroes the unwritten slots and runs a masked SDPA: ~5 passes over the K/V bytes per layer. Here each K/V
// byte a row can see is read once per row.
//
// Work split (flash-decoding): one block per (query row, kv head, key split). A block owns every
// query head of its kv head (G = Hq / Hkv heads, GQA), so K and V are read once for the group. Each
// lane loads 8 consecutive elements (16 bytes) of a key row; D/8 lanes cover one key, so a warp
// walks 32/(D/8) keys per step and each lane group keeps its own online-softmax state (max, sum,
// 8 output values per head) in registers; the groups merge through shared memory at the end.
// With one split the block writes the output. With several on sm_90 (up to 8: a portable cluster) and a grid of
// about one wave (at most 2 blocks per SM), the splits of a (row, kv head) run as one thread-block cluster: each leaves its unnormalised partial (sum p*v,
// max, sum p) in its shared memory and rank 0 merges them through distributed shared memory, in split order
// (no second launch: the combine kernel was 2.3 us of a ~2.7 ms batch-1 step, once per layer). Otherwise
// each split writes its partial to global memory and paged_attention_combine_kernel merges them.
//
// The number of splits depends only on shapes the host knows (rows, kv heads, table width x page
// size), never on device values, so a CUDA graph can record the call. Every row reads the K/V of keys
// [lo, pos] only: pos = seq_lens_k[s] - q_len_s + j, lo = pos - window + 1 (window > 0) or 0; K/V slots
// past a sequence's end and pages outside its window (-1 in the table) are never read (a split's table
// entries are, -1 included, when staged). Page numbers are clamped into the cache, so a corrupt table
// (-1 or out of range inside the visible keys) reads the wrong page, never out of bounds: its output is
// undefined, where the CPU kernel raises; the library's own tables never hold one.
// Math in fp32 (scores scaled in the log2 domain, exp2f); output in q's dtype.
#pragma once
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "act_device.cuh"
#include "cp_async_device.cuh"
#include "pdl_device.cuh"

namespace exl_attn {

constexpr int kThreads = 128;                 // 4 warps per block
constexpr int kWarps = kThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kStagedPages = 128;             // page numbers of a split held in shared memory

// fp16 / bf16 pairs and single values to and from fp32
__device__ __forceinline__ float2 pair_f32(__half2 h) { return __half22float2(h); }
__device__ __forceinline__ float2 pair_f32(__nv_bfloat162 h) { return __bfloat1622float2(h); }
__device__ __forceinline__ void store_f32(float v, __half* out) { *out = __float2half_rn(v); }
__device__ __forceinline__ void store_f32(float v, __nv_bfloat16* out) { *out = __float2bfloat16_rn(v); }
template <typename T> struct PairOf;
template <> struct PairOf<__half> { using type = __half2; };
template <> struct PairOf<__nv_bfloat16> { using type = __nv_bfloat162; };

template <typename T> struct Vec {            // 8 elements (16 bytes) <-> fp32
  static __device__ __forceinline__ void to_f32(const uint4& u, float* f) {
    const auto* h = reinterpret_cast<const typename PairOf<T>::type*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = pair_f32(h[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
  static __device__ __forceinline__ T from_f32(float v) {
    T out;
    store_f32(v, &out);
    return out;
  }
};

// Where the output's columns go.  Plain (pos nullptr): row r's column c (= head * D + d) at r * cols + c, cols = Hq * D.
// Permuted (o_proj's act-order, ops/attention.py rope_paged_attention_ordered): at r * cols + pos[c], and also at
// r * cols + pos2[c] where pos2 has one (>= 0: an extra row of a weight rewritten as uniform 4-bit reads column c
// again), so the o projection reads its input without a gather.  pos / pos2 are load-time data (no kernel of the
// step writes them); the host guarantees every entry is inside [0, cols) and that together they cover every column of
// [0, cols) once.
struct OutMap {
  const int* pos;
  const int* pos2;
  int64_t cols;
};

// One output column's places under a permuted OutMap (as constructed, {}: not read yet; store_out then reads
// them).  The kernel reads those of the one value a thread stores before its PDL wait, not after the merge on its
// tail, where they were a dependent round trip (EXL2 batch-1 attention 7.53 us a layer with the ordered store, 6.54
// with a plain one: NOTES.md session "nineteenth").
struct OutPlaces {
  int p = -2, p2 = -1;                        // p < -1: not read
};

__device__ __forceinline__ OutPlaces out_places(const OutMap& m, int col) {
  OutPlaces o{};
  if (m.pos != nullptr && col >= 0) {
    o.p = __ldg(m.pos + col);
    o.p2 = m.pos2 != nullptr ? __ldg(m.pos2 + col) : -1;
  }
  return o;
}

template <typename T>
__device__ __forceinline__ void store_out(const OutMap& m, T* out, int64_t row, int col, T val,
                                          OutPlaces pl = OutPlaces{}) {
  T* r = out + row * m.cols;
  if (m.pos == nullptr) {
    r[col] = val;
    return;
  }
  if (pl.p < -1) pl = out_places(m, col);
  r[pl.p] = val;
  if (pl.p2 >= 0) r[pl.p2] = val;
}

struct Args {
  const void* q;                 // (T, Hq, D)
  const void* k;                 // (P, page, Hkv, D)
  const void* v;
  const int* table;              // (S, W)
  const int64_t* cu_q;           // (S + 1)
  const int64_t* lens;           // (S)
  void* out;                     // (T, Hq, D) through out_map, written when splits == 1 or by the cluster merge
  OutMap out_map;
  float* part_o;                 // (splits, T, Hq, D) unnormalised sums, splits > 1
  float* part_ml;                // (splits, T, Hq, 2) running max (log2 domain) and sum
  int S, W, page, P, Hq, Hkv, window, chunk, splits;
  float scale_log2;              // softmax scale * log2(e)
  bool cluster;                  // splits > 1 launched as clusters (1, 1, splits): merged in-kernel
  bool head_major;               // grid (Hkv, rows, splits): blocks next in launch order share a row (below)
  bool early;                    // the first keys' K/V loaded before the PDL wait (below)
  bool stage2;                   // with early, STAGE2 instances also stage the second iteration's old keys (below)
  // paged_attention_rope (ROPE instances): q above and k_new / v_new are the projections' rows before rope; the
  // kernel rotates them at the row's position (rope_kv_write's math) and writes the row's own key and value to its
  // slot (below)
  const void* k_new;             // (T, Hkv, D)
  const void* v_new;
  const float* cos_sin;          // (max_pos, D) fp32: cos of pair i at [i], sin at [D/2 + i]
  int64_t max_pos;
};
constexpr int kMaxClusterSplits = 8;   // portable cluster size

// The sequence of query row `row`: the s with cu_q[s] <= row < cu_q[s + 1] (empty sequences skipped).
__device__ __forceinline__ int sequence_of(const int64_t* cu, int S, int64_t row) {
  int lo = 0, hi = S - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (cu[mid + 1] > row) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// Launch order (head_major): blocks next to each other in the grid read the same key slots of one sequence for
// neighbouring kv heads -- in the (pages, page, Hkv, D) cache those are adjacent 2*D-byte pieces of one
// Hkv*D*2-byte slot -- instead of the same head of different sequences.
// Before the PDL wait (early): the row's sequence, length and page numbers (written by no kernel of this step) and
// the K/V of the block's first keys that are older than the step's rows (a register iteration, and with STAGE2 a second
// one in shared memory).  The kernel just before -- the step's K/V
// write, rope_kv_write or kv_write; with ROPE the q/k/v projection, and the kernel writes the own keys itself --
// writes only the rows' own positions (the last q_len keys of each sequence), so those keys, and q, are read after
// the wait (pdl.cuh's contract: nothing the predecessor writes is read early).
// Blocks per SM as the register report had them before the early loads (G 1: 94-96 registers, 5 blocks; G 2/4: 124-126,
// 4; G 8: 225-232, 2); without the bound the early loads' extra live state took G 1 to 122 (4 blocks).
// WAVE (G 1 only): 2 block steps per iteration instead of 4 and 8 blocks per SM (64 registers), for grids of 5..8
// blocks per SM -- batch 32 of a 32-kv-head model is 1,024 blocks, 1.55 waves of the 5-per-SM instance -- so the
// grid runs as one wave with the same bytes in flight per SM.
template <int G, bool WAVE> constexpr int kMinBlocks = WAVE ? 8 : G == 1 ? 5 : G <= 4 ? 4 : 2;

// 8 values [8 * sub, 8 * sub + 8) of head row x rotated at position p (rope_kv_write's math: exl_act::rope_lo/hi, then
// rounded to T); the partner half comes from memory, not another lane.  A position outside the table gives NaN.
template <typename T, int D>
__device__ __forceinline__ uint4 rope8(const T* x, int sub, const float* cos_sin, int64_t p, int64_t max_pos) {
  constexpr int kHalf = D / 2;
  const int e0 = sub * 8;
  const bool lo = e0 < kHalf;
  const int i0 = lo ? e0 : e0 - kHalf;                           // pair index of the first value
  float own[8], other[8], c[8], sn[8];
  Vec<T>::to_f32(__ldg(reinterpret_cast<const uint4*>(x + e0)), own);
  Vec<T>::to_f32(__ldg(reinterpret_cast<const uint4*>(x + (lo ? e0 + kHalf : i0))), other);
  const bool ok = p >= 0 && p < max_pos;
  const float* cr = cos_sin + (ok ? p : 0) * D + i0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float4 cv = __ldg(reinterpret_cast<const float4*>(cr) + h), sv = __ldg(reinterpret_cast<const float4*>(cr + kHalf) + h);
    c[4 * h] = cv.x, c[4 * h + 1] = cv.y, c[4 * h + 2] = cv.z, c[4 * h + 3] = cv.w;
    sn[4 * h] = sv.x, sn[4 * h + 1] = sv.y, sn[4 * h + 2] = sv.z, sn[4 * h + 3] = sv.w;
  }
  uint4 out;
  T* o = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float cc = ok ? c[e] : __int_as_float(0x7fc00000);
    o[e] = Vec<T>::from_f32(lo ? exl_act::rope_lo(own[e], other[e], cc, sn[e])
                               : exl_act::rope_hi(other[e], own[e], cc, sn[e]));
  }
  return out;
}

// ROPE (exl_core::paged_attention_rope, decode: one query row per sequence): a.q, a.k_new, a.v_new are unrotated;
// after the PDL wait every block rotates its q heads into shared memory, and the one block whose split holds the
// row's position (its own key, the last) rotates that key from k_new (and copies its value from v_new) into shared
// memory too -- `fetch` takes them from there, not back from the cache, whose loads are ld.global.nc -- and stores
// both to the key's slot for later steps (a page outside the cache: not stored, as kv_write skips such a slot).
// The rope_kv_write launch before attention goes away (H200, same call: GPTQ decode 1.0225x at batch 1, 1.0228x at
// batch 32; NOTES.md session "ninth").
template <typename T, int D, int G, bool WAVE = false, bool ROPE = false>
__global__ void __launch_bounds__(kThreads, kMinBlocks<G, WAVE>) paged_attention_kernel(const Args a) {
  constexpr int LPK = D / 8;                  // lanes per key
  constexpr int KPW = 32 / LPK;               // keys per warp step
  constexpr int NG = kWarps * KPW;            // lane groups per block
  constexpr int KPB = NG;                     // keys per block step
  __shared__ float sm_acc[NG][G][D];
  __shared__ float sm_m[NG][G], sm_l[NG][G];
  __shared__ int sm_pages[kStagedPages];
  __shared__ float cl_m[G], cl_l[G];          // this split's max and sum per head (cluster merge)
  __shared__ __align__(16) T sm_rope[ROPE ? (G + 2) * D : D];   // ROPE: rotated q heads, own key, own value
  auto rope_row = [&](int h) { return sm_rope + (ROPE ? h : 0) * D; };   // (row 0 only in other instances: unused)

  const int kvh = a.head_major ? blockIdx.x : blockIdx.y, split = blockIdx.z;
  const int gq = a.Hq / a.Hkv;                                    // real heads per kv head (<= G)
  // The places of the one output value this thread stores (out_places), where this block stores the output (the only
  // split, or rank 0 of a cluster: its rank is blockIdx.z, the host's cluster spanning the splits) and its group holds
  // at most kThreads values (G * D <= 128: G 1 at D 64 / 128, G 2 at D 64); larger groups store several values a
  // thread and their instances are near the register limit.
  const int tid = static_cast<int>(threadIdx.x);
  const bool stores_one = G * D <= kThreads && tid < gq * D && (a.splits == 1 || (a.cluster && split == 0));
  const OutPlaces pl0 = out_places(a.out_map, stores_one ? (kvh * gq + tid / D) * D + tid % D : -1);
  if (!a.early) {
    exl_pdl::pdl_wait();                      // q, K and V come from the kernels just before
    exl_pdl::pdl_trigger();
  }
  const int64_t row = a.head_major ? blockIdx.y : blockIdx.x;
  const int64_t rows = a.head_major ? gridDim.y : gridDim.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grp = warp * KPW + lane / LPK, sub = lane % LPK;      // lane group, 8-element slice in the key

  // The row's sequence: decode batches have cu_q = 0, 1, 2, ... so s = row is tried first (two loads
  // in flight together) before the binary search (log2 S dependent loads).
  int s = row < a.S ? static_cast<int>(row) : a.S - 1;
  int64_t cs = a.cu_q[s], ce = a.cu_q[s + 1];
  if (!(cs <= row && row < ce)) {
    s = sequence_of(a.cu_q, a.S, row);
    cs = a.cu_q[s];
    ce = a.cu_q[s + 1];
  }
  // This split's page numbers to shared memory, read while the row's length is on its way (they depend
  // on the split, not on the length); clamped into the cache so a corrupt table cannot read out of bounds.
  const int* trow = a.table + static_cast<int64_t>(s) * a.W;
  const int k0 = split * a.chunk;
  const int p0 = k0 / a.page;
  const int kmax = a.W * a.page;
  const int np = k0 < kmax ? ((k0 + a.chunk < kmax ? k0 + a.chunk : kmax) - 1) / a.page - p0 + 1 : 0;
  const int staged = np < kStagedPages ? np : kStagedPages;
  for (int i = threadIdx.x; i < staged; i += kThreads) {
    const int pg = trow[p0 + i];
    sm_pages[i] = pg < 0 ? 0 : (pg >= a.P ? a.P - 1 : pg);
  }
  const int64_t pos = a.lens[s] - (ce - cs) + (row - cs);        // this row's position = its last key
  int64_t lo = a.window > 0 ? pos - a.window + 1 : 0;
  if (lo < 0) lo = 0;
  const int first = static_cast<int>(k0 > lo ? k0 : lo);
  const int end = static_cast<int>(k0 + a.chunk < pos + 1 ? k0 + a.chunk : pos + 1);   // exclusive
  // keys before `fresh` were written by earlier steps; [fresh, end) by the kernel just before (the rows' own)
  const int64_t own0 = pos - (row - cs);                         // the sequence's first row's position
  const int fresh = static_cast<int>(own0 < first ? first : own0 < end ? own0 : end);

  const T* kbase = static_cast<const T*>(a.k);
  const T* vbase = static_cast<const T*>(a.v);
  const int64_t slot_stride = static_cast<int64_t>(a.Hkv) * D;   // elements between two slots of a page
  const int pshift = (a.page & (a.page - 1)) == 0 ? __ffs(a.page) - 1 : -1;   // power-of-two pages: shifts
  __syncthreads();                                                // sm_pages
  // U block steps per iteration, and the next iteration's loads issued before this one's math
  // (software pipeline): 2U keys' K and V per lane group in flight. Fewer for large groups (registers).
  constexpr int U = G <= 2 && !WAVE ? 4 : 2;
  // STAGE2 (G 1, not WAVE): the keys of the loop's second iteration that are older than the step's rows also go to
  // shared memory before the PDL wait (cp.async, each lane its own slices, read back by the same lane: no barrier),
  // so a split of up to two iterations (batch 1 of the bench's 7B: 64 keys) loads no old key after the wait.
  constexpr bool STAGE2 = G == 1 && !WAVE;
  constexpr int KS = U * KPB;                                     // keys per iteration
  __shared__ __align__(16) T sm_kv[STAGE2 ? 2 * KS * D : 8];      // K then V of keys [st_lo, st_lo + KS)
  int st_lo = 0, st_hi = 0;                                       // the staged keys [st_lo, st_hi)
  // element offset of this lane's 8 values of key t in the K (or V) cache
  auto key_off = [&](int t) -> int64_t {
    const int pi = pshift >= 0 ? t >> pshift : t / a.page;
    const int slot = pshift >= 0 ? t & (a.page - 1) : t - pi * a.page;
    int pg;
    if (pi - p0 < staged) {
      pg = sm_pages[pi - p0];
    } else {                                                      // past the staged pages (tiny pages)
      pg = pi < a.W ? trow[pi] : 0;
      pg = pg < 0 ? 0 : (pg >= a.P ? a.P - 1 : pg);
    }
    return (static_cast<int64_t>(pg) * a.page + slot) * slot_stride + kvh * D + sub * 8;
  };
  // the K and V rows of keys b0 + u * KPB + grp that lie in [lo_t, hi_t)
  auto fetch = [&](int b0, uint4 (&kr)[U], uint4 (&vr)[U], int lo_t, int hi_t) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = b0 + u * KPB + grp;
      if (t >= lo_t && t < hi_t) {
        if (STAGE2 && t >= st_lo && t < st_hi) {
          const int i = (t - st_lo) * D + sub * 8;
          kr[u] = *reinterpret_cast<const uint4*>(sm_kv + i);
          vr[u] = *reinterpret_cast<const uint4*>(sm_kv + KS * D + i);
          continue;
        }
        const int64_t off = key_off(t);
        if (ROPE && t == pos) {                                   // the row's own key, staged (after the PDL wait)
          kr[u] = *reinterpret_cast<const uint4*>(rope_row(G) + sub * 8);
          vr[u] = *reinterpret_cast<const uint4*>(rope_row(G + 1) + sub * 8);
        } else {
          kr[u] = __ldg(reinterpret_cast<const uint4*>(kbase + off));
          vr[u] = __ldg(reinterpret_cast<const uint4*>(vbase + off));
        }
      }
    }
  };
  // ROPE: the block's q heads rotated into sm_rope[0, gq), and where this split holds the row's own key, that key
  // rotated (sm_rope[G]) and its value (sm_rope[G + 1]), also stored to their slot.  In shared memory, not in each
  // lane's registers inside fetch: inlined there, the rotation spilled the 64- and 96-register instances.
  auto stage_rope = [&]() {
    constexpr int kPieces = D / 8;
    const bool own = pos >= k0 && pos < k0 + a.chunk;
    const T* qh = static_cast<const T*>(a.q) + (row * a.Hq + static_cast<int64_t>(kvh) * gq) * D;
    const int64_t kv_src = (row * a.Hkv + kvh) * D;
    for (int i = threadIdx.x; i < (gq + (own ? 1 : 0)) * kPieces; i += kThreads) {
      const int h = i / kPieces, sb = i % kPieces;
      const bool key = h == gq;
      const uint4 r = rope8<T, D>(key ? static_cast<const T*>(a.k_new) + kv_src : qh + h * D, sb, a.cos_sin, pos,
                                  a.max_pos);
      *reinterpret_cast<uint4*>(rope_row(key ? G : h) + sb * 8) = r;
      if (key) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(a.v_new) + kv_src + sb * 8));
        *reinterpret_cast<uint4*>(rope_row(G + 1) + sb * 8) = v;
        const int pi = static_cast<int>(pos / a.page);
        const int pg = pi < a.W ? trow[pi] : -1;
        if (pg >= 0 && pg < a.P) {                                // a slot outside the cache is skipped (kv_write)
          const int64_t off = (static_cast<int64_t>(pg) * a.page + (pos - static_cast<int64_t>(pi) * a.page)) *
                                  slot_stride + kvh * D + sb * 8;
          *reinterpret_cast<uint4*>(const_cast<T*>(kbase) + off) = r;
          *reinterpret_cast<uint4*>(const_cast<T*>(vbase) + off) = v;
        }
      }
    }
    __syncthreads();
  };
  uint4 kn[U], vn[U];
  if constexpr (ROPE) {
    if (!a.early) stage_rope();
  }
  if (first < end) fetch(first, kn, vn, first, a.early ? fresh : end);
  if constexpr (STAGE2) {
    if (a.early && a.stage2) {
      st_lo = first + KS;
      st_hi = fresh < st_lo + KS ? fresh : st_lo + KS;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int t = st_lo + u * KPB + grp;
        if (t < st_hi) {
          const int64_t off = key_off(t);
          const int i = (t - st_lo) * D + sub * 8;
          cp_async16(sm_kv + i, kbase + off);
          cp_async16(sm_kv + KS * D + i, vbase + off);
        }
      }
    }
  }
  if (a.early) {
    exl_pdl::pdl_wait();                      // q and the rows' own K/V come from the kernel just before
    exl_pdl::pdl_trigger();
    if constexpr (ROPE) stage_rope();
    if (fresh < end) fetch(first, kn, vn, fresh, end);
  }

  float qf[G][8];                                                 // q * scale * log2(e), this lane's slice
  const T* qbase = static_cast<const T*>(a.q) + (row * a.Hq + static_cast<int64_t>(kvh) * gq) * D + sub * 8;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (g < gq) {
      Vec<T>::to_f32(ROPE ? *reinterpret_cast<const uint4*>(rope_row(g) + sub * 8)
                          : *reinterpret_cast<const uint4*>(qbase + g * D), qf[g]);
#pragma unroll
      for (int i = 0; i < 8; ++i) qf[g][i] *= a.scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) qf[g][i] = 0.f;
    }
  }
  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
  }

  if constexpr (STAGE2) {
    if (st_hi > st_lo) cp_async_wait_all();                       // this lane's staged keys (its own copies)
  }
  for (int b0 = first; b0 < end; b0 += U * KPB) {
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      kr[u] = kn[u];
      vr[u] = vn[u];
    }
    if (b0 + U * KPB < end) fetch(b0 + U * KPB, kn, vn, first, end);
    // scores of this lane group's U keys for every head, then one rescale per head for all U
    float sc[U][G];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool ok = b0 + u * KPB + grp < end;
      float kf[8];
      Vec<T>::to_f32(kr[u], kf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float x = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) x = fmaf(qf[g][i], kf[i], x);
#pragma unroll
        for (int o = LPK / 2; o; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);   // within the lane group
        sc[u][g] = ok ? x : -INFINITY;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mn = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) mn = fmaxf(mn, sc[u][g]);
      if (mn == -INFINITY) continue;                              // this group saw no key yet
      const float corr = exp2f(m[g] - mn);                        // m = -inf at first: corr = 0
      l[g] *= corr;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] *= corr;
      m[g] = mn;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = exp2f(sc[u][g] - mn);                    // 0 for keys past the end
        l[g] += p;
        sc[u][g] = p;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (b0 + u * KPB + grp >= end) continue;                    // kr/vr hold stale values there
      float vf[8];
      Vec<T>::to_f32(vr[u], vf);
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(sc[u][g], vf[i], acc[g][i]);
    }
  }

  // merge the lane groups: every group's state to shared memory, then each thread reduces outputs
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int i = 0; i < 8; ++i) sm_acc[grp][g][sub * 8 + i] = acc[g][i];
    if (sub == 0) {
      sm_m[grp][g] = m[g];
      sm_l[grp][g] = l[g];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < gq * D; idx += kThreads) {
    const int g = idx / D, d = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int r = 0; r < NG; ++r) mx = fmaxf(mx, sm_m[r][g]);
    float sum = 0.f, o = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int r = 0; r < NG; ++r) {
        const float w = exp2f(sm_m[r][g] - mx);                  // 0 for groups that saw no key
        sum = fmaf(sm_l[r][g], w, sum);
        o = fmaf(sm_acc[r][g][d], w, o);
      }
    }
    const int64_t head = static_cast<int64_t>(kvh) * gq + g;
    if (a.splits == 1) {
      store_out(a.out_map, static_cast<T*>(a.out), row, static_cast<int>(head * D + d),
                Vec<T>::from_f32(sum > 0.f ? o / sum : 0.f), idx == tid ? pl0 : OutPlaces{});
    } else if (a.cluster) {                   // this thread alone reads element (g, d) of every group: reuse group 0's
      sm_acc[0][g][d] = o;
      if (d == 0) {
        cl_m[g] = mx;
        cl_l[g] = sum;
      }
    } else {
      const int64_t pidx = (static_cast<int64_t>(split) * rows + row) * a.Hq + head;
      a.part_o[pidx * D + d] = o;
      if (d == 0) {
        a.part_ml[pidx * 2] = mx;
        a.part_ml[pidx * 2 + 1] = sum;
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (a.cluster) {                            // rank 0 merges the splits' partials, in split order
    namespace cg = cooperative_groups;
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();                                // every split's partial is in its shared memory
    if (cl.block_rank() == 0) {
      for (int idx = threadIdx.x; idx < gq * D; idx += kThreads) {
        const int g = idx / D, d = idx % D;
        float mx = -INFINITY;
        for (int z = 0; z < a.splits; ++z) mx = fmaxf(mx, *cl.map_shared_rank(&cl_m[g], z));
        float sum = 0.f, o = 0.f;
        if (mx != -INFINITY) {
          for (int z = 0; z < a.splits; ++z) {
            const float w = exp2f(*cl.map_shared_rank(&cl_m[g], z) - mx);
            sum = fmaf(*cl.map_shared_rank(&cl_l[g], z), w, sum);
            o = fmaf(*cl.map_shared_rank(&sm_acc[0][g][d], z), w, o);
          }
        }
        const int64_t head = static_cast<int64_t>(kvh) * gq + g;
        store_out(a.out_map, static_cast<T*>(a.out), row, static_cast<int>(head * D + d),
                  Vec<T>::from_f32(sum > 0.f ? o / sum : 0.f), idx == tid ? pl0 : OutPlaces{});
      }
    }
    cl.sync();                                // the other splits keep their shared memory until rank 0 is done
  }
#else
  if (a.cluster) __trap();                    // the host sets cluster only on sm_90 devices, which run sm_90 code
#endif
}

// One block of D threads per (row, head): merge the splits' partials.
template <typename T>
__global__ void paged_attention_combine_kernel(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                               int splits, int64_t rows_heads, int D, int Hq, OutMap out_map,
                                               T* __restrict__ out) {
  exl_pdl::pdl_wait();
  exl_pdl::pdl_trigger();
  const int64_t rh = blockIdx.x;
  float mx = -INFINITY;
  for (int z = 0; z < splits; ++z) mx = fmaxf(mx, part_ml[(z * rows_heads + rh) * 2]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float sum = 0.f, o = 0.f;
    if (mx != -INFINITY) {
      for (int z = 0; z < splits; ++z) {
        const int64_t p = z * rows_heads + rh;
        const float w = exp2f(part_ml[p * 2] - mx);
        sum = fmaf(part_ml[p * 2 + 1], w, sum);
        o = fmaf(part_o[p * D + d], w, o);
      }
    }
    store_out(out_map, out, rh / Hq, static_cast<int>((rh % Hq) * D + d), Vec<T>::from_f32(sum > 0.f ? o / sum : 0.f));
  }
}

}  // namespace exl_attn
