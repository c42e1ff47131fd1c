// Generic body of the CPU matmul kernels, compiled once per ISA.
//
// Not a normal header: an ISA translation unit (qmatmul_avx512.cpp, qmatmul_avx2.cpp,
// qmatmul_scalar.cpp) includes <cstdint>, sets its `#pragma GCC target`, opens its own namespace
// (exl_cpu::isa_xxx, so instantiations never merge across ISAs), defines the vector trait `V`
// and then includes this file.  `V` provides (f = float vector, i = int32 vector, W lanes):
//   zero, bcast, load, loadn(p, n valid lanes; rest 0), store, storen, fma(a,b,c)=a*b+c, add,
//   mul, sub, iloadn, srl<S>, sll<S>, and_, or_, iset, cvt (int -> float), load_bf16n, MRMAX.
//
// Structure (one thread owns a range of 32-column panels):
//   for each tile of NBP panels:              (NBP = 4 for small M, 2 otherwise)
//     for each K block of KC rows:           (KC = 64 / 128)
//       fill an fp32 tile [NBP][KC][32]     (dequantised once, reused by every row of x)
//       for rows in blocks of MR: microkernel: MR x (NP*32) accumulators in registers.
//
// Summation order per output (the same in every path, so results are batch-invariant):
// K is cut into chunks of KSUM = 32 rows; each chunk's partial p_c is one fma chain started
// from zero, and y = p_0; y = y + p_1; ...; y = y + bias.  Short chains keep the fp32 error
// near blocked BLAS sums (one chain over all of K was ~2x further from float64).
// Quantized weights: a chunk lies in one group, so with w = (q - z)*s its partial is
//   p_c = s * sum_k x_k q_k - (z*s) * sum_k x_k  =  fma(sum_xq, s, (-(z*s)) * xsum[c])
// where sum_xq chains over raw q (no per-weight dequantisation: one FMA per weight instead of
// two) and xsum (per row and chunk, summed in order once per call) comes from the caller.

#define EXL_ALWAYS_INLINE inline __attribute__((always_inline))

constexpr int VP = kPanel / V::W;  // vectors per panel
constexpr int KSUM = 32;           // summation chunk along K (see above); divides KC and 32-row quant chunks
constexpr int KC_SMALL = 64, KC_LARGE = 128;
constexpr int NBP_SMALL = 4, NBP_LARGE = 2;
constexpr int TILE_FLOATS = 128 * 2 * kPanel;  // max(KC*NBP) * 32 = 8192 floats (32 KiB)
static_assert(KC_SMALL * NBP_SMALL <= 256 && KC_LARGE * NBP_LARGE <= 256, "tile size");
static_assert(KC_SMALL % KSUM == 0 && KC_LARGE % KSUM == 0, "K blocks must hold whole summation chunks");

static inline int lanes_valid(int64_t n_left) {
  return n_left <= 0 ? 0 : (n_left >= V::W ? V::W : static_cast<int>(n_left));
}

// ---------------------------------------------------------------- unpacking ------------------
// Value I of a 32-value chunk of bit width B: stream bits [I*B, I*B+B) of words w[0..B-1].
template <int B, int I>
static EXL_ALWAYS_INLINE void unpack_one(const typename V::i* w, float* dst) {
  constexpr int pos = I * B, wi = pos / 32, off = pos % 32;
  typename V::i v = V::template srl<off>(w[wi]);
  if constexpr (off + B > 32) v = V::or_(v, V::template sll<32 - off>(w[wi + 1]));
  if constexpr (off + B != 32) v = V::and_(v, V::iset((1 << B) - 1));
  V::store(dst + I * kPanel, V::cvt(v));
}

template <int B, int... I>
static EXL_ALWAYS_INLINE void unpack_all(const typename V::i* w, float* dst, std::integer_sequence<int, I...>) {
  (unpack_one<B, I>(w, dst), ...);
}

// 32 rows x W columns of raw q as floats: q points at qweight[qrow, col] (row stride N); dst at
// tile[k][lane0], row stride kPanel.  Lanes past N read as q = 0 and are never stored.
template <int B>
static inline void unpack_chunk(const int32_t* q, int64_t N, int nv, float* dst) {
  typename V::i w[B];
  for (int j = 0; j < B; ++j) w[j] = V::iloadn(q + j * N, nv);
  unpack_all<B>(w, dst, std::make_integer_sequence<int, 32>{});
}

