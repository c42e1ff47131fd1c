// Generic body of the int8-activation matmul (qmatmul_int8.h), compiled once per ISA.
//
// Not a normal header: an ISA translation unit (qmatmul_int8_avx512.cpp, _avx2.cpp, _scalar.cpp)
// sets its target, opens its own namespace and defines the trait `I8` (named apart from the
// fp32 kernels' `V`: the same namespace holds both), then includes this file.  `I8` provides
// (i = int32 vector, f = float vector, W lanes, one output column per lane):
//   iload, iloadn(p, n valid lanes; rest 0), srl<S>, sll<S>, and_, or_, iset, izero,
//   bcast_i(int32), dot<BIG>(acc, w, x): acc + sum over the 4 bytes of u8(w) * s8(x) per lane
//   (BIG: w bytes may exceed 63, i.e. 8-bit weights), and for floats zero, bcast, load, loadn,
//   store, storen, mul, add, fma(a,b,c) = a*b+c, fnmadd(a,b,c) = c-a*b, cvt (int -> float).
//   MRMAX: rows per register block, NVMAX: column vectors per block.
//
// Loop order (one thread owns a range of 32-column panels): rows in blocks of MR, then
//   row-major words [Q, N]: runs of K chunks of one group outer, column vectors inner, so each run
//     reads its qweight rows across the thread's columns as sequential streams; y lives in the
//     output between runs;
//   panel-major words [N/32, Q, 32] (QGemmArgs::panel_major): column blocks outer, all of K inner,
//     so a thread reads its panels as one contiguous stream (and, for one row, y stays in registers).
// Each output element sees the same operations in the same order either way (bit-identical).

#define EXL_ALWAYS_INLINE inline __attribute__((always_inline))

static inline int lanes_valid(int64_t n_left) {
  return n_left <= 0 ? 0 : (n_left >= I8::W ? I8::W : static_cast<int>(n_left));
}

template <bool FULL>
static EXL_ALWAYS_INLINE typename I8::i load_word(const int32_t* p, int nv) {
  if constexpr (FULL) return I8::iload(p);
  else return I8::iloadn(p, nv);
}

// Group G (0..7) of the chunk: 4 u8 weights per lane in the byte order int8_order(B) gives x.
// q: the vector's word in the chunk's first row; rows are N words apart.
template <int B, int G, bool FULL>
static EXL_ALWAYS_INLINE typename I8::i group_bytes(const int32_t* q, int64_t N, int nv) {
  if constexpr (B == 8) {
    return load_word<FULL>(q + G * N, nv);
  } else if constexpr (B == 4) {  // low nibbles for even G, high for odd G
    const typename I8::i w = load_word<FULL>(q + (G / 2) * N, nv);
    return I8::and_(I8::template srl<(G % 2) * 4>(w), I8::iset(0x0F0F0F0F));
  } else if constexpr (B == 2) {  // G = 4j + t: word j shifted by 2t
    const typename I8::i w = load_word<FULL>(q + (G / 4) * N, nv);
    return I8::and_(I8::template srl<(G % 4) * 2>(w), I8::iset(0x03030303));
  } else {  // 3/5/6-bit: the 4B-bit field of values 4G..4G+3, value k moved to byte k
    constexpr int pos = 4 * G * B, wi = pos / 32, off = pos % 32, m = (1 << B) - 1;
    typename I8::i f = I8::template srl<off>(load_word<FULL>(q + wi * N, nv));
    if constexpr (off + 4 * B > 32) f = I8::or_(f, I8::template sll<32 - off>(load_word<FULL>(q + (wi + 1) * N, nv)));
    typename I8::i v = I8::and_(f, I8::iset(m));  // bits above 4B in f are masked off below
    v = I8::or_(v, I8::and_(I8::template sll<8 - B>(f), I8::iset(m << 8)));
    v = I8::or_(v, I8::and_(I8::template sll<16 - 2 * B>(f), I8::iset(m << 16)));
    return I8::or_(v, I8::and_(I8::template sll<24 - 3 * B>(f), I8::iset(m << 24)));
  }
}

template <int B, int MR, int NV, bool FULL, int G>
static EXL_ALWAYS_INLINE void dot_group(const int32_t* const* q, int64_t N, const int* nv, const int32_t* const* xr,
                                        typename I8::i (&acc)[MR][NV]) {
  typename I8::i xb[MR];
  for (int r = 0; r < MR; ++r) xb[r] = I8::bcast_i(xr[r][G]);
  for (int j = 0; j < NV; ++j) {
    const typename I8::i w = group_bytes<B, G, FULL>(q[j], N, nv[j]);
    for (int r = 0; r < MR; ++r) acc[r][j] = I8::template dot<(B > 6)>(acc[r][j], w, xb[r]);
  }
}

