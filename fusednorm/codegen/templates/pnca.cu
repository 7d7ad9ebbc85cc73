// Pre-norm cross-attention: y = x + MHA(norm(x) split into heads, k, v), and the attention stage of the projection
// plan (fusednorm/plans): with Q_FROM_QRAW the queries come from qraw = x @ Wq'^T (float32, the norm folded into Wq',
// so q = rstd * (qraw - mean * u) + b'), and with WRITE_O the kernel writes o (no residual; the out GEMM adds it),
// plus, when asked, a ones column after the last head that carries bo through the out GEMM.
//
// A CTA works through work items (batch b, a block of BLOCK_M query rows, a group of heads), dealt round-robin over
// a persistent grid, so the result never depends on the grid size. The CTA's whole share is one flat sequence of
// steps (item, head, key tile), and a cp.async pipeline STAGES deep runs ahead along it, across heads and items:
// each stage brings one K and one V tile, and a head's first stage also brings that head's slice of x.
// Per item, each warp computes its rows' statistics over the full model dim (fp32, Welford, so |mean| >> std does
// not cancel). Per head: Q = norm(x slice) rounded to the element type (as eager rounds the norm's output), then
// FlashAttention-2 style attention over every key (mma.sync m16n8k16, online softmax in exp2 with the scale folded
// in), then y = x + o for that head's columns, rounded once, staged in the x slice for 16-byte stores.
// Each warp owns 16 * M_TILES query rows. With KEY_SPLIT > 1 (few query rows, e.g. decode) the warps share the
// same 16 rows and split each K/V stage between them; their partial softmax states are merged in a fixed order.
// Needs the configuration constants rendered ahead of this file (see fusednorm/codegen/render.py).

struct Params {
  const u16* x;        // [B, Lq, D], contiguous
  u16* y;              // [B, Lq, D] (or [B, Lq, y_ld] holding o with WRITE_O), rows contiguous
  const u16* k;        // [B, H, Lk, d], last dim contiguous
  const u16* v;
  const void* gamma;   // [D] or null
  const void* beta;    // [D] or null
  const void* mask;    // broadcast to [B, H, Lq, Lk] through the m_s* strides (keys contiguous), or null
  int* flag;           // set to 1 when the output holds NaN/Inf (CHECK_NUMERICS only)
  const float* qraw;   // [B * Lq, q_ld] (Q_FROM_QRAW only)
  const float* q_u;    // [H * d]: Wq' @ 1, multiplies the row mean (Q_FROM_QRAW with LayerNorm only)
  const float* q_b;    // [H * d]: Wq @ beta + bq (Q_FROM_QRAW only)
  long long k_sb, k_sh, k_sl;
  long long v_sb, v_sh, v_sl;
  long long m_sb, m_sh, m_sq;  // the key stride is 1 (run_kernel makes it so)
  long long q_ld, y_ld;        // row strides of qraw and y, in elements
  int batch, q_len, kv_len, heads, model_dim;
  int heads_per_item, head_groups, row_blocks, items;
  int ones_col;                // WRITE_O: also write [1, 0 x 7] at column H * d of every row
  float eps, scale_log2;
};
static_assert(sizeof(Params) == 224, "Params must match the packing in fusednorm/codegen/launch.py");

constexpr int THREADS = WARPS * 32;
constexpr int HEAD_DIM_PAD = (HEAD_DIM + 15) / 16 * 16;  // QK^T runs in k-steps of 16; d = 40 pads with zeros
constexpr int ROW_STRIDE = HEAD_DIM_PAD + 8;             // +16 bytes: the 8 rows of an ldmatrix hit distinct banks
constexpr int CHUNKS = HEAD_DIM / 8;                     // 16-byte chunks per head row
constexpr bool NEEDS_X_SLICE = !Q_FROM_QRAW || !WRITE_O;  // for the norm of Q, or for the residual
constexpr int ROWS_PER_WARP = 16 * M_TILES;
constexpr int BLOCK_M = KEY_SPLIT > 1 ? ROWS_PER_WARP : WARPS * ROWS_PER_WARP;
constexpr int KV_ROWS = BLOCK_N * KEY_SPLIT;             // keys per pipeline stage
constexpr int QK_KSTEPS = HEAD_DIM_PAD / 16;
constexpr int S_NTILES = BLOCK_N / 8;
constexpr int O_NTILES = HEAD_DIM / 8;
constexpr int PV_KSTEPS = BLOCK_N / 16;
constexpr int STAT_ROWS = 4;  // rows whose loads are in flight together in the statistics pass
static_assert(KEY_SPLIT == 1 || (KEY_SPLIT == WARPS && M_TILES == 1), "key split shares one m-tile");
static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 8 == 0 && ROWS_PER_WARP % STAT_ROWS == 0, "tile shape");

