// Paged causal attention on CPU (exl_core::paged_attention).
//
//   q (T, Hq, D)            k_cache, v_cache (num_pages, page_size, Hkv, D)
//   block_table int32 [S, max_pages]   cu_seqlens_q int64 [S+1]   seq_lens_k int64 [S]
//   -> out (T, Hq, D) in q's dtype, fp32 math
//
// Work item = (sequence, tile of up to ROWS query rows, kv head); the rep = Hq/Hkv query heads
// of that kv head share every key/value load. Keys are visited in ascending position, in
// blocks aligned to absolute positions (multiples of BK), and each (row, head) keeps its own
// online-softmax state (m, l, acc). Which keys a row sees and the order it sees them in depend
// only on that row's position and window, so results are bit-identical whatever else shares
// the call (batch invariance). Table entries of pages no row of the tile needs are never read.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "simd_util.h"
#include "kernels.h"

namespace {

using namespace exl_cpu;

constexpr int BK = 16;        // keys per block (one AVX-512 lane each)
constexpr int ROWS = 4;       // query rows per work item
constexpr int MAX_REP = 16;   // query heads per kv head
constexpr int MAX_NQ = ROWS * MAX_REP;

struct Item {
  int64_t seq, row0, nrows, kvh;
};

struct Args {
  int64_t hq, hkv, rep, page_size, max_pages, window;
  float scale;
  const int32_t* table;
  const int64_t* cu;
  const int64_t* lens;
};

// Dot products of one query vector with the BK=16 keys of a block: lane j = q . kb[j].
// Each key's 16 partial sums are folded by a fixed shuffle tree (no per-key horizontal sum).
template <int NC>
EXL_AVX512 inline __m512 dot16_keys(const __m512* qv, const float (*kb)[NC * 16]) {
  __m512 d[16];
  for (int j = 0; j < 16; ++j) {
    __m512 a = _mm512_mul_ps(qv[0], _mm512_load_ps(kb[j]));
    for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_load_ps(kb[j] + c * 16), a);
    d[j] = a;
  }
  // pairs inside 128-bit lanes: (j, j+1) -> [a_j, a_j+1, b_j, b_j+1] per 128-bit lane
  __m512 p[8];
  for (int j = 0; j < 8; ++j)
    p[j] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * j], d[2 * j + 1]), _mm512_unpackhi_ps(d[2 * j], d[2 * j + 1]));
  // quads: each 128-bit lane L holds the lane-L sums of keys 4i..4i+3
  __m512 qd[4];
  for (int i = 0; i < 4; ++i)
    qd[i] = _mm512_add_ps(_mm512_shuffle_ps(p[2 * i], p[2 * i + 1], 0x44), _mm512_shuffle_ps(p[2 * i], p[2 * i + 1], 0xEE));
  // across 128-bit lanes
  __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(qd[0], qd[1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(qd[0], qd[1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(qd[2], qd[3], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(qd[2], qd[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t, u, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(t, u, _MM_SHUFFLE(3, 1, 3, 1)));
}

// ---------------------------------------------------------------------------------------------
// AVX-512 path; D is 64 or 128 (NC = D/16 vector chunks).
template <int D, typename QT, typename KT>
EXL_AVX512 void item_avx512(const Item& it, const Args& a, const QT* q, const KT* kc, const KT* vc, QT* out) {
  constexpr int NC = D / 16;
  const int64_t rep = a.rep, nq = it.nrows * rep;
  const int32_t* trow = a.table + it.seq * a.max_pages;
  const int64_t klen = a.lens[it.seq];
  const int64_t qlen = a.cu[it.seq + 1] - a.cu[it.seq];
  const int64_t t0 = a.cu[it.seq] + it.row0;  // first flat row of the tile

  // Per query vector n = r * rep + h: scaled q, softmax state, accumulator.
  alignas(64) float qf[MAX_NQ][D];
  alignas(64) float acc[MAX_NQ][D];
  float m[MAX_NQ], l[MAX_NQ];
  int64_t lo[ROWS], hi[ROWS];
  int64_t tile_lo = INT64_MAX, tile_hi = -1;
  for (int64_t r = 0; r < it.nrows; ++r) {
    hi[r] = klen - qlen + it.row0 + r;
    lo[r] = a.window > 0 ? std::max<int64_t>(0, hi[r] - a.window + 1) : 0;
    tile_lo = std::min(tile_lo, lo[r]);
    tile_hi = std::max(tile_hi, hi[r]);
  }
  const __m512 sc = _mm512_set1_ps(a.scale);
  for (int64_t n = 0; n < nq; ++n) {
    int64_t r = n / rep, h = n % rep;
    const QT* src = q + ((t0 + r) * a.hq + it.kvh * rep + h) * D;
    for (int c = 0; c < NC; ++c) {
      _mm512_store_ps(qf[n] + c * 16, _mm512_mul_ps(load16(src + c * 16), sc));
      _mm512_store_ps(acc[n] + c * 16, _mm512_setzero_ps());
    }
    m[n] = -INFINITY;
    l[n] = 0.f;
  }

  alignas(64) float kb[BK][D];   // key block converted to fp32
  alignas(64) float vb[BK][D];
  // unused rows of kb stay finite zeros (their lanes are masked, never used)
  std::memset(kb, 0, sizeof(kb));
  for (int64_t b0 = tile_lo - tile_lo % BK; b0 <= tile_hi; b0 += BK) {
    const int64_t j0 = std::max(b0, tile_lo), j1 = std::min(b0 + BK - 1, tile_hi);  // inclusive
    int64_t page_i = j0 / a.page_size, slot = j0 % a.page_size;  // walk pages without dividing per key
    for (int64_t p = j0; p <= j1; ++p, ++slot) {
      if (slot == a.page_size) slot = 0, ++page_i;
      const int64_t off = ((int64_t)trow[page_i] * a.page_size + slot) * a.hkv * D + it.kvh * D;
      const KT* kp = kc + off;
      const KT* vp = vc + off;
      for (int c = 0; c < NC; ++c) {
        _mm512_store_ps(kb[p - b0] + c * 16, load16(kp + c * 16));
        _mm512_store_ps(vb[p - b0] + c * 16, load16(vp + c * 16));
      }
    }
    for (int64_t n = 0; n < nq; ++n) {
      const int64_t r = n / rep;
      const int64_t v0 = std::max(b0, lo[r]), v1 = std::min(b0 + BK - 1, hi[r]);  // row's keys here
      if (v0 > v1) continue;
      // scores of all 16 keys of the block (fixed-order dots + fixed transpose-reduce tree);
      // lanes outside the row's keys are replaced by -inf below, whatever they hold
      __m512 qv[NC];
      for (int c = 0; c < NC; ++c) qv[c] = _mm512_load_ps(qf[n] + c * 16);
      __m512 sv = dot16_keys<NC>(qv, kb);
      const __mmask16 valid = (__mmask16)((((1u << (v1 - v0 + 1)) - 1u)) << (v0 - b0));
      sv = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, sv);
      const float m_new = std::max(m[n], hmax16(sv));
      __m512 pv = exp16(_mm512_sub_ps(sv, _mm512_set1_ps(m_new)));  // invalid lanes -> 0
      pv = _mm512_maskz_mov_ps(valid, pv);
      const float corr = std::exp(m[n] - m_new);                        // 0 on the first block
      l[n] = l[n] * corr + hsum16(pv);
      m[n] = m_new;
      alignas(64) float pw[BK];
      _mm512_store_ps(pw, pv);
      __m512 av[NC];
      const __m512 cv = _mm512_set1_ps(corr);
      for (int c = 0; c < NC; ++c) av[c] = _mm512_mul_ps(_mm512_load_ps(acc[n] + c * 16), cv);
      for (int64_t p = v0; p <= v1; ++p) {
        const __m512 w = _mm512_set1_ps(pw[p - b0]);
        for (int c = 0; c < NC; ++c) av[c] = _mm512_fmadd_ps(w, _mm512_load_ps(vb[p - b0] + c * 16), av[c]);
      }
      for (int c = 0; c < NC; ++c) _mm512_store_ps(acc[n] + c * 16, av[c]);
    }
  }
  for (int64_t n = 0; n < nq; ++n) {
    int64_t r = n / rep, h = n % rep;
    QT* dst = out + ((t0 + r) * a.hq + it.kvh * rep + h) * D;
    const __m512 inv = _mm512_set1_ps(1.0f / l[n]);
    for (int c = 0; c < NC; ++c) store16(dst + c * 16, _mm512_mul_ps(_mm512_load_ps(acc[n] + c * 16), inv));
  }
}

// ---------------------------------------------------------------------------------------------
// Portable path: same visiting order, one key at a time, plain loops.
template <int D, typename QT, typename KT>
void item_scalar(const Item& it, const Args& a, const QT* q, const KT* kc, const KT* vc, QT* out) {
  const int64_t rep = a.rep;
  const int32_t* trow = a.table + it.seq * a.max_pages;
  const int64_t klen = a.lens[it.seq];
  const int64_t qlen = a.cu[it.seq + 1] - a.cu[it.seq];
  float qf[D], acc[D];
  for (int64_t r = 0; r < it.nrows; ++r) {
    const int64_t t = a.cu[it.seq] + it.row0 + r;
    const int64_t hi = klen - qlen + it.row0 + r;
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, hi - a.window + 1) : 0;
    for (int64_t h = 0; h < rep; ++h) {
      const int64_t head = it.kvh * rep + h;
      const QT* src = q + (t * a.hq + head) * D;
      for (int i = 0; i < D; ++i) {
        qf[i] = to_f(src[i]) * a.scale;
        acc[i] = 0.f;
      }
      float m = -INFINITY, l = 0.f;
      int64_t page_i = lo / a.page_size, slot = lo % a.page_size;
      for (int64_t p = lo; p <= hi; ++p, ++slot) {
        if (slot == a.page_size) slot = 0, ++page_i;
        const int64_t off = ((int64_t)trow[page_i] * a.page_size + slot) * a.hkv * D + it.kvh * D;
        const KT* kp = kc + off;
        const KT* vp = vc + off;
        float sc = 0.f;
        for (int i = 0; i < D; ++i) sc += qf[i] * to_f(kp[i]);
        const float m_new = std::max(m, sc);
        const float corr = std::exp(m - m_new), w = std::exp(sc - m_new);
        l = l * corr + w;
        for (int i = 0; i < D; ++i) acc[i] = acc[i] * corr + w * to_f(vp[i]);
        m = m_new;
      }
      QT* dst = out + (t * a.hq + head) * D;
      for (int i = 0; i < D; ++i) dst[i] = from_f<QT>(acc[i] / l);
    }
  }
}

template <int D, typename QT, typename KT>
void run_items(const std::vector<Item>& items, const Args& a, const QT* q, const KT* kc, const KT* vc, QT* out) {
  const bool avx512 = cpu_isa() >= ISA_AVX512;
  at::parallel_for(0, (int64_t)items.size(), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      if (avx512)
        item_avx512<D>(items[i], a, q, kc, vc, out);
      else
        item_scalar<D>(items[i], a, q, kc, vc, out);
    }
  });
}

#define CHECK_ARG(cond, ...) TORCH_CHECK(cond, "exl_core::paged_attention: ", __VA_ARGS__)

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                               const at::Tensor& seq_lens_k, double scale, int64_t window) {
  CHECK_ARG(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous (T, Hq, D) tensor");
  CHECK_ARG(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                v_cache.is_contiguous(), "k_cache/v_cache must be contiguous (pages, page_size, Hkv, D) of equal shape");
  CHECK_ARG(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  CHECK_ARG(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  CHECK_ARG(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16,
            "k_cache must be float32 or bfloat16");
  CHECK_ARG(block_table.dim() == 2 && block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
            "block_table must be contiguous int32 [S, max_pages]");
  const int64_t S = block_table.size(0);
  CHECK_ARG(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) == S + 1 && cu_seqlens_q.scalar_type() == at::kLong &&
                cu_seqlens_q.is_contiguous(), "cu_seqlens_q must be contiguous int64 [S+1]");
  CHECK_ARG(seq_lens_k.dim() == 1 && seq_lens_k.size(0) == S && seq_lens_k.scalar_type() == at::kLong &&
                seq_lens_k.is_contiguous(), "seq_lens_k must be contiguous int64 [S]");
  const int64_t T = q.size(0), hq = q.size(1), D = q.size(2), hkv = k_cache.size(2);
  CHECK_ARG(k_cache.size(3) == D, "head dim of q (", D, ") and k_cache (", k_cache.size(3), ") differ");
  CHECK_ARG(D == 64 || D == 128, "head dim ", D, " unsupported (64 or 128)");
  CHECK_ARG(hkv > 0 && hq % hkv == 0 && hq / hkv <= MAX_REP, "q heads ", hq, " must be a multiple (<= ", MAX_REP,
            "x) of kv heads ", hkv);
  CHECK_ARG(window >= 0, "window must be >= 0 (0 = none)");

  Args a{hq, hkv, hq / hkv, k_cache.size(1), block_table.size(1), window, (float)scale,
         block_table.data_ptr<int32_t>(), cu_seqlens_q.data_ptr<int64_t>(), seq_lens_k.data_ptr<int64_t>()};
  const int64_t num_pages = k_cache.size(0);

  // Validate the index tensors once, so kernels can trust every page they read.
  std::vector<Item> items;
  CHECK_ARG(a.cu[0] == 0 && a.cu[S] == T, "cu_seqlens_q must run from 0 to T=", T);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t ql = a.cu[s + 1] - a.cu[s], kl = a.lens[s];
    CHECK_ARG(ql >= 0, "cu_seqlens_q must be non-decreasing (sequence ", s, ")");
    if (ql == 0) continue;
    CHECK_ARG(kl >= ql, "sequence ", s, " has ", ql, " query rows but seq_lens_k=", kl);
    const int64_t first = window > 0 ? std::max<int64_t>(0, kl - ql - window + 1) : 0;
    CHECK_ARG((kl - 1) / a.page_size < a.max_pages, "sequence ", s, " needs more pages than block_table has");
    for (int64_t pg = first / a.page_size; pg <= (kl - 1) / a.page_size; ++pg) {
      const int32_t id = a.table[s * a.max_pages + pg];
      CHECK_ARG(id >= 0 && id < num_pages, "block_table[", s, ", ", pg, "] = ", id, " is not a page of the pool (",
                num_pages, " pages)");
    }
    for (int64_t r0 = 0; r0 < ql; r0 += ROWS)
      for (int64_t kvh = 0; kvh < hkv; ++kvh) items.push_back({s, r0, std::min<int64_t>(ROWS, ql - r0), kvh});
  }
  // parallel_for hands each thread one contiguous run of items, and causal rows cost more the
  // later they sit: interleave the list from both ends (first, last, second, second last, ...)
  // so every run mixes light and heavy items (a 512-token prompt on 2 threads split 1.25 : 1.75
  // before).  Each item computes the same bits wherever it runs.
  std::vector<Item> order;
  order.reserve(items.size());
  for (size_t i = 0, j = items.size(); i < j; ++i) {
    order.push_back(items[i]);
    if (i < --j) order.push_back(items[j]);
  }
  items.swap(order);

  at::Tensor out = at::empty_like(q);
  auto dispatch = [&](auto qtag, auto ktag) {
    using QT = decltype(qtag);
    using KT = decltype(ktag);
    const QT* qp = reinterpret_cast<const QT*>(q.data_ptr());
    const KT* kp = reinterpret_cast<const KT*>(k_cache.data_ptr());
    const KT* vp = reinterpret_cast<const KT*>(v_cache.data_ptr());
    QT* op = reinterpret_cast<QT*>(out.data_ptr());
    if (D == 64)
      run_items<64>(items, a, qp, kp, vp, op);
    else
      run_items<128>(items, a, qp, kp, vp, op);
  };
  const bool qbf = q.scalar_type() == at::kBFloat16, kbf = k_cache.scalar_type() == at::kBFloat16;
  if (qbf && kbf) dispatch(c10::BFloat16(), c10::BFloat16());
  else if (qbf) dispatch(c10::BFloat16(), float());
  else if (kbf) dispatch(float(), c10::BFloat16());
  else dispatch(float(), float());
  return out;
}

// Caps the vector ISA of every kernel in csrc/cpu (0 scalar, 1 AVX2, 2 AVX-512) so tests can run
// each path on one machine; a negative level only queries. Returns the previous cap.
int64_t cpu_isa_limit(int64_t level) {
  const int64_t prev = g_isa_limit.load();
  if (level >= 0) g_isa_limit.store((int)std::min<int64_t>(level, ISA_AVX512));
  return prev;
}

int64_t cpu_isa_op() { return exl_cpu::cpu_isa(); }

}  // namespace

namespace exl_cpu::ops {  // plain C++ entry point (kernels.h)
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                           const at::Tensor& seq_lens_k, double scale, int64_t window) {
  return paged_attention_cpu(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, window);
}
}  // namespace exl_cpu::ops

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("cpu_isa_limit(int level) -> int", &cpu_isa_limit);
  m.def("cpu_isa() -> int", &cpu_isa_op);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor cu_seqlens_q, "
        "Tensor seq_lens_k, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl_core, CPU, m) { m.impl("paged_attention", &paged_attention_cpu); }
