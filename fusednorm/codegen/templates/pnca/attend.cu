// Step 3 of the pnca kernel: attention over one K/V tile (one warp).

// k_tile / v_tile point at this warp's first key row in the stage; key0 is that key's index, valid (> 0) the
// number of real keys from there (at most BLOCK_N); qrow0 the warp's first query row.
// FILL says which keys of the tile are real, so that the common cases carry no per-n-tile guards and the mma chain
// is straight: FILL_ALL (every tile but the last), FILL_LAST_PAIR (only the last 16 keys hold some past Lk: every
// key pair is computed and only those are masked; with ONE_TILE, Lk = 77 of an 80-key stage), FILL_ANY.
// first: the head's first tile, whose o, m, l are still 0, -inf, 0 (nothing to rescale).
enum TileFill { FILL_ALL, FILL_LAST_PAIR, FILL_ANY };

template <int FILL>
FN_INLINE void attend_tile(const Params& p, const QSource& src,
                           const u32 (&qf)[Q_IN_SMEM ? 1 : M_TILES][Q_IN_SMEM ? 1 : QK_KSTEPS][4], const u16* q_tile,
                           const u16* k_tile, const u16* v_tile, int key0, int valid, int qrow0, long long mask_bh,
                           bool first, float (&o)[M_TILES][O_ACC_NTILES][4], float (&m)[M_TILES][2],
                           float (&l)[M_TILES][2], int lane) {
  const int g = lane >> 2, t2 = (lane & 3) * 2;
  // Padded or unpadded stages: this lane's ldmatrix row and column as one byte address per tile, so that every
  // n-tile's and k-step's offset is an immediate. K: keys (lane & 7) + 8 * (lane >> 4), lanes 8-15 and 24-31 the
  // next 8 columns (b[0], b[1] one n-tile's two column halves, b[2], b[3] the next n-tile's: each pair in adjacent
  // registers, as the mma takes it); d = 40's last k-step of 8 columns reads keys lane & 15 (lanes 0-15). V,
  // transposed: keys lane & 15, lanes 16-31 the next 8 columns (b[0], b[1] one n-tile of columns, b[2], b[3] the next).
  const u32 k_lane = smem_addr(k_tile) + (((lane & 7) + ((lane >> 4) << 3)) * KV_ROW_ELEMS + ((lane >> 3) & 1) * 8) * 2;
  const u32 k8_lane = smem_addr(k_tile) + (lane & 15) * KV_ROW_ELEMS * 2;
  const u32 v_lane = smem_addr(v_tile) + ((lane & 15) * KV_ROW_ELEMS + (lane >> 4) * 8) * 2;

  // S = Q K^T (fp32). Key pairs of n-tiles past the last valid 16 keys are skipped (warp-uniform branch); the
  // warpgroup mma computes them all (their scores are never read).
  float s[M_TILES][S_NTILES][4];
  if constexpr (USE_WGMMA) {
    u32 a[QK_KSTEPS][4];  // every k-step's fragments first: an issued wgmma reads its A registers later
#pragma unroll
    for (int kk = 0; kk < QK_KSTEPS; ++kk) {
      if constexpr (ONE_TILE) {
        u32 f[M_TILES][4];
        q_kstep(p, src, kk, f, lane);
#pragma unroll
        for (int e = 0; e < 4; ++e) a[kk][e] = f[0][e];
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[kk][e] = qf[0][kk][e];
      }
    }
    wgmma_fence();
    const u64 k_desc = sw128_desc(smem_addr(k_tile), 16, 1024);
#pragma unroll
    for (int kk = 0; kk < QK_KSTEPS; ++kk)  // k-step kk: 32 bytes into each row of column block kk / 4
      wgmma_scores(s[0], a[kk], desc_advance(k_desc, (kk / 4) * KV_ROWS * 128 + (kk % 4) * 32), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    pin_all(s[0]);
    pin_all(a);
  } else {
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < S_NTILES; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;

#pragma unroll
  for (int kk = 0; kk < QK_KSTEPS; ++kk) {
    u32 a[M_TILES][4];
    if constexpr (ONE_TILE) q_kstep(p, src, kk, a, lane);
#pragma unroll
    for (int mt = 0; mt < M_TILES && !ONE_TILE; ++mt) {
      if constexpr (Q_IN_SMEM) {
        ldmatrix_x4(a[mt], smem_addr(q_tile + (mt * 16 + (lane & 15)) * ROW_STRIDE + kk * 16 + (lane >> 4) * 8));
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[mt][e] = qf[mt][kk][e];
      }
    }
#pragma unroll
    for (int np = 0; np < S_NTILES / 2; ++np) {
      if (FILL != FILL_ANY || np * 16 < valid) {
        if (LAST_KSTEP_K8 && kk == QK_KSTEPS - 1) {  // d = 40's columns 32..39: keys np*16 + 0..7 and 8..15
          u32 b0, b1;
          ldmatrix_x2(b0, b1, k8_lane + (np * 16 * KV_ROW_ELEMS + kk * 16) * 2);
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt) {
            mma_1688(s[mt][2 * np], a[mt], b0);
            mma_1688(s[mt][2 * np + 1], a[mt], b1);
          }
          continue;
        }
        u32 b[4];
        const int k_row = np * 16 + (lane & 7) + ((lane >> 4) << 3), k_half = (lane >> 3) & 1;
        ldmatrix_x4(b, KV_SWIZZLED ? smem_addr(k_tile + kv_swizzled_offset(k_row, kk * 2 + k_half))
                                   : k_lane + (np * 16 * KV_ROW_ELEMS + kk * 16) * 2);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          mma_16816(s[mt][2 * np], a[mt], b[0], b[1]);
          mma_16816(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }
  }  // USE_WGMMA

  // The scores are raw Q K^T: the scale (in log2 units) is applied inside the exponent, exp2(s * c - m), one FFMA
  // per score, with m the running maximum in scaled units (the raw maximum times c, as c > 0). With a mask, or a
  // scale that is not positive, the scores are scaled first (z = s * scale + mask) and c is 1. Keys past Lk, which
  // only the edge n-tiles hold, become -inf.
  const bool prescale = MASK_KIND != 0 || !(p.scale_log2 > 0.f);
  const float c = prescale ? 1.f : p.scale_log2;
  if (prescale) {
    const u8* mask_rows[M_TILES][2];  // null for query rows past Lq
    if constexpr (MASK_KIND != 0) {
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int q = qrow0 + mt * 16 + g + half * 8;
          mask_rows[mt][half] = q < p.q_len ? static_cast<const u8*>(p.mask) +
                                                  (mask_bh + q * p.m_sq) * MASK_ELEM_BYTES : nullptr;
        }
    }
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int nt = 0; nt < S_NTILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (FILL == FILL_ANY && nt / 2 * 16 >= valid) continue;  // a key pair never computed: skipped here and by P V
          const int key = nt * 8 + t2 + (e & 1);
          float term = 0.f;
          if constexpr (MASK_KIND != 0) {
            const u8* row = mask_rows[mt][e >> 1];
            if (row != nullptr && key < valid) term = mask_term(row, key0 + key);
          }
          float z = fmaf(s[mt][nt][e], p.scale_log2, term);
          if (FILL != FILL_ALL && key >= valid) z = neg_inf();
          s[mt][nt][e] = z;
        }
  } else if (FILL != FILL_ALL) {  // the edge n-tiles: computed, and holding keys past Lk
#pragma unroll
    for (int nt = FILL == FILL_LAST_PAIR ? S_NTILES - 2 : 0; nt < S_NTILES; ++nt)
      if (FILL == FILL_LAST_PAIR || (nt * 8 + 8 > valid && nt / 2 * 16 < valid))
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (nt * 8 + t2 + (e & 1) >= valid) s[mt][nt][e] = neg_inf();
  }

  // Online softmax. Rows whose every key so far is masked keep m = -inf; they exponentiate against 0 so that
  // p = 0 and l = 0 (never NaN), and the epilogue writes o = 0 for them. P goes out packed as the A fragments of
  // P V: pk[mt][nt][half] holds rows g + 8 * half, keys nt * 8 + t2 + {0, 1}. The row sums l come with P V, as
  // P times a column of ones (with USE_WGMMA, 8 columns read from a block of ones): one mma per 16 keys instead of
  // an add per score and a quad reduction, and the sum of the same rounded P that the numerator uses.
  u32 pk[M_TILES][S_NTILES][2];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = neg_inf();
#pragma unroll
      for (int nt = 0; nt < S_NTILES; ++nt)
        if (FILL != FILL_ANY || nt / 2 * 16 < valid)
          mx = fmaxf(mx, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 2)) * c;
      const float m_new = first ? mx : fmaxf(m[mt][half], mx);
      const float m_use = m_new == neg_inf() ? 0.f : m_new;
      const float alpha = first ? 0.f : fast_exp2(m[mt][half] - m_use);
      m[mt][half] = m_new;
#pragma unroll
      for (int nt = 0; nt < S_NTILES; ++nt) {
        if (FILL == FILL_ANY && nt / 2 * 16 >= valid) {
          pk[mt][nt][half] = 0u;  // USE_WGMMA: p = 0 for its k-steps past the keys (mma.sync skips them)
          continue;
        }
        const float e0 = fast_exp2(fmaf(s[mt][nt][2 * half], c, -m_use));
        const float e1 = fast_exp2(fmaf(s[mt][nt][2 * half + 1], c, -m_use));
        pk[mt][nt][half] = pack2_elem(e0, e1);  // packed at once: the fp32 scores die here, not after P V
      }
      l[mt][half] = first ? 0.f : l[mt][half] * alpha;  // P V adds this tile's sums
      if (!USE_WGMMA || !first) {  // a head's first wgmma P V overwrites o instead
#pragma unroll
        for (int nt = 0; nt < O_ACC_NTILES; ++nt) {  // o starts here on a head's first tile: not live during QK^T
          o[mt][nt][2 * half] = first ? 0.f : o[mt][nt][2 * half] * alpha;
          o[mt][nt][2 * half + 1] = first ? 0.f : o[mt][nt][2 * half + 1] * alpha;
        }
      }
    }

  if constexpr (USE_WGMMA) {  // O (+)= P V: V read N-major (transposed B), 16 keys = 2048 bytes per k-step
    // P 1: rows g and g + 8 in lc[0][0] and [2]. Started at 0 and added to l after: an accumulator that enters the
    // wgmma chain from ordinary registers made ptxas serialize every wgmma of the kernel.
    float lc[1][4];
    u32 a[PV_KSTEPS][4];
#pragma unroll
    for (int ks = 0; ks < PV_KSTEPS; ++ks) {
      a[ks][0] = pk[0][2 * ks][0];
      a[ks][1] = pk[0][2 * ks][1];
      a[ks][2] = pk[0][2 * ks + 1][0];
      a[ks][3] = pk[0][2 * ks + 1][1];
    }
    wgmma_fence();
    // the leading byte offset is the step from one 64-column block of B to the next: V's second block (d = 128),
    // or with ROWSUM_IN_PV the block of ones, which makes columns 64..71 of O the row sums of P
    const u32 v_addr = smem_addr(v_tile);
    const u64 v_desc = sw128_desc(v_addr, ROWSUM_IN_PV ? smem_addr(smem + OFF_ONES) - v_addr : KV_ROWS * 128, 1024);
#pragma unroll
    for (int ks = 0; ks < PV_KSTEPS; ++ks)  // every k-step (see load_kv_tile): past the keys, p = 0 and v = 0
      wgmma_output(o[0], a[ks], desc_advance(v_desc, ks * 16 * 128), !first || ks > 0);
    if constexpr (ROWSUM_IN_PV) {
      wgmma_commit();
      wgmma_wait<0>();
      pin_all(o[0]);
      pin_all(a);
      l[0][0] = o[0][O_NTILES][0];  // rows g and g + 8; o's last n-tile is rescaled with the rest
      l[0][1] = o[0][O_NTILES][2];
      return;
    }
    const u64 ones_desc = sw128_desc(smem_addr(smem + OFF_ONES), 16, 1024);
#pragma unroll
    for (int ks = 0; ks < PV_KSTEPS; ++ks)  // B read K-major like K in QK^T; every byte it reads is a one
      wgmma_row_sums(lc, a[ks], desc_advance(ones_desc, (ks % 4) * 32), ks > 0);
    wgmma_commit();
    wgmma_wait<0>();
    pin_all(o[0]);
    pin_all(lc);
    pin_all(a);
    l[0][0] += lc[0][0];
    l[0][1] += lc[0][2];
    return;
  }

  // O += P V, and l += P 1 (the row sums land in every column of lc; rows g and g + 8 in lc[0] and lc[2]).
  const u32 ones = pack2_elem(1.f, 1.f);
  float lc[M_TILES][4];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
    lc[mt][0] = lc[mt][1] = l[mt][0];
    lc[mt][2] = lc[mt][3] = l[mt][1];
  }
