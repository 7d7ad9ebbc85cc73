// Step 2 of the pnca kernel: the Q fragments of one head, norm(x slice) rounded to the element type (one warp, its
// own rows).

// The A fragments of QK^T come straight from the x slice (ldmatrix), and the norm is applied in registers:
// register e of (m-tile mt, k-step kk) holds rows mt*16 + g + 8*(e&1), columns kk*16 + t2 + 8*(e>>1) + {0, 1}.
// The pad columns of d = 40 come out as 0.
// With Q_FROM_QRAW the same registers are q = rstd * (qraw - mean * u) + b' = qraw * rstd + (shift * u + b'), read
// from qraw (float32) instead of x; ga/be then hold u and b'.

// A head's norm parameters come with its pipeline stage (see load_affine_slot) rather than from global memory
// when Q is built: a global load there stalled every head's first k-step.
template <bool WIDE> struct AffineTypes { using Pair = float2; using Elem = float; };
template <> struct AffineTypes<false> { using Pair = u32; using Elem = u16; };  // two 16-bit values in one register
using AffinePair = AffineTypes<AFFINE_WIDE>::Pair;
using AffineElem = AffineTypes<AFFINE_WIDE>::Elem;

FN_INLINE float2 affine_f32(const float2& v) { return v; }
FN_INLINE float2 affine_f32(const u32& v) { return make_float2(lo_to_f32(v), hi_to_f32(v)); }

// What the fragments of one head are made from: the warp's rows' statistics, and where the rows' x (or qraw) and
// the head's norm parameters lie.
struct QSource {
  float rs[M_TILES][2], shift[M_TILES][2];  // h = (x * rs + shift) * gamma + beta
  bool live[M_TILES][2];                     // row < Lq
  const u16* x_tile;                         // the warp's rows of the head's x slice
  const float* q_rows;                       // Q_FROM_QRAW: the warp's first row of qraw
  int affine_slot;                           // the head's slot of norm parameters
  int col0;                                  // the head's first column
};

FN_INLINE QSource q_source(const Params& p, int row0, int col0, const float* mean_s, const float* rstd_s,
                           const u16* x_tile, const float* q_rows, int affine_slot, int lane) {
  QSource src;
  const int g = lane >> 2;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = mt * 16 + g + 8 * i;
      src.live[mt][i] = row0 + r < p.q_len;
      src.rs[mt][i] = rstd_s[r];
      src.shift[mt][i] = -mean_s[r] * src.rs[mt][i];
    }
  src.x_tile = x_tile;
  src.q_rows = q_rows;
  src.affine_slot = affine_slot;
  src.col0 = col0;
  return src;
}