// Shared memory, in bytes: K stages, V stages, (Q_IN_SMEM only) one Q tile per warp, STAGES x-slice slots (a head's x slice lives
// from its first stage to its epilogue, which also stages y there), per-row statistics, and (key split only) the
// partial softmax states to merge.
constexpr int KV_TILE_ELEMS = KV_ROWS * ROW_STRIDE;
constexpr int Q_TILE_ELEMS = ROWS_PER_WARP * ROW_STRIDE;
constexpr int X_TILE_ELEMS = BLOCK_M * ROW_STRIDE;
constexpr int OFF_K = 0;
constexpr int OFF_V = OFF_K + STAGES * KV_TILE_ELEMS * 2;
constexpr int OFF_Q = OFF_V + STAGES * KV_TILE_ELEMS * 2;
constexpr int OFF_X = OFF_Q + (Q_IN_SMEM ? WARPS * Q_TILE_ELEMS * 2 : 0);
constexpr int OFF_STATS = OFF_X + STAGES * X_TILE_ELEMS * 2;
constexpr int OFF_COMBINE = OFF_STATS + WARPS * ROWS_PER_WARP * 2 * 4;
constexpr int COMBINE_BYTES = KEY_SPLIT > 1 ? WARPS * 16 * (HEAD_DIM + 2) * 4 : 0;
static_assert(OFF_COMBINE + COMBINE_BYTES <= SMEM_BYTES, "launch.py's shared-memory size is too small");

// ---- small vector helpers ----

FN_INLINE void unpack8(const u32x4& v, float (&f)[8]) {
  f[0] = lo_to_f32(v.x); f[1] = hi_to_f32(v.x); f[2] = lo_to_f32(v.y); f[3] = hi_to_f32(v.y);
  f[4] = lo_to_f32(v.z); f[5] = hi_to_f32(v.z); f[6] = lo_to_f32(v.w); f[7] = hi_to_f32(v.w);
}

FN_INLINE u32x4 pack8(const float (&f)[8]) {
  u32x4 v;
  v.x = pack2_elem(f[0], f[1]); v.y = pack2_elem(f[2], f[3]);
  v.z = pack2_elem(f[4], f[5]); v.w = pack2_elem(f[6], f[7]);
  return v;
}

FN_INLINE bool chunk_not_finite(const u32x4& v) {
  return pair_not_finite(v.x) || pair_not_finite(v.y) || pair_not_finite(v.z) || pair_not_finite(v.w);
}

// The mask's contribution to a score, in log2 units: 0 / -inf for a bool mask, bias * log2(e) for an additive one.
// Keys are contiguous in the mask, so one row pointer per query row plus small immediate offsets address it.
constexpr int MASK_ELEM_BYTES = MASK_KIND == 1 ? 1 : (MASK_IS_F32 ? 4 : 2);

FN_INLINE float mask_term(const u8* row, int key) {
  if constexpr (MASK_KIND == 1) {
    return row[key] ? 0.f : neg_inf();
  } else if constexpr (MASK_IS_F32) {
    return reinterpret_cast<const float*>(row)[key] * LOG2E_F;
  } else {
    return elem_to_f32(reinterpret_cast<const u16*>(row)[key]) * LOG2E_F;
  }
}

// ---- 1. row statistics (one warp, its own rows) ----

// Merge (nb, mub, m2b) into (n, mu, m2): Chan et al.'s pairwise update of count, mean and sum of squared deviations.
// Branch-free: an empty side (nb == 0) gives f == 0 and changes nothing.
FN_INLINE void welford_merge(float& n, float& mu, float& m2, float nb, float mub, float m2b) {
  const float nn = n + nb;
  const float f = __fdividef(nb, fmaxf(nn, 1.f));
  const float delta = mub - mu;
  mu += delta * f;
  m2 += m2b + delta * delta * n * f;
  n = nn;
}