static inline void unpack_chunk_bits(int bits, const int32_t* q, int64_t N, int nv, float* dst) {
  switch (bits) {
    case 2: unpack_chunk<2>(q, N, nv, dst); break;
    case 3: unpack_chunk<3>(q, N, nv, dst); break;
    case 4: unpack_chunk<4>(q, N, nv, dst); break;
    case 5: unpack_chunk<5>(q, N, nv, dst); break;
    case 6: unpack_chunk<6>(q, N, nv, dst); break;
    default: unpack_chunk<8>(q, N, nv, dst); break;  // bits validated by the op
  }
}

// The chunk's partial from sum_xq (see the top): fma(sum_xq, s, (-(z*s)) * xsum).  Every path
// closes a quantized chunk through this one function, so the arithmetic cannot drift apart.
static EXL_ALWAYS_INLINE typename V::f quant_partial(typename V::f sum_xq, typename V::f s, typename V::f z,
                                                     float xsum) {
  const typename V::f nzs = V::mul(V::sub(V::zero(), z), s);
  return V::fma(sum_xq, s, V::mul(nzs, V::bcast(xsum)));
}

// Tile [np][kc][32] of raw q (as floats) for rows k0..k0+kc (kc a multiple of 32) and panels
// starting at column n0; scales are applied per chunk by the microkernel (quant_partial).
static void fill_tile_quant(const QGemmArgs& a, int64_t k0, int kc, int64_t n0, int np, float* tile) {
  for (int64_t c = k0 / 32; c < (k0 + kc) / 32; ++c) {
    const ChunkInfo ch = a.chunks[c];
    const int32_t* qrow = a.qweight + ch.qrow * a.N;
    float* dst_c = tile + (c * 32 - k0) * kPanel;
    for (int p = 0; p < np; ++p) {
      for (int v = 0; v < VP; ++v) {
        const int64_t col = n0 + p * kPanel + v * V::W;
        unpack_chunk_bits(ch.bits, qrow + col, a.N, lanes_valid(a.N - col),
                          dst_c + static_cast<int64_t>(p) * kc * kPanel + v * V::W);
      }
    }
  }
}

#ifndef EXL_SIMD_QUANT_TILE_ONLY  // qmatmul_bf16_avx512.cpp takes only the unpacking above

// Dense tile: copy/convert w[k0:k0+kc, cols] into the same [np][kc][32] layout (zero padded).
static void fill_tile_dense(const DenseGemmArgs& a, int64_t k0, int kc, int64_t n0, int np, float* tile) {
  for (int p = 0; p < np; ++p) {
    for (int v = 0; v < VP; ++v) {
      const int64_t col = n0 + p * kPanel + v * V::W;
      const int nv = lanes_valid(a.N - col);
      float* dst = tile + static_cast<int64_t>(p) * kc * kPanel + v * V::W;
      if (a.w_bf16) {
        const uint16_t* src = static_cast<const uint16_t*>(a.w) + k0 * a.N + col;
        for (int k = 0; k < kc; ++k) V::store(dst + k * kPanel, V::load_bf16n(src + k * a.N, nv));
      } else {
        const float* src = static_cast<const float*>(a.w) + k0 * a.N + col;
        for (int k = 0; k < kc; ++k) V::store(dst + k * kPanel, V::loadn(src + k * a.N, nv));
      }
    }
  }
}

// ---------------------------------------------------------------- microkernel ----------------
// Where a quantized tile's chunks get their scales: chunk table, scale/zero rows and xsum,
// positioned at this call's first row (m0), absolute column (n0) and K block (k0).
struct QuantCtx {
  const QGemmArgs* a;  // nullptr: dense tile (already real weights)
  int64_t m0, n0, k0;
};