// The fragments of k-step kk, for every m-tile of the warp.
FN_INLINE void q_kstep(const Params& p, const QSource& src, int kk, u32 (&a)[M_TILES][4], int lane) {
  const int g = lane >> 2, t2 = (lane & 3) * 2;
  float2 ga[2], be[2];  // this thread's columns of the k-step, per half (u and b' with Q_FROM_QRAW)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int c = kk * 16 + t2 + h * 8;
    const bool real = HEAD_DIM % 16 == 0 || c < HEAD_DIM;  // pad columns (d = 40): q is zeroed anyway
    const auto* slot = reinterpret_cast<const AffineElem*>(smem + OFF_AFFINE + src.affine_slot * AFFINE_SLOT_BYTES);
    const auto* vec = reinterpret_cast<const AffinePair*>(slot + c);  // [scale vec | shift vec], d each
    const auto* shift_vec = reinterpret_cast<const AffinePair*>(slot + HEAD_DIM + c);
    // absent: gamma is 1; u (RMS: no mean), beta and b' are 0
    ga[h] = HAS_SCALE_VEC && real ? affine_f32(*vec) : make_float2(Q_FROM_QRAW ? 0.f : 1.f, Q_FROM_QRAW ? 0.f : 1.f);
    be[h] = HAS_SHIFT_VEC && real ? affine_f32(*shift_vec) : make_float2(0.f, 0.f);
  }
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
    u32 xa[4] = {0u, 0u, 0u, 0u};
    if constexpr (!Q_FROM_QRAW) {
      // rows lane & 15, lanes 16-31 the next 8 columns; unswizzled, the m-tile's and k-step's offset is an immediate
      const u32 addr = USE_TMA && !DENSE_ROWS
                           ? smem_addr(src.x_tile + x_elem_offset(mt * 16 + (lane & 15), kk * 2 + (lane >> 4)))
                           : smem_addr(src.x_tile) + ((lane & 15) * X_ROW_ELEMS + (lane >> 4) * 8) * 2 +
                                 (mt * 16 * X_ROW_ELEMS + kk * 16) * 2;
      if (LAST_KSTEP_K8 && kk == QK_KSTEPS - 1)  // 8 columns (lanes 0-15 give the addresses): the rest is pad
        ldmatrix_x2(xa[0], xa[1], addr);
      else
        ldmatrix_x4(xa, addr);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = e & 1, h = e >> 1;
      const bool pad = HEAD_DIM % 16 != 0 && kk * 16 + h * 8 >= HEAD_DIM;  // compile-time
      float lo, hi;
      if constexpr (Q_FROM_QRAW) {
        float2 qr = make_float2(0.f, 0.f);
        if (src.live[mt][i] && !pad)
          qr = *reinterpret_cast<const float2*>(src.q_rows + (long long)(mt * 16 + g + 8 * i) * p.q_ld + src.col0 +
                                                kk * 16 + t2 + 8 * h);
        lo = fmaf(qr.x, src.rs[mt][i], fmaf(src.shift[mt][i], ga[h].x, be[h].x));
        hi = fmaf(qr.y, src.rs[mt][i], fmaf(src.shift[mt][i], ga[h].y, be[h].y));
      } else {
        lo = fmaf(fmaf(lo_to_f32(xa[e]), src.rs[mt][i], src.shift[mt][i]), ga[h].x, be[h].x);
        hi = fmaf(fmaf(hi_to_f32(xa[e]), src.rs[mt][i], src.shift[mt][i]), ga[h].y, be[h].y);
      }
      // rows past Lq: zeros with Q_FROM_QRAW (qraw is not read there); from x, left as their statistics make them,
      // since every row's attention is its own and such rows are never stored
      a[mt][e] = (!Q_FROM_QRAW || src.live[mt][i]) && !pad ? pack2_elem(lo, hi) : 0u;
    }
  }
}

// A head's fragments, built once when its key tiles reuse them: kept in registers, or, when Q_IN_SMEM (too many to
// keep), in a per-warp Q tile. With ONE_TILE nothing is built ahead: QK^T makes each k-step's fragments as it needs
// them, so only one k-step's worth is ever live.
FN_INLINE void q_fragments(const Params& p, const QSource& src, u16* q_tile,
                           u32 (&qf)[Q_IN_SMEM ? 1 : M_TILES][Q_IN_SMEM ? 1 : QK_KSTEPS][4], int lane) {
  if constexpr (ONE_TILE) return;
  const int g = lane >> 2, t2 = (lane & 3) * 2;
#pragma unroll(Q_IN_SMEM ? 1 : QK_KSTEPS)  // fragments bound for shared memory need not all be live at once
  for (int kk = 0; kk < QK_KSTEPS; ++kk) {
    u32 a[M_TILES][4];
    q_kstep(p, src, kk, a, lane);
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (Q_IN_SMEM) {
          *reinterpret_cast<u32*>(q_tile + (mt * 16 + g + 8 * (e & 1)) * ROW_STRIDE + kk * 16 + t2 + 8 * (e >> 1)) =
              a[mt][e];
        } else {
          qf[mt][kk][e] = a[mt][e];
        }
      }
  }
  if constexpr (Q_IN_SMEM) __syncwarp();
}