FN_INLINE void row_statistics(const Params& p, const u16* x_batch, int row0, float* mean_s, float* rstd_s,
                              int lane) {
  const int D = p.model_dim;
#pragma unroll 1
  for (int r0 = 0; r0 < ROWS_PER_WARP; r0 += STAT_ROWS) {
    float n[STAT_ROWS], mu[STAT_ROWS], m2[STAT_ROWS];
#pragma unroll
    for (int j = 0; j < STAT_ROWS; ++j) { n[j] = 0.f; mu[j] = 0.f; m2[j] = 0.f; }
#pragma unroll 1
    for (int c0 = lane * 8; c0 < D; c0 += 2 * 256) {
      u32x4 v[2][STAT_ROWS];
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int j = 0; j < STAT_ROWS; ++j) {  // all loads first: 2 * STAT_ROWS 16-byte loads in flight
          const int q = row0 + r0 + j, c = c0 + u * 256;
          v[u][j] = q < p.q_len && c < D ? ld_global16(x_batch + (long long)q * D + c) : u32x4{0u, 0u, 0u, 0u};
        }
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int j = 0; j < STAT_ROWS; ++j) {
        if (c0 + u * 256 >= D) continue;
        float f[8];
        unpack8(v[u][j], f);
        if constexpr (NORM_IS_RMS) {
#pragma unroll
          for (int e = 0; e < 8; ++e) m2[j] = fmaf(f[e], f[e], m2[j]);
        } else {
          float s = 0.f;
#pragma unroll
          for (int e = 0; e < 8; ++e) s += f[e];
          const float cm = s * 0.125f;
          float cm2 = 0.f;
#pragma unroll
          for (int e = 0; e < 8; ++e) cm2 = fmaf(f[e] - cm, f[e] - cm, cm2);
          welford_merge(n[j], mu[j], m2[j], 8.f, cm, cm2);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < STAT_ROWS; ++j) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        if constexpr (NORM_IS_RMS) {
          m2[j] += __shfl_xor_sync(FULL_WARP, m2[j], off);
        } else {
          const float nb = __shfl_xor_sync(FULL_WARP, n[j], off);
          const float mub = __shfl_xor_sync(FULL_WARP, mu[j], off);
          const float m2b = __shfl_xor_sync(FULL_WARP, m2[j], off);
          welford_merge(n[j], mu[j], m2[j], nb, mub, m2b);
        }
      }
      if (lane == j) {
        mean_s[r0 + j] = NORM_IS_RMS ? 0.f : mu[j];
        rstd_s[r0 + j] = rsqrtf(m2[j] / (float)D + p.eps);  // biased variance, or mean(x^2) for RMS
      }
    }
  }
  __syncwarp();
}

// ---- 2. the Q fragments of one head: norm(x slice), rounded to the element type (one warp, its own rows) ----

// Two norm parameters (gamma or beta) at column col, as fp32.
FN_INLINE float2 load_affine2(const void* ptr, int col) {
  if constexpr (AFFINE_IS_F32) return *reinterpret_cast<const float2*>(static_cast<const float*>(ptr) + col);
  const u32 pair = *reinterpret_cast<const u32*>(static_cast<const u16*>(ptr) + col);
  return make_float2(lo_to_f32(pair), hi_to_f32(pair));
}

// The A fragments of QK^T come straight from the x slice (ldmatrix), and the norm is applied in registers:
// register e of (m-tile mt, k-step kk) holds rows mt*16 + g + 8*(e&1), columns kk*16 + t2 + 8*(e>>1) + {0, 1}.
// No Q tile is built in shared memory, unless Q_IN_SMEM (fragments too many to keep): then they are stored there.
// Rows past Lq and the pad columns of d = 40 come out as 0.
// With Q_FROM_QRAW the same registers are q = rstd * (qraw - mean * u) + b' = qraw * rstd + (shift * u + b'), read
// from qraw (float32, q_rows: the warp's first row) instead of x; ga/be then hold u and b'.
FN_INLINE void q_fragments(const Params& p, int row0, int col0, const float* mean_s, const float* rstd_s,
                           const u16* x_tile, const float* q_rows, u16* q_tile,
                           u32 (&qf)[Q_IN_SMEM ? 1 : M_TILES][Q_IN_SMEM ? 1 : QK_KSTEPS][4], int lane) {
  const int g = lane >> 2, t2 = (lane & 3) * 2;
  float rs[M_TILES][2], shift[M_TILES][2];  // h = (x * rs + shift) * gamma + beta, with shift = -mean * rs
  bool live[M_TILES][2];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = mt * 16 + g + 8 * i;
      live[mt][i] = row0 + r < p.q_len;
      rs[mt][i] = rstd_s[r];
      shift[mt][i] = -mean_s[r] * rs[mt][i];
    }