// y[MR rows, NP*32 cols] (+)= x[MR, kc] @ tile[NP][kc][32], one KSUM chunk at a time: the
// chunk's partial starts from zero in registers and is then folded into y (y = partial when
// `first` and this is the K block's first chunk, else y + partial).  `bias`: added after the
// last chunk.  ncols: valid output columns (the rest is padding).  y round-trips through L1
// once per 32 k, which keeps MR x NV registers for accumulators (no second set, no spills).
template <int MR, int NP>
static EXL_ALWAYS_INLINE void microkernel(const float* x, int64_t ldx, const float* b, int64_t panel_stride,
                               int kc, float* y, int64_t ldy, int64_t ncols, bool first,
                               const float* bias, const QuantCtx& qc) {
  constexpr int NV = NP * VP;
  for (int k0 = 0; k0 < kc; k0 += KSUM) {
    const int k1 = k0 + KSUM < kc ? k0 + KSUM : kc;
    typename V::f acc[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = V::zero();
    for (int k = k0; k < k1; ++k) {
      typename V::f bv[NV];
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < VP; ++v) bv[p * VP + v] = V::load(b + p * panel_stride + k * kPanel + v * V::W);
      for (int r = 0; r < MR; ++r) {
        const typename V::f xb = V::bcast(x[r * ldx + k]);
        for (int j = 0; j < NV; ++j) acc[r][j] = V::fma(xb, bv[j], acc[r][j]);
      }
    }
    const bool init = first && k0 == 0;
    const float* bias_here = k1 == kc ? bias : nullptr;
    if (qc.a) {  // raw-q tile: scale this chunk's sums (KSUM == 32 == one quant chunk)
      const QGemmArgs& a = *qc.a;
      const int64_t c = (qc.k0 + k0) / 32, nch = a.K / 32;
      const ChunkInfo ch = a.chunks[c];
      const float* srow = a.scale + static_cast<int64_t>(ch.group) * a.N + qc.n0;
      const float* zrow = a.zero + static_cast<int64_t>(ch.group) * a.N + qc.n0;
      for (int j = 0; j < NV; ++j) {
        const int nv = lanes_valid(ncols - j * V::W);
        if (nv == 0) continue;
        const typename V::f s = V::loadn(srow + j * V::W, nv), z = V::loadn(zrow + j * V::W, nv);
        for (int r = 0; r < MR; ++r) acc[r][j] = quant_partial(acc[r][j], s, z, a.xsum[(qc.m0 + r) * nch + c]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NV; ++j) {
        const int nv = lanes_valid(ncols - j * V::W);
        if (nv == 0) continue;
        float* yp = y + r * ldy + j * V::W;
        typename V::f o = init ? acc[r][j] : V::add(V::loadn(yp, nv), acc[r][j]);
        if (bias_here) o = V::add(o, V::loadn(bias_here + j * V::W, nv));
        V::storen(yp, o, nv);
      }
    }
  }
}

// MR rows over np panels: small MR groups several panels per call to keep enough independent
// accumulators in flight; larger MR walks panels one by one.
template <int MR, int NP>
static EXL_ALWAYS_INLINE void panel_call(const float* x, int64_t ldx, const float* tile, int64_t ps, int kc, int p,
                                         float* y, int64_t ldy, int64_t ncols, bool first, const float* bias,
                                         const QuantCtx& qc) {
  const QuantCtx qp{qc.a, qc.m0, qc.n0 + p * kPanel, qc.k0};
  microkernel<MR, NP>(x, ldx, tile + p * ps, ps, kc, y + p * kPanel, ldy, ncols - p * kPanel, first,
                      bias ? bias + p * kPanel : nullptr, qp);
}

template <int MR>
static inline void row_block(const float* x, int64_t ldx, const float* tile, int kc, int np,
                             float* y, int64_t ldy, int64_t ncols, bool first, const float* bias,
                             const QuantCtx& qc) {
  const int64_t ps = static_cast<int64_t>(kc) * kPanel;
  int p = 0;
  if constexpr (MR <= 2) {
    for (; p + 4 <= np; p += 4) panel_call<MR, 4>(x, ldx, tile, ps, kc, p, y, ldy, ncols, first, bias, qc);
    for (; p + 2 <= np; p += 2) panel_call<MR, 2>(x, ldx, tile, ps, kc, p, y, ldy, ncols, first, bias, qc);
  }
  for (; p < np; ++p) panel_call<MR, 1>(x, ldx, tile, ps, kc, p, y, ldy, ncols, first, bias, qc);
}

template <int... R>
static inline void row_tail(int mr, const float* x, int64_t ldx, const float* tile, int kc, int np,
                            float* y, int64_t ldy, int64_t ncols, bool first, const float* bias,
                            const QuantCtx& qc, std::integer_sequence<int, R...>) {
  ((mr == R + 1 ? row_block<R + 1>(x, ldx, tile, kc, np, y, ldy, ncols, first, bias, qc) : void()), ...);
}

// All M rows against one tile (columns n0 .. n0+ncols, K block k0).  q: the quantized
// weight's args when the tile holds raw q, else nullptr.
static void tile_rows(const float* x, int64_t ldx, int64_t M, int64_t k0, const float* tile, int kc,
                      int np, float* y, int64_t ldy, int64_t n0, int64_t ncols, bool first,
                      const float* bias, const QGemmArgs* q) {
  const float* bias_n = bias ? bias + n0 : nullptr;
  int64_t m = 0;
  for (; m + V::MRMAX <= M; m += V::MRMAX)
    row_block<V::MRMAX>(x + m * ldx + k0, ldx, tile, kc, np, y + m * ldy + n0, ldy, ncols, first, bias_n,
                        QuantCtx{q, m, n0, k0});
  if (m < M)
    row_tail(static_cast<int>(M - m), x + m * ldx + k0, ldx, tile, kc, np, y + m * ldy + n0, ldy, ncols,
             first, bias_n, QuantCtx{q, m, n0, k0}, std::make_integer_sequence<int, V::MRMAX - 1>{});
}

// ---------------------------------------------------------------- small M: fused path --------
// For M <= FUSED_MAX_M the tile's store + reload costs more than the FMAs it feeds, so weights
// are unpacked in registers and used at once.  Per (row, column) the arithmetic is exactly
// the tile path's (same fma chain over raw q, same quant_partial, same chunks folded into y in
// order), so results stay bit-identical to large M.
constexpr int FUSED_MAX_M = 4;
constexpr int FUSED_NV = 4;  // column vectors per block: 4 independent FMA chains per row
// Accumulators a block may hold in registers: 8 of AVX2's 16 ymm, 16 of AVX-512's 32 zmm (the rest hold the unpacked
// weights, x's broadcasts and the masks).  Past that the compiler spilled them: on AVX2 a 576 x 576 4-bit call took
// 17.49 / 23.31 / 44.58 / 54.11 us at 1 / 2 / 3 / 4 rows (bench/cpu_fused_rows.sh, one thread, stop 64).  So rows
// beyond it take fewer column vectors (the dense direct path's bf16 instance aside: see dense_small).
constexpr int FUSED_ACC = sizeof(typename V::f) >= 64 ? 16 : 8;
template <int MR>
constexpr int fused_nv() {
  return MR * FUSED_NV <= FUSED_ACC ? FUSED_NV : (FUSED_ACC / MR >= 2 ? 2 : 1);
}

// Value I of the chunk for column vector j: words at q + (I*B/32)*N (loads fold into the shift).
template <int B, int MR, int NV, int I>
static EXL_ALWAYS_INLINE void fused_value(const int32_t* q, int64_t N, const float* x, int64_t ldx,
                                          typename V::f (&acc)[MR][NV]) {
  constexpr int pos = I * B, wi = pos / 32, off = pos % 32;
  for (int j = 0; j < NV; ++j) {
    typename V::i v = V::template srl<off>(V::iloadn(q + wi * N + j * V::W, V::W));
    if constexpr (off + B > 32) v = V::or_(v, V::template sll<32 - off>(V::iloadn(q + (wi + 1) * N + j * V::W, V::W)));
    if constexpr (off + B != 32) v = V::and_(v, V::iset((1 << B) - 1));
    const typename V::f w = V::cvt(v);
    for (int r = 0; r < MR; ++r) acc[r][j] = V::fma(V::bcast(x[r * ldx + I]), w, acc[r][j]);
  }
}

template <int B, int MR, int NV, int... I>
static EXL_ALWAYS_INLINE void fused_chunk(const int32_t* q, int64_t N, const float* x, int64_t ldx,
                                          typename V::f (&acc)[MR][NV], std::integer_sequence<int, I...>) {
  (fused_value<B, MR, NV, I>(q, N, x, ldx, acc), ...);
}

// y[0:MR, n0 : n0 + NV*W] (full vectors only) for K chunk c (32 rows = one KSUM chunk): the
// partial starts at 0 and is folded into y (y = partial when c == 0, else y + partial); the
// bias is added after the last chunk.
template <int MR, int NV>
static void fused_block(const QGemmArgs& a, int64_t n0, int64_t c) {
  static_assert(KSUM == 32, "one quant chunk per summation chunk");
  typename V::f acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = V::zero();
  const ChunkInfo ch = a.chunks[c];
  const int32_t* q = a.qweight + ch.qrow * a.N + n0;
  const float* xk = a.x + c * 32;
  const auto seq = std::make_integer_sequence<int, 32>{};
  switch (ch.bits) {
    case 2: fused_chunk<2, MR, NV>(q, a.N, xk, a.ldx, acc, seq); break;
    case 3: fused_chunk<3, MR, NV>(q, a.N, xk, a.ldx, acc, seq); break;
    case 4: fused_chunk<4, MR, NV>(q, a.N, xk, a.ldx, acc, seq); break;
    case 5: fused_chunk<5, MR, NV>(q, a.N, xk, a.ldx, acc, seq); break;
    case 6: fused_chunk<6, MR, NV>(q, a.N, xk, a.ldx, acc, seq); break;
    default: fused_chunk<8, MR, NV>(q, a.N, xk, a.ldx, acc, seq); break;
  }
  const float* srow = a.scale + static_cast<int64_t>(ch.group) * a.N + n0;
  const float* zrow = a.zero + static_cast<int64_t>(ch.group) * a.N + n0;
  const int64_t nch = a.K / 32;
  for (int j = 0; j < NV; ++j) {
    const typename V::f s = V::load(srow + j * V::W), z = V::load(zrow + j * V::W);
    for (int r = 0; r < MR; ++r) acc[r][j] = quant_partial(acc[r][j], s, z, a.xsum[r * nch + c]);
  }
  const float* bias = (c + 1) * 32 == a.K ? a.bias : nullptr;
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) {
      float* yp = a.y + r * a.ldy + n0 + j * V::W;
      typename V::f o = c == 0 ? acc[r][j] : V::add(V::load(yp), acc[r][j]);
      if (bias) o = V::add(o, V::load(bias + n0 + j * V::W));
      V::store(yp, o);
    }
}