template <int B, int MR, int NV, bool FULL, int... G>
static EXL_ALWAYS_INLINE void dot_chunk(const int32_t* const* q, int64_t N, const int* nv, const int32_t* const* xr,
                                        typename I8::i (&acc)[MR][NV], std::integer_sequence<int, G...>) {
  (dot_group<B, MR, NV, FULL, G>(q, N, nv, xr, acc), ...);
}

// Rows m0..m0+MR, columns n0..n0+ncols (NV vectors; FULL: all lanes valid), chunks [c0, c1)
// of one bit width: per chunk, integer dot products, then t = fma(-(z*s), qsum, d*s) with its
// group's scale/zero and y = fma(t, sx, y or 0) (+ bias after the last chunk of K). The same
// operations in every ISA (see qmatmul_int8.h); y stays in registers across the run, so a run
// of R chunks loads and stores y once instead of R times (same values, same order).
template <int B, int MR, int NV, bool FULL>
static EXL_ALWAYS_INLINE void run_block(const QGemmInt8Args& a, int64_t m0, int64_t n0, int64_t ncols, int64_t c0,
                                        int64_t c1) {
  const int64_t nch = a.x.K / 32, N = a.w->N;
  int nv[NV];
  for (int j = 0; j < NV; ++j) nv[j] = FULL ? I8::W : lanes_valid(ncols - j * I8::W);
  // Where column vector j's words (row 0) and scale/zero (group 0) start; rows of both are `ld` apart.
  const bool pm = a.w->panel_major;
  const int64_t ld = pm ? kPanel : N;
  const int32_t* qv[NV];
  int64_t sv[NV];
  for (int j = 0; j < NV; ++j) {
    const int64_t col = n0 + j * I8::W, panel = col / kPanel;
    qv[j] = a.w->qweight + (pm ? panel * a.w->q_rows * kPanel + col % kPanel : col);
    sv[j] = pm ? panel * a.w->n_groups * kPanel + col % kPanel : col;
  }
  typename I8::f s[NV], zs[NV], y[MR][NV];
  for (int j = 0; j < NV; ++j)
    for (int r = 0; r < MR; ++r) {
      const float* yp = a.w->y + (m0 + r) * a.w->ldy + n0 + j * I8::W;
      y[r][j] = c0 == 0 ? I8::zero() : (FULL ? I8::load(yp) : I8::loadn(yp, nv[j]));
    }
  const int order = int8_order(B);
  int group = -1;
  for (int64_t c = c0; c < c1; ++c) {
    const ChunkInfo ch = a.w->chunks[c];
    if (ch.group != group) {  // a group's scale/zero row is loaded once per run
      group = ch.group;
      for (int j = 0; j < NV; ++j) {
        const int64_t o = sv[j] + static_cast<int64_t>(group) * ld;
        s[j] = FULL ? I8::load(a.w->scale + o) : I8::loadn(a.w->scale + o, nv[j]);
        const typename I8::f z = a.w->zero_per_group ? I8::bcast(a.w->zero[group])
                                 : FULL ? I8::load(a.w->zero + o) : I8::loadn(a.w->zero + o, nv[j]);
        zs[j] = I8::mul(z, s[j]);
      }
    }
    const int32_t* xr[MR];
    for (int r = 0; r < MR; ++r) xr[r] = a.x.xq + ((order * a.x.M + m0 + r) * nch + c) * 8;
    typename I8::i acc[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = I8::izero();
    const int32_t* qc[NV];
    for (int j = 0; j < NV; ++j) qc[j] = qv[j] + ch.qrow * ld;
    dot_chunk<B, MR, NV, FULL>(qc, ld, nv, xr, acc, std::make_integer_sequence<int, 8>{});
    for (int r = 0; r < MR; ++r) {
      const int64_t rc = (m0 + r) * nch + c;
      const typename I8::f qs = I8::bcast(static_cast<float>(a.x.qsum[rc])), sx = I8::bcast(a.x.sx[rc]);
      for (int j = 0; j < NV; ++j)
        y[r][j] = I8::fma(I8::fnmadd(zs[j], qs, I8::mul(I8::cvt(acc[r][j]), s[j])), sx, y[r][j]);
    }
  }
  const float* bias = (c1 == nch && a.w->bias) ? a.w->bias + n0 : nullptr;
  for (int j = 0; j < NV; ++j) {
    if (!FULL && nv[j] == 0) continue;
    for (int r = 0; r < MR; ++r) {
      typename I8::f o = y[r][j];
      if (bias) o = I8::add(o, FULL ? I8::load(bias + j * I8::W) : I8::loadn(bias + j * I8::W, nv[j]));
      float* yp = a.w->y + (m0 + r) * a.w->ldy + n0 + j * I8::W;
      if (FULL) I8::store(yp, o);
      else I8::storen(yp, o, nv[j]);
    }
  }
}

// One run of chunks across columns [n_begin, n_end): NVMAX-vector blocks, then single
// vectors, then a masked tail vector.
template <int B, int MR>
static void run_cols(const QGemmInt8Args& a, int64_t m0, int64_t n_begin, int64_t n_end, int64_t c0, int64_t c1) {
  int64_t n = n_begin;
  for (; n + I8::NVMAX * I8::W <= n_end; n += I8::NVMAX * I8::W)
    run_block<B, MR, I8::NVMAX, true>(a, m0, n, I8::NVMAX * I8::W, c0, c1);
  for (; n + I8::W <= n_end; n += I8::W) run_block<B, MR, 1, true>(a, m0, n, I8::W, c0, c1);
  if (n < n_end) run_block<B, MR, 1, false>(a, m0, n, n_end - n, c0, c1);
}

// qweight rows per run of chunks: with one row, y of a column block fits in registers beside
// the accumulators, so a run covers several chunks of one bit width (2 at 4 bits). Runs read
// their rows as parallel streams, and past ~8 the prefetchers lose them: SmolLM2 decode,
// GPTQ 4-bit, best of 6 interleaved: 8 rows 160.2 tok/s, 1 chunk per run 150.3, 16 rows
// 149.7, 32 rows 132.4 (EXL2: 133.2 / 127.4 / 119.9 / 110.9; that build also read float16
// copies of scale/zero, which measured no gain, 154.1 vs 153.5 tok/s, and were dropped). With
// more rows y would spill, so each chunk is its own run.
constexpr int kRunRows = 8;

// Runs of chunks over columns [n_begin, n_end): each run as long as its bit width lasts, capped
// at max_rows qweight rows (MR == 1) or one chunk.
template <int MR>
static void runs(const QGemmInt8Args& a, int64_t m0, int64_t n_begin, int64_t n_end, int64_t max_rows) {
  const int64_t nch = a.x.K / 32;
  const ChunkInfo* ch = a.w->chunks;
  for (int64_t c0 = 0, c1; c0 < nch; c0 = c1) {
    const int64_t max_chunks = MR == 1 && max_rows >= 2 * ch[c0].bits ? max_rows / ch[c0].bits : 1;
    for (c1 = c0 + 1; c1 < nch && c1 - c0 < max_chunks && ch[c1].bits == ch[c0].bits; ++c1) {
    }
    switch (ch[c0].bits) {
      case 2: run_cols<2, MR>(a, m0, n_begin, n_end, c0, c1); break;
      case 3: run_cols<3, MR>(a, m0, n_begin, n_end, c0, c1); break;
      case 4: run_cols<4, MR>(a, m0, n_begin, n_end, c0, c1); break;
      case 5: run_cols<5, MR>(a, m0, n_begin, n_end, c0, c1); break;
      case 6: run_cols<6, MR>(a, m0, n_begin, n_end, c0, c1); break;
      default: run_cols<8, MR>(a, m0, n_begin, n_end, c0, c1); break;  // bits validated by the op
    }
  }
}

template <int MR>
static void row_block(const QGemmInt8Args& a, int64_t m0, int64_t n_begin, int64_t n_end) {
  if (!a.w->panel_major) {
    runs<MR>(a, m0, n_begin, n_end, kRunRows);
    return;
  }
  constexpr int64_t step = I8::NVMAX * I8::W;  // one register block of columns through all of K
  constexpr int64_t kUncapped = int64_t(1) << 30;   // a panel's words are one stream: runs need no row cap
  for (int64_t n = n_begin; n < n_end; n += step)
    runs<MR>(a, m0, n, n + step < n_end ? n + step : n_end, kUncapped);
}

template <int... R>
static void row_tail(int mr, const QGemmInt8Args& a, int64_t m0, int64_t n_begin, int64_t n_end,
                     std::integer_sequence<int, R...>) {
  ((mr == R + 1 ? row_block<R + 1>(a, m0, n_begin, n_end) : void()), ...);
}

void qgemm_int8(const QGemmInt8Args& a, int64_t p0, int64_t p1) {
  const int64_t n_begin = p0 * kPanel, n_end = p1 * kPanel < a.w->N ? p1 * kPanel : a.w->N;
  if (a.x.K == 0) {  // no chunks: y = bias (or 0)
    write_empty_reduction(*a.w, n_begin, n_end - n_begin);
    return;
  }
  int64_t m = 0;
  for (; m + I8::MRMAX <= a.x.M; m += I8::MRMAX) row_block<I8::MRMAX>(a, m, n_begin, n_end);
  if (m < a.x.M)
    row_tail(static_cast<int>(a.x.M - m), a, m, n_begin, n_end, std::make_integer_sequence<int, I8::MRMAX - 1>{});
}