#pragma unroll(Q_IN_SMEM ? 1 : QK_KSTEPS)  // fragments bound for shared memory need not all be live at once
  for (int kk = 0; kk < QK_KSTEPS; ++kk) {
    float2 ga[2], be[2];  // this thread's columns of the k-step, per half (u and b' with Q_FROM_QRAW)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = kk * 16 + t2 + h * 8;
      const bool real = HEAD_DIM % 16 == 0 || c < HEAD_DIM;
      if constexpr (Q_FROM_QRAW) {
        ga[h] = !NORM_IS_RMS && real ? *reinterpret_cast<const float2*>(p.q_u + col0 + c) : make_float2(0.f, 0.f);
        be[h] = real ? *reinterpret_cast<const float2*>(p.q_b + col0 + c) : make_float2(0.f, 0.f);
      } else {
        ga[h] = HAS_GAMMA && real ? load_affine2(p.gamma, col0 + c) : make_float2(1.f, 1.f);
        be[h] = HAS_BETA && real ? load_affine2(p.beta, col0 + c) : make_float2(0.f, 0.f);
      }
    }
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      u32 a[4];
      if constexpr (!Q_FROM_QRAW)
        ldmatrix_x4(a, smem_addr(x_tile + (mt * 16 + (lane & 15)) * ROW_STRIDE + kk * 16 + (lane >> 4) * 8));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e & 1, h = e >> 1;
        const bool pad = HEAD_DIM % 16 != 0 && kk * 16 + h * 8 >= HEAD_DIM;  // compile-time
        float lo, hi;
        if constexpr (Q_FROM_QRAW) {
          float2 qr = make_float2(0.f, 0.f);
          if (live[mt][i] && !pad)
            qr = *reinterpret_cast<const float2*>(q_rows + (long long)(mt * 16 + g + 8 * i) * p.q_ld + col0 + kk * 16 +
                                                  t2 + 8 * h);
          lo = fmaf(qr.x, rs[mt][i], fmaf(shift[mt][i], ga[h].x, be[h].x));
          hi = fmaf(qr.y, rs[mt][i], fmaf(shift[mt][i], ga[h].y, be[h].y));
        } else {
          lo = fmaf(fmaf(lo_to_f32(a[e]), rs[mt][i], shift[mt][i]), ga[h].x, be[h].x);
          hi = fmaf(fmaf(hi_to_f32(a[e]), rs[mt][i], shift[mt][i]), ga[h].y, be[h].y);
        }
        const u32 q = live[mt][i] && !pad ? pack2_elem(lo, hi) : 0u;
        if constexpr (Q_IN_SMEM) {
          *reinterpret_cast<u32*>(q_tile + (mt * 16 + g + 8 * i) * ROW_STRIDE + kk * 16 + t2 + 8 * h) = q;
        } else {
          qf[mt][kk][e] = q;
        }
      }
    }
  }
  if constexpr (Q_IN_SMEM) __syncwarp();
}

// ---- K/V stage loads (whole CTA) ----

// Copies are 16-byte chunks. Thread tid always copies chunk tid % CHUNKS of rows tid / CHUNKS + i * COPY_ROWS, so the
// row and column offsets are worked out once per tile and each further row costs one pointer add (threads past
// COPY_ROWS * CHUNKS have no chunk and return at once).
constexpr int COPY_ROWS = THREADS / CHUNKS;  // rows the CTA copies per pass

// Keys [key_base, key_base + KV_ROWS) of one head into a stage. Rows up to the next multiple of 16 past Lk are
// zero-filled (the mma k-steps read them); rows beyond that are never read and are not touched.
FN_INLINE void load_kv_tile(const Params& p, int b, int head, int key_base, u16* k_stage, u16* v_stage, int tid) {
  const int r0 = tid / CHUNKS, c = (tid % CHUNKS) * 8;
  if (r0 >= COPY_ROWS) return;
  const int kv_pad16 = (p.kv_len + 15) & ~15;
  const u16* k_head = p.k + b * p.k_sb + head * p.k_sh;
  const u16* v_head = p.v + b * p.v_sb + head * p.v_sh;
  const u16* kp = k_head + (key_base + r0) * p.k_sl + c;
  const u16* vp = v_head + (key_base + r0) * p.v_sl + c;
  const long long k_step = COPY_ROWS * p.k_sl, v_step = COPY_ROWS * p.v_sl;
  const u32 k_dst = smem_addr(k_stage + r0 * ROW_STRIDE + c), v_dst = smem_addr(v_stage + r0 * ROW_STRIDE + c);
#pragma unroll
  for (int i = 0; i < (KV_ROWS + COPY_ROWS - 1) / COPY_ROWS; ++i) {
    const int r = r0 + i * COPY_ROWS, key = key_base + r;
    if ((KV_ROWS % COPY_ROWS == 0 || r < KV_ROWS) && key < kv_pad16) {
      const bool in_range = key < p.kv_len;  // else: zero-fill, reading nothing (the head's base stands in)
      cp_async16(k_dst + i * COPY_ROWS * ROW_STRIDE * 2, in_range ? kp : k_head, in_range ? 16 : 0);
      cp_async16(v_dst + i * COPY_ROWS * ROW_STRIDE * 2, in_range ? vp : v_head, in_range ? 16 : 0);
    }
    kp += k_step;
    vp += v_step;
  }
}

// The head's x slice for the CTA's BLOCK_M rows (rows past Lq are left alone: nothing reads them).
FN_INLINE void load_x_tile(const Params& p, int b, int row_base, int col0, u16* x_tile, int tid) {
  const int r0 = tid / CHUNKS, c = (tid % CHUNKS) * 8;
  if (r0 >= COPY_ROWS) return;
  const u16* xp = p.x + ((long long)b * p.q_len + row_base + r0) * p.model_dim + col0 + c;
  const long long step = (long long)COPY_ROWS * p.model_dim;
  const u32 dst = smem_addr(x_tile + r0 * ROW_STRIDE + c);
#pragma unroll
  for (int i = 0; i < (BLOCK_M + COPY_ROWS - 1) / COPY_ROWS; ++i) {
    const int r = r0 + i * COPY_ROWS;
    if ((BLOCK_M % COPY_ROWS == 0 || r < BLOCK_M) && row_base + r < p.q_len)
      cp_async16(dst + i * COPY_ROWS * ROW_STRIDE * 2, xp, 16);
    xp += step;
  }
}