// K-chunk outer, columns inner: each visit reads one chunk (a few whole qweight rows across
// this thread's columns), so weights stream sequentially instead of striding by N.
template <int MR>
static void fused_cols(const QGemmArgs& a, int64_t n_begin, int64_t n_end) {  // n_end - n_begin: multiple of W
  const int64_t nchunks = a.K / 32;
  for (int64_t c = 0; c < nchunks; ++c) {
    int64_t n = n_begin;
    constexpr int NV = fused_nv<MR>();
    for (; n + NV * V::W <= n_end; n += NV * V::W) fused_block<MR, NV>(a, n, c);
    for (; n + 2 * V::W <= n_end; n += 2 * V::W) fused_block<MR, 2>(a, n, c);
    for (; n < n_end; n += V::W) fused_block<MR, 1>(a, n, c);
  }
}

// ---------------------------------------------------------------- small M: dense direct path -
// For M <= FUSED_MAX_M, packing w_t into tiles costs more than the FMAs: read w_t rows in place.
// k-block outer (DENSE_KB rows = one KSUM chunk, a few sequential streams), columns inner;
// same chunk partials folded into y in the same order as the tile path.
constexpr int DENSE_KB = KSUM;

template <int MR, int NV, bool BF16>
static void dense_block(const DenseGemmArgs& a, int64_t n0, int64_t ncols, int64_t k0, int64_t k1) {
  typename V::f acc[MR][NV];
  int nv[NV];
  for (int j = 0; j < NV; ++j) nv[j] = lanes_valid(ncols - j * V::W);
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = V::zero();
  for (int64_t k = k0; k < k1; ++k) {
    typename V::f w[NV];
    for (int j = 0; j < NV; ++j) {
      if constexpr (BF16) w[j] = V::load_bf16n(static_cast<const uint16_t*>(a.w) + k * a.N + n0 + j * V::W, nv[j]);
      else w[j] = V::loadn(static_cast<const float*>(a.w) + k * a.N + n0 + j * V::W, nv[j]);
    }
    for (int r = 0; r < MR; ++r) {
      const typename V::f xb = V::bcast(a.x[r * a.ldx + k]);
      for (int j = 0; j < NV; ++j) acc[r][j] = V::fma(xb, w[j], acc[r][j]);
    }
  }
  const float* bias = k1 == a.K ? a.bias : nullptr;
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) {
      if (nv[j] == 0) continue;
      float* yp = a.y + r * a.ldy + n0 + j * V::W;
      typename V::f o = k0 == 0 ? acc[r][j] : V::add(V::loadn(yp, nv[j]), acc[r][j]);
      if (bias) o = V::add(o, V::loadn(bias + n0 + j * V::W, nv[j]));
      V::storen(yp, o, nv[j]);
    }
}

