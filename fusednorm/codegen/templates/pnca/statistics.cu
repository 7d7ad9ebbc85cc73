// Step 1 of the pnca kernel: row statistics (one warp, its own rows).

// The exact pass: fp32 Welford per lane, merged over the warp (Chan et al.), so |mean| >> std does not cancel.
// Only rows the fast pass below cannot trust take it.
constexpr int STAT_ROWS = 4;    // rows whose loads are in flight together,
constexpr int STAT_CHUNKS = 2;  // with this many 16-byte chunks of each per lane (more would spill)
static_assert(ROWS_PER_WARP % STAT_ROWS == 0, "statistics rows");

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

FN_INLINE void row_statistics_exact(const Params& p, const u16* x_batch, int row0, float* mean_s, float* rstd_s,
                                    int lane) {
  const int D = p.model_dim;
#pragma unroll 1
  for (int r0 = 0; r0 < ROWS_PER_WARP; r0 += STAT_ROWS) {
    float n[STAT_ROWS], mu[STAT_ROWS], m2[STAT_ROWS];
#pragma unroll
    for (int j = 0; j < STAT_ROWS; ++j) { n[j] = 0.f; mu[j] = 0.f; m2[j] = 0.f; }
#pragma unroll 1
    for (int c0 = lane * 8; c0 < D; c0 += STAT_CHUNKS * 256) {
      u32x4 v[STAT_CHUNKS][STAT_ROWS];
#pragma unroll
      for (int u = 0; u < STAT_CHUNKS; ++u)
#pragma unroll
        for (int j = 0; j < STAT_ROWS; ++j) {  // all loads first: the DRAM latency is paid once per pass
          const int q = row0 + r0 + j, c = c0 + u * 256;
          v[u][j] = q < p.q_len && c < D ? ld_global16(x_batch + (long long)q * D + c) : u32x4{0u, 0u, 0u, 0u};
        }
#pragma unroll
      for (int u = 0; u < STAT_CHUNKS; ++u)
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

// The fast pass, on the tensor cores: for 16 rows X (k running over the model dim), X * 1 holds the row sums and
// X * X^T the rows' sums of squares on its diagonal. bf16/fp16 products are exact in fp32, so this is the fp32 sum
// of exact squares, at 3 mma per 16 columns instead of ~4 instructions per element. A sum does not care about the
// order of its columns, so each lane loads whole 16-byte chunks of rows g and g + 8 and uses them as the A fragments
// of two k-steps; the B fragments of X^T are the same registers (b = a[0], a[2] for rows 0-7; a[1], a[3] for 8-15).
// var = E[x^2] - mean^2 loses digits when mean^2 >> var (and the tensor cores' fp32 sums truncate): a warp with any
// row where mean^2 > 16 var (or a variance below zero) redoes its rows with the exact pass, so only rows whose
// variance keeps ~4 digits here (|mean| <= 4 std, the usual case by far) are decided by the fast sums.
// Loads in flight per lane: 2 rows x STAT_GROUPS chunks (at 128 registers, more would spill). With KEY_SPLIT the
// warps share their 16 rows, so each sums every WARPS-th group of 32 columns and the partial sums meet in shared
// memory (sums, unlike Welford states, simply add): a decode item's statistics then cost 1/WARPS of the round trips.
constexpr int STAT_GROUPS = MIN_CTAS_PER_SM > 1 ? 4 : 8;
constexpr int STAT_WARPS = KEY_SPLIT > 1 ? WARPS : 1;

FN_INLINE void row_statistics(const Params& p, const u16* x_batch, u16* copy_batch, int row0, float* mean_s,
                              float* rstd_s, float* partial_s, int warp, int lane) {
  const int D = p.model_dim, g = lane >> 2, t = lane & 3;
  const u32 ones = pack2_elem(1.f, 1.f);
  bool redo = false;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
    const int qa = row0 + mt * 16 + g, qb = qa + 8;
    const bool live_a = qa < p.q_len, live_b = qb < p.q_len;
    const u16* xa = x_batch + (long long)qa * D + t * 8;  // dereferenced only for live rows
    const u16* xb = xa + 8LL * D;
    float sum[4] = {0.f, 0.f, 0.f, 0.f}, sq_lo[4] = {0.f, 0.f, 0.f, 0.f}, sq_hi[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
    for (int c0 = (STAT_WARPS > 1 ? warp : 0) * 32; c0 < D; c0 += STAT_GROUPS * STAT_WARPS * 32) {
      u32x4 va[STAT_GROUPS], vb[STAT_GROUPS];
#pragma unroll
      for (int j = 0; j < STAT_GROUPS; ++j) {  // all loads first: the DRAM latency is paid once per round trip
        const int c = c0 + j * STAT_WARPS * 32;
        const bool in = c + t * 8 < D;  // D is a multiple of 8: a chunk is wholly in or out
        va[j] = live_a && in ? ld_global16(xa + c) : u32x4{0u, 0u, 0u, 0u};
        vb[j] = live_b && in ? ld_global16(xb + c) : u32x4{0u, 0u, 0u, 0u};
      }
      if (WRITE_O && copy_batch != nullptr) {  // the plan's residual, for the out GEMM (see Params::x_copy)
        u16* ca = copy_batch + (long long)qa * D + t * 8;
#pragma unroll
        for (int j = 0; j < STAT_GROUPS; ++j) {
          const int c = c0 + j * STAT_WARPS * 32;
          if (c + t * 8 >= D) break;
          if (live_a) st_global16(ca + c, va[j]);
          if (live_b) st_global16(ca + 8LL * D + c, vb[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < STAT_GROUPS; ++j) {
        if (c0 + j * STAT_WARPS * 32 >= D) break;  // warp-uniform
        const u32 a0[4] = {va[j].x, vb[j].x, va[j].y, vb[j].y}, a1[4] = {va[j].z, vb[j].z, va[j].w, vb[j].w};
        if constexpr (!NORM_IS_RMS) {
          mma_16816(sum, a0, ones, ones);
          mma_16816(sum, a1, ones, ones);
        }
        mma_16816(sq_lo, a0, a0[0], a0[2]);
        mma_16816(sq_lo, a1, a1[0], a1[2]);
        mma_16816(sq_hi, a0, a0[1], a0[3]);
        mma_16816(sq_hi, a1, a1[1], a1[3]);
      }
    }
    // Row g's square sum is column g of sq_lo, row g + 8's column g of sq_hi: held by lane t = g / 2 of the quad.
    const int holder = (lane & ~3) | (g >> 1);
    float ss_a = __shfl_sync(FULL_WARP, (g & 1) ? sq_lo[1] : sq_lo[0], holder);
    float ss_b = __shfl_sync(FULL_WARP, (g & 1) ? sq_hi[3] : sq_hi[2], holder);
    float sum_a = sum[0], sum_b = sum[2];
    if constexpr (STAT_WARPS > 1) {  // every warp adds the partials in warp order: the same sums in each
      if (t == 0) {
        reinterpret_cast<float2*>(partial_s)[warp * 16 + g] = make_float2(sum_a, ss_a);
        reinterpret_cast<float2*>(partial_s)[warp * 16 + g + 8] = make_float2(sum_b, ss_b);
      }
      __syncthreads();  // key split: all warps hold the same rows and come here together
      sum_a = ss_a = sum_b = ss_b = 0.f;
#pragma unroll
      for (int w = 0; w < STAT_WARPS; ++w) {
        const float2 pa = reinterpret_cast<const float2*>(partial_s)[w * 16 + g];
        const float2 pb = reinterpret_cast<const float2*>(partial_s)[w * 16 + g + 8];
        sum_a += pa.x; ss_a += pa.y; sum_b += pb.x; ss_b += pb.y;
      }
    }
    const float inv_d = 1.f / (float)D;
    const float mean_a = NORM_IS_RMS ? 0.f : sum_a * inv_d, mean_b = NORM_IS_RMS ? 0.f : sum_b * inv_d;
    const float var_a = fmaf(-mean_a, mean_a, ss_a * inv_d), var_b = fmaf(-mean_b, mean_b, ss_b * inv_d);
    if constexpr (!NORM_IS_RMS)  // NaN/Inf rows compare false and stay here: they come out non-finite either way
      redo |= mean_a * mean_a > 16.f * var_a || mean_b * mean_b > 16.f * var_b;
    if (t == 0) {  // biased variance, or mean(x^2) for RMS
      mean_s[mt * 16 + g] = mean_a;
      rstd_s[mt * 16 + g] = rsqrtf(fmaxf(var_a, 0.f) + p.eps);
      mean_s[mt * 16 + g + 8] = mean_b;
      rstd_s[mt * 16 + g + 8] = rsqrtf(fmaxf(var_b, 0.f) + p.eps);
    }
  }
  __syncwarp();
  if (__any_sync(FULL_WARP, redo)) row_statistics_exact(p, x_batch, row0, mean_s, rstd_s, lane);
}