// ---- 3. attention over one K/V tile (one warp) ----

// k_tile / v_tile point at this warp's first key row in the stage; key0 is that key's index, valid (> 0) the
// number of real keys from there (at most BLOCK_N); qrow0 the warp's first query row.
// FULL: all BLOCK_N keys are real (every tile but the last); no per-n-tile guards, so the mma chain is straight.
template <bool FULL>
FN_INLINE void attend_tile(const Params& p, const u32 (&qf)[Q_IN_SMEM ? 1 : M_TILES][Q_IN_SMEM ? 1 : QK_KSTEPS][4],
                           const u16* q_tile, const u16* k_tile, const u16* v_tile, int key0, int valid, int qrow0,
                           long long mask_bh, float (&o)[M_TILES][O_NTILES][4], float (&m)[M_TILES][2],
                           float (&l)[M_TILES][2], int lane) {
  const int g = lane >> 2, t2 = (lane & 3) * 2;

  // S = Q K^T (fp32). Key pairs of n-tiles past the last valid 16 keys are skipped (warp-uniform branch).
  float s[M_TILES][S_NTILES][4];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < S_NTILES; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;

#pragma unroll
  for (int kk = 0; kk < QK_KSTEPS; ++kk) {
    u32 a[M_TILES][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      if constexpr (Q_IN_SMEM) {
        ldmatrix_x4(a[mt], smem_addr(q_tile + (mt * 16 + (lane & 15)) * ROW_STRIDE + kk * 16 + (lane >> 4) * 8));
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[mt][e] = qf[mt][kk][e];
      }
    }
#pragma unroll
    for (int np = 0; np < S_NTILES / 2; ++np) {
      if (FULL || np * 16 < valid) {
        u32 b[4];
        ldmatrix_x4(b, smem_addr(k_tile + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * ROW_STRIDE + kk * 16 +
                                 ((lane >> 3) & 1) * 8));
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          mma_16816(s[mt][2 * np], a[mt], b[0], b[1]);
          mma_16816(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

  // Scale into log2 units, add the mask, drop keys past Lk.
  const u8* mask_rows[M_TILES][2];  // null for query rows past Lq
  if constexpr (MASK_KIND != 0) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int q = qrow0 + mt * 16 + g + half * 8;
        mask_rows[mt][half] = q < p.q_len ? static_cast<const u8*>(p.mask) + (mask_bh + q * p.m_sq) * MASK_ELEM_BYTES
                                          : nullptr;
      }
  }
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < S_NTILES; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (!FULL && nt / 2 * 16 >= valid) continue;  // a key pair never computed: skipped here and by P V
        float z = s[mt][nt][e] * p.scale_log2;
        const int key = key0 + nt * 8 + t2 + (e & 1);
        if constexpr (MASK_KIND != 0) {
          const u8* row = mask_rows[mt][e >> 1];
          if (row != nullptr && key < p.kv_len) z += mask_term(row, key);
        }
        if (!FULL && key >= p.kv_len) z = neg_inf();
        s[mt][nt][e] = z;
      }

  // Online softmax. Rows whose every key so far is masked keep m = -inf; they exponentiate against 0 so that
  // p = 0 and l = 0 (never NaN), and the epilogue writes o = 0 for them.
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = neg_inf();
#pragma unroll
      for (int nt = 0; nt < S_NTILES; ++nt)
        if (FULL || nt / 2 * 16 < valid) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 2));
      const float m_new = fmaxf(m[mt][half], mx);
      const float m_use = m_new == neg_inf() ? 0.f : m_new;
      const float alpha = fast_exp2(m[mt][half] - m_use);
      m[mt][half] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < S_NTILES; ++nt)
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          if (!FULL && nt / 2 * 16 >= valid) continue;
          s[mt][nt][e] = fast_exp2(s[mt][nt][e] - m_use);
          sum += s[mt][nt][e];
        }
      l[mt][half] = l[mt][half] * alpha + sum;  // per-thread partial; summed over the quad in the epilogue
#pragma unroll
      for (int nt = 0; nt < O_NTILES; ++nt) {
        o[mt][nt][2 * half] *= alpha;
        o[mt][nt][2 * half + 1] *= alpha;
      }
    }

  // O += P V: the S accumulators are already laid out as the A fragments of the next mma.