template <int MR, bool BF16>
static void dense_small(const DenseGemmArgs& a, int64_t c0, int64_t c1) {
  // bf16 weights keep FUSED_NV: there the widening loads, not spills, set the pace, and 2 vectors a block were
  // ~1.2x slower at 3-4 rows on AVX2 (stop 64's review, one thread); fp32 weights take fused_nv (~1.3x faster).
  constexpr int NV = BF16 ? FUSED_NV : fused_nv<MR>(), NB = NV * V::W;
  for (int64_t k0 = 0; k0 < a.K; k0 += DENSE_KB) {
    const int64_t k1 = k0 + DENSE_KB < a.K ? k0 + DENSE_KB : a.K;
    for (int64_t n = c0; n < c1; n += NB) dense_block<MR, NV, BF16>(a, n, c1 - n, k0, k1);
  }
}

template <int MR>
static void dense_small_any(const DenseGemmArgs& a, int64_t c0, int64_t c1) {
  if (a.w_bf16) dense_small<MR, true>(a, c0, c1);
  else dense_small<MR, false>(a, c0, c1);
}

// ---------------------------------------------------------------- drivers --------------------
// Columns [c0, c1) through the tile path.
template <typename Args, typename Fill>
static void gemm_cols(const Args& a, int64_t c0, int64_t c1, Fill fill, const QGemmArgs* q) {
  alignas(64) float tile[TILE_FLOATS];
  const bool small = a.M <= 4;
  const int nbp = small ? NBP_SMALL : NBP_LARGE;
  const int KC = small ? KC_SMALL : KC_LARGE;
  for (int64_t n0 = c0; n0 < c1; n0 += nbp * kPanel) {
    const int64_t ncols = (n0 + nbp * kPanel <= c1) ? nbp * kPanel : c1 - n0;
    const int np = static_cast<int>((ncols + kPanel - 1) / kPanel);
    if (a.K == 0) {
      write_empty_reduction(a, n0, ncols);
      continue;
    }
    for (int64_t k0 = 0; k0 < a.K; k0 += KC) {
      const int kc = static_cast<int>(k0 + KC <= a.K ? KC : a.K - k0);
      fill(a, k0, kc, n0, np, tile);
      const bool last = k0 + kc >= a.K;
      tile_rows(a.x, a.ldx, a.M, k0, tile, kc, np, a.y, a.ldy, n0, ncols, k0 == 0, last ? a.bias : nullptr, q);
    }
  }
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

void qgemm(const QGemmArgs& a, int64_t p0, int64_t p1) {
  const int64_t c0 = p0 * kPanel, c1 = min64(p1 * kPanel, a.N);
  if (a.M > FUSED_MAX_M || a.K == 0) {
    gemm_cols(a, c0, c1, fill_tile_quant, &a);
    return;
  }
  const int64_t cf = c0 + (c1 - c0) / V::W * V::W;  // full vectors fused, a ragged tail tiled
  switch (a.M) {
    case 1: fused_cols<1>(a, c0, cf); break;
    case 2: fused_cols<2>(a, c0, cf); break;
    case 3: fused_cols<3>(a, c0, cf); break;
    default: fused_cols<4>(a, c0, cf); break;
  }
  if (cf < c1) gemm_cols(a, cf, c1, fill_tile_quant, &a);
}

void dense_gemm(const DenseGemmArgs& a, int64_t p0, int64_t p1) {
  const int64_t c0 = p0 * kPanel, c1 = min64(p1 * kPanel, a.N);
  if (a.M > FUSED_MAX_M || a.K == 0) {
    gemm_cols(a, c0, c1, fill_tile_dense, nullptr);
    return;
  }
  switch (a.M) {
    case 1: dense_small_any<1>(a, c0, c1); break;
    case 2: dense_small_any<2>(a, c0, c1); break;
    case 3: dense_small_any<3>(a, c0, c1); break;
    default: dense_small_any<4>(a, c0, c1); break;
  }
}

#endif  // EXL_SIMD_QUANT_TILE_ONLY

#undef EXL_ALWAYS_INLINE