#pragma unroll
  for (int ks = 0; ks < PV_KSTEPS; ++ks) {
    if (FILL != FILL_ANY || ks * 16 < valid) {
      u32 a[M_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        a[mt][0] = pk[mt][2 * ks][0];
        a[mt][1] = pk[mt][2 * ks][1];
        a[mt][2] = pk[mt][2 * ks + 1][0];
        a[mt][3] = pk[mt][2 * ks + 1][1];
        mma_16816(lc[mt], a[mt], ones, ones);
      }
#pragma unroll
      for (int dp = 0; dp < O_NTILES / 2; ++dp) {
        u32 b[4];
        ldmatrix_x4_trans(b, KV_SWIZZLED ? smem_addr(v_tile + kv_swizzled_offset(ks * 16 + (lane & 15),
                                                                                 dp * 2 + (lane >> 4)))
                                         : v_lane + (ks * 16 * KV_ROW_ELEMS + dp * 16) * 2);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          mma_16816(o[mt][2 * dp], a[mt], b[0], b[1]);
          mma_16816(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
      if constexpr (O_NTILES % 2 == 1) {  // d = 40: the fifth n-tile of 8 columns
        u32 b0, b1;
        ldmatrix_x2_trans(b0, b1, v_lane + (ks * 16 * KV_ROW_ELEMS + (O_NTILES - 1) * 8) * 2);  // lanes 0-15
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) mma_16816(o[mt][O_NTILES - 1], a[mt], b0, b1);
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
    l[mt][0] = lc[mt][0];
    l[mt][1] = lc[mt][2];
  }
}