#pragma unroll
  for (int ks = 0; ks < PV_KSTEPS; ++ks) {
    if (FULL || ks * 16 < valid) {
      u32 a[M_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        a[mt][0] = pack2_elem(s[mt][2 * ks][0], s[mt][2 * ks][1]);
        a[mt][1] = pack2_elem(s[mt][2 * ks][2], s[mt][2 * ks][3]);
        a[mt][2] = pack2_elem(s[mt][2 * ks + 1][0], s[mt][2 * ks + 1][1]);
        a[mt][3] = pack2_elem(s[mt][2 * ks + 1][2], s[mt][2 * ks + 1][3]);
      }
      const u16* v_rows = v_tile + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ROW_STRIDE;
#pragma unroll
      for (int dp = 0; dp < O_NTILES / 2; ++dp) {
        u32 b[4];
        ldmatrix_x4_trans(b, smem_addr(v_rows + dp * 16 + (lane >> 4) * 8));
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          mma_16816(o[mt][2 * dp], a[mt], b[0], b[1]);
          mma_16816(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
      if constexpr (O_NTILES % 2 == 1) {  // d = 40: the fifth n-tile of 8 columns
        u32 b0, b1;
        ldmatrix_x2_trans(b0, b1, smem_addr(v_rows + (O_NTILES - 1) * 8));
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) mma_16816(o[mt][O_NTILES - 1], a[mt], b0, b1);
      }
    }
  }
}

// ---- 4. epilogue: y = x + o (or o alone, WRITE_O) for one head's columns ----

// The chunk [1, 0, ..., 0] after the last head's columns: bo rides through the out GEMM as one more K column.
FN_INLINE void store_ones_chunk(const Params& p, u16* y_batch, int q) {
  st_global16_stream(y_batch + (long long)q * p.y_ld + p.heads * HEAD_DIM, u32x4{pack2_elem(1.f, 0.f), 0u, 0u, 0u});
}

// One warp, its own rows. x comes from the head's x slice in shared memory, and y overwrites it there (each element
// is read and written by the same thread) so that the global stores are 16 bytes wide.
FN_INLINE void store_output_rows(const Params& p, u16* y_batch, int row0, int col0,
                                 const float (&o)[M_TILES][O_NTILES][4], const float (&l)[M_TILES][2], u16* x_tile,
                                 int lane, bool& bad) {
  const int g = lane >> 2, t2 = (lane & 3) * 2;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float lsum = l[mt][half];
      lsum += __shfl_xor_sync(FULL_WARP, lsum, 1);
      lsum += __shfl_xor_sync(FULL_WARP, lsum, 2);
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;  // fully masked rows: o = 0
      const int r = mt * 16 + g + half * 8;
      if (row0 + r < p.q_len) {
#pragma unroll
        for (int nt = 0; nt < O_NTILES; ++nt) {
          u32* xy = reinterpret_cast<u32*>(x_tile + r * ROW_STRIDE + nt * 8 + t2);
          const u32 xp = WRITE_O ? 0u : *xy;  // +0.0 pair: o alone
          const u32 yp = pack2_elem(lo_to_f32(xp) + o[mt][nt][2 * half] * inv,
                                    hi_to_f32(xp) + o[mt][nt][2 * half + 1] * inv);
          if constexpr (CHECK_NUMERICS) bad |= pair_not_finite(yp);
          *xy = yp;
        }
      }
    }
  __syncwarp();
  constexpr int TOTAL = ROWS_PER_WARP * CHUNKS;
#pragma unroll
  for (int it = 0; it < (TOTAL + 31) / 32; ++it) {
    const int i = lane + it * 32;
    const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
    if ((TOTAL % 32 == 0 || i < TOTAL) && row0 + r < p.q_len) {
      st_global16_stream(y_batch + (long long)(row0 + r) * p.y_ld + col0 + c,
                         *reinterpret_cast<const u32x4*>(x_tile + r * ROW_STRIDE + c));
    }
  }
  if (WRITE_O && p.ones_col && col0 == 0)
    for (int r = lane; r < ROWS_PER_WARP && row0 + r < p.q_len; r += 32) store_ones_chunk(p, y_batch, row0 + r);
  __syncwarp();
}

// Key split: every warp holds a partial (m, l, o) for the same 16 rows; merge them in warp order (deterministic).
FN_INLINE void combine_and_store(const Params& p, const u16* x_tile, u16* y_batch, int row0, int col0,
                                 const float (&o)[M_TILES][O_NTILES][4], const float (&m)[M_TILES][2],
                                 const float (&l)[M_TILES][2], float* combine, int warp, int lane, int tid,
                                 bool& bad) {
  float* acc_all = combine;                          // [WARPS][16][HEAD_DIM]
  float* m_all = combine + WARPS * 16 * HEAD_DIM;    // [WARPS][16]
  float* l_all = m_all + WARPS * 16;                 // [WARPS][16]
  const int g = lane >> 2, t2 = (lane & 3) * 2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float lsum = l[0][half];
    lsum += __shfl_xor_sync(FULL_WARP, lsum, 1);
    lsum += __shfl_xor_sync(FULL_WARP, lsum, 2);
    const int r = g + half * 8;
    if (t2 == 0) {
      m_all[warp * 16 + r] = m[0][half];
      l_all[warp * 16 + r] = lsum;
    }
    float* acc_row = acc_all + (warp * 16 + r) * HEAD_DIM;
#pragma unroll
    for (int nt = 0; nt < O_NTILES; ++nt) {
      acc_row[nt * 8 + t2] = o[0][nt][2 * half];
      acc_row[nt * 8 + t2 + 1] = o[0][nt][2 * half + 1];
    }
  }
  __syncthreads();
#pragma unroll 1
  for (int i = tid; i < 16 * CHUNKS; i += THREADS) {
    const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
    const int q = row0 + r;
    if (q >= p.q_len) continue;
    float m_max = neg_inf();
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m_max = fmaxf(m_max, m_all[w * 16 + r]);
    const float m_use = m_max == neg_inf() ? 0.f : m_max;
    float total = 0.f, f[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float wt = fast_exp2(m_all[w * 16 + r] - m_use);
      total += wt * l_all[w * 16 + r];
      const float* acc_row = acc_all + (w * 16 + r) * HEAD_DIM + c;
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = fmaf(wt, acc_row[e], f[e]);
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    const long long off = (long long)q * p.y_ld + col0 + c;
    float xf[8];
    unpack8(WRITE_O ? u32x4{0u, 0u, 0u, 0u} : *reinterpret_cast<const u32x4*>(x_tile + r * ROW_STRIDE + c), xf);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = xf[e] + f[e] * inv;
    const u32x4 out = pack8(f);
    if constexpr (CHECK_NUMERICS) bad |= chunk_not_finite(out);
    st_global16_stream(y_batch + off, out);
  }
  if (WRITE_O && p.ones_col && col0 == 0 && tid < 16 && row0 + tid < p.q_len) store_ones_chunk(p, y_batch, row0 + tid);
}

// ---- the kernel ----

// Position in the CTA's flat sequence of steps (item, head, key tile). Uniform across the CTA.
struct StepCursor {
  int item, b, row_block, head_begin, head, head_end, tile;
  int head_seq;  // heads entered so far by this CTA: picks the x-slice slot
};

FN_INLINE void cursor_enter_item(const Params& p, StepCursor& c) {
  if (c.item >= p.items) return;
  const int group = c.item % p.head_groups;
  c.row_block = (c.item / p.head_groups) % p.row_blocks;
  c.b = c.item / (p.head_groups * p.row_blocks);
  c.head_begin = c.head = group * p.heads_per_item;
  c.head_end = min(c.head + p.heads_per_item, p.heads);
  c.tile = 0;
}

FN_INLINE void cursor_advance(const Params& p, StepCursor& c, int key_tiles) {
  if (++c.tile < key_tiles) return;
  c.tile = 0;
  ++c.head_seq;
  if (++c.head < c.head_end) return;
  c.item += gridDim.x;
  cursor_enter_item(p, c);
}

// Issue the copies of one step into a pipeline stage (and, on a head's first step, its x slice if needed).
FN_INLINE void load_step(const Params& p, const StepCursor& c, int stage, u16* k_stages, u16* v_stages,
                         u16* x_slots, int tid) {
  load_kv_tile(p, c.b, c.head, c.tile * KV_ROWS, k_stages + stage * KV_TILE_ELEMS, v_stages + stage * KV_TILE_ELEMS,
               tid);
  if (NEEDS_X_SLICE && c.tile == 0)
    load_x_tile(p, c.b, c.row_block * BLOCK_M, c.head * HEAD_DIM, x_slots + (c.head_seq % STAGES) * X_TILE_ELEMS,
                tid);
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS_PER_SM) KERNEL_NAME(const Params p) {
  extern __shared__ __align__(16) u8 smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  u16* k_stages = reinterpret_cast<u16*>(smem + OFF_K);
  u16* v_stages = reinterpret_cast<u16*>(smem + OFF_V);
  u16* q_tile = reinterpret_cast<u16*>(smem + OFF_Q) + warp * Q_TILE_ELEMS;
  u16* x_slots = reinterpret_cast<u16*>(smem + OFF_X);
  float* row_mean = reinterpret_cast<float*>(smem + OFF_STATS) + warp * 2 * ROWS_PER_WARP;
  float* row_rstd = row_mean + ROWS_PER_WARP;
  float* combine = reinterpret_cast<float*>(smem + OFF_COMBINE);

  if constexpr (HEAD_DIM_PAD > HEAD_DIM) {  // pad columns of every K/V row are read by the last k-step: zero them
    constexpr int PAD = HEAD_DIM_PAD - HEAD_DIM;
    constexpr int ROWS = 2 * STAGES * KV_ROWS;  // K and V stages are contiguous
    u16* rows = reinterpret_cast<u16*>(smem + OFF_K);
    for (int i = tid; i < ROWS * PAD; i += THREADS) rows[(i / PAD) * ROW_STRIDE + HEAD_DIM + i % PAD] = 0;
  }

  const int key_tiles = (p.kv_len + KV_ROWS - 1) / KV_ROWS;
  bool bad = false;

  // Prologue: the first STAGES - 1 steps in flight.
  StepCursor ahead;
  ahead.item = blockIdx.x;
  ahead.head_seq = 0;
  cursor_enter_item(p, ahead);
  StepCursor cur = ahead;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (ahead.item < p.items) {
      load_step(p, ahead, s, k_stages, v_stages, x_slots, tid);
      cursor_advance(p, ahead, key_tiles);
    }
    cp_async_commit();
  }

  u32 qf[Q_IN_SMEM ? 1 : M_TILES][Q_IN_SMEM ? 1 : QK_KSTEPS][4];
  float o[M_TILES][O_NTILES][4];
  float m[M_TILES][2], l[M_TILES][2];

#pragma unroll 1
  for (int stage = 0; cur.item < p.items; stage = stage + 1 == STAGES ? 0 : stage + 1) {
    const int row0 = cur.row_block * BLOCK_M + (KEY_SPLIT > 1 ? 0 : warp * ROWS_PER_WARP);
    const bool warp_rows = row0 < p.q_len;  // false for warps entirely past the last query row
    u16* y_batch = p.y + (long long)cur.b * p.q_len * p.y_ld;
    if (cur.tile == 0) {  // a new head (the accumulators of the last one are dead here, which saves registers)
      if (cur.head == cur.head_begin && warp_rows)  // a new item: statistics of this warp's rows
        row_statistics(p, p.x + (long long)cur.b * p.q_len * p.model_dim, row0, row_mean, row_rstd, lane);
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int nt = 0; nt < O_NTILES; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.f;
        m[mt][0] = m[mt][1] = neg_inf();
        l[mt][0] = l[mt][1] = 0.f;
      }
    }

    cp_async_wait<STAGES - 2>();
    __syncthreads();  // this step's stage is visible to all warps; the stage refilled below is free
    if (ahead.item < p.items) {
      load_step(p, ahead, stage == 0 ? STAGES - 1 : stage - 1, k_stages, v_stages, x_slots, tid);
      cursor_advance(p, ahead, key_tiles);
    }
    cp_async_commit();

    u16* x_tile = x_slots + (cur.head_seq % STAGES) * X_TILE_ELEMS;
    u16* x_warp = x_tile + (KEY_SPLIT > 1 ? 0 : warp * ROWS_PER_WARP * ROW_STRIDE);
    const int col0 = cur.head * HEAD_DIM;
    if (cur.tile == 0 && warp_rows)
      q_fragments(p, row0, col0, row_mean, row_rstd, x_warp, p.qraw + ((long long)cur.b * p.q_len + row0) * p.q_ld,
                  q_tile, qf, lane);

    const int warp_key_offset = KEY_SPLIT > 1 ? warp * BLOCK_N : 0;
    const int key0 = cur.tile * KV_ROWS + warp_key_offset;
    const int valid = min(BLOCK_N, p.kv_len - key0);
    if (warp_rows && valid > 0) {
      const long long mask_bh = MASK_KIND != 0 ? cur.b * p.m_sb + cur.head * p.m_sh : 0;
      const u16* k_tile = k_stages + stage * KV_TILE_ELEMS + warp_key_offset * ROW_STRIDE;
      const u16* v_tile = v_stages + stage * KV_TILE_ELEMS + warp_key_offset * ROW_STRIDE;
      if (valid == BLOCK_N)
        attend_tile<true>(p, qf, q_tile, k_tile, v_tile, key0, valid, row0, mask_bh, o, m, l, lane);
      else
        attend_tile<false>(p, qf, q_tile, k_tile, v_tile, key0, valid, row0, mask_bh, o, m, l, lane);
    }

    if (cur.tile == key_tiles - 1) {
      if constexpr (KEY_SPLIT > 1) {
        combine_and_store(p, x_tile, y_batch, row0, col0, o, m, l, combine, warp, lane, tid, bad);
      } else if (warp_rows) {
        store_output_rows(p, y_batch, row0, col0, o, l, x_warp, lane, bad);
      }
    }
    cursor_advance(p, cur, key_tiles);
  }
  cp_async_wait<0>();

  if constexpr (CHECK_NUMERICS) {
    if (__any_sync(FULL_WARP, bad) && lane == 0) atomicOr(p.flag, 1);
  }
}
