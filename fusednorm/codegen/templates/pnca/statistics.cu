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

// One 16-byte chunk of rows g and g + 8 per lane (8 columns of each) into the sums: X * 1 and X * X^T, two k-steps.
FN_INLINE void add_chunk_sums(const u32x4& va, const u32x4& vb, u32 ones, float (&sum)[4], float (&sq_lo)[4],
                              float (&sq_hi)[4]) {
  const u32 a0[4] = {va.x, vb.x, va.y, vb.y}, a1[4] = {va.z, vb.z, va.w, vb.w};
  if constexpr (!NORM_IS_RMS) {
    mma_16816(sum, a0, ones, ones);
    mma_16816(sum, a1, ones, ones);
  }
  mma_16816(sq_lo, a0, a0[0], a0[2]);
  mma_16816(sq_lo, a1, a1[0], a1[2]);
  mma_16816(sq_hi, a0, a0[1], a0[3]);
  mma_16816(sq_hi, a1, a1[1], a1[3]);
}

// Rows g and g + 8 of 16: mean and 1/std from their sums and sums of squares over D columns (biased variance, or
// mean(x^2) for RMS), stored by lane t = 0 of the quad; true if either row needs the exact pass (NaN/Inf rows compare
// false and stay here: they come out non-finite either way).
FN_INLINE bool store_row_statistics(const Params& p, float sum_a, float ss_a, float sum_b, float ss_b, float* mean_s,
                                    float* rstd_s, int lane) {
  const int g = lane >> 2;
  const float inv_d = 1.f / (float)p.model_dim;
  const float mean_a = NORM_IS_RMS ? 0.f : sum_a * inv_d, mean_b = NORM_IS_RMS ? 0.f : sum_b * inv_d;
  const float var_a = fmaf(-mean_a, mean_a, ss_a * inv_d), var_b = fmaf(-mean_b, mean_b, ss_b * inv_d);
  if ((lane & 3) == 0) {
    mean_s[g] = mean_a;
    rstd_s[g] = rsqrtf(fmaxf(var_a, 0.f) + p.eps);
    mean_s[g + 8] = mean_b;
    rstd_s[g + 8] = rsqrtf(fmaxf(var_b, 0.f) + p.eps);
  }
  return !NORM_IS_RMS && (mean_a * mean_a > 16.f * var_a || mean_b * mean_b > 16.f * var_b);
}

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
        add_chunk_sums(va[j], vb[j], ones, sum, sq_lo, sq_hi);
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
    redo |= store_row_statistics(p, sum_a, ss_a, sum_b, ss_b, mean_s + mt * 16, rstd_s + mt * 16, lane);
  }
  __syncwarp();
  if (__any_sync(FULL_WARP, redo)) row_statistics_exact(p, x_batch, row0, mean_s, rstd_s, lane);
}

// Statistics in column groups (p.stat_col_groups > 1). Where a block of rows has its heads split between several
// items, all in one wave (T5's decoder: 8 CTAs per 128 rows), each of those CTAs would sum every row whole: 8 times
// the round trips of its share. Instead each row's (sum, sum of squares) is summed per group of columns,
// [gr * cols, ...), and the groups' sums are added in group order, so the result is the same whoever sums a group.
// With p.share_stats each item sums its own group with all its warps (1/groups of the round trips), publishes it in
// p.part and arrives at its row block's counter; once all groups have arrived, every warp loads all their sums at
// once (one round trip). If they do not all arrive within STATS_WAIT_NS (a partner CTA not yet resident: another
// kernel holds the SMs), the item sums the other groups itself, so the wait never deadlocks. Without p.share_stats
// (sm_count left too few CTAs for one wave) a CTA sums every group itself: the same bits. Compiled in where
// GROUPED_STATS (KernelSpec.grouped_stats: warps of one m-tile of their own rows, no plan stage, not one tile).
constexpr unsigned long long STATS_WAIT_NS = 20000;
constexpr int GROUP_LOADS = 4;  // 16-byte loads per row and lane in flight (T5's group, 128 columns: one round trip)

// Rows row0 + g and + 8 (this lane's quad): {sum, sum of squares} of each over columns [c_begin, c_end), as the fast
// pass above sums them.
FN_INLINE void column_group_sums(const Params& p, const u16* x_batch, int row0, int c_begin, int c_end,
                                 float (&out)[4], int lane) {
  const int D = p.model_dim, g = lane >> 2, t = lane & 3;
  const u32 ones = pack2_elem(1.f, 1.f);
  const int qa = row0 + g, qb = qa + 8;
  const bool live_a = qa < p.q_len, live_b = qb < p.q_len;
  const long long off_a = (long long)qa * D + t * 8, off_b = off_a + 8LL * D;  // dereferenced only for live rows
  float sum[4] = {0.f, 0.f, 0.f, 0.f}, sq_lo[4] = {0.f, 0.f, 0.f, 0.f}, sq_hi[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
  for (int c0 = c_begin; c0 < c_end; c0 += GROUP_LOADS * 32) {
    u32x4 va[GROUP_LOADS], vb[GROUP_LOADS];
#pragma unroll
    for (int j = 0; j < GROUP_LOADS; ++j) {  // all loads first, as in the fast pass
      const int c = c0 + j * 32;
      const bool in = c + t * 8 < c_end;
      va[j] = live_a && in ? ld_global16(x_batch + off_a + c) : u32x4{0u, 0u, 0u, 0u};
      vb[j] = live_b && in ? ld_global16(x_batch + off_b + c) : u32x4{0u, 0u, 0u, 0u};
    }
#pragma unroll
    for (int j = 0; j < GROUP_LOADS; ++j) {
      if (c0 + j * 32 >= c_end) break;  // warp-uniform
      add_chunk_sums(va[j], vb[j], ones, sum, sq_lo, sq_hi);
    }
  }
  const int holder = (lane & ~3) | (g >> 1);  // as in the fast pass: every lane of the quad gets its rows' sums
  out[0] = sum[0];
  out[1] = __shfl_sync(FULL_WARP, (g & 1) ? sq_lo[1] : sq_lo[0], holder);
  out[2] = sum[2];
  out[3] = __shfl_sync(FULL_WARP, (g & 1) ? sq_hi[3] : sq_hi[2], holder);
}

// One thread per CTA: arrive at the row block's counter (words[0]) and wait, at most STATS_WAIT_NS, until all
// `parties` have. True when they did; this CTA's sums must be visible device-wide before (its barrier gathered them).
FN_INLINE bool arrive_and_wait(int* words, int parties) {
  __threadfence();
  if (atomicAdd(words, 1) == parties - 1) {
    __threadfence();  // the last to arrive: every other group's sums are visible from here
    return true;
  }
  const unsigned long long deadline = global_ns() + STATS_WAIT_NS;
  while (ld_acquire_gpu(words) < parties) {
    if (global_ns() > deadline) return false;
    __nanosleep(32);
  }
  return true;
}

// The other counter (words[1]), once the CTA has read what it needs: the last to leave zeroes both for the next
// launch (all parties arrived before any left, so nobody reads them again in this one).
FN_INLINE void leave(int* words, int parties) {
  if (atomicAdd(words + 1, 1) == parties - 1) {
    words[0] = 0;
    words[1] = 0;
  }
}

// Called by every warp of the CTA at an item's start (it holds a CTA barrier when sharing). ``group``: the item's
// head group, which with p.share_stats is also its column group.
FN_INLINE void grouped_row_statistics(const Params& p, int b, int row_block, int group, bool warp_rows, int row0,
                                      float* mean_s, float* rstd_s, int lane) {
  const int D = p.model_dim, G = p.stat_col_groups, g = lane >> 2;
  const int cols = ((D + G - 1) / G + 31) / 32 * 32;
  const long long batch_off = (long long)b * p.q_len * D;
  const bool live_a = row0 + g < p.q_len, live_b = row0 + g + 8 < p.q_len;
  const float2* parts = reinterpret_cast<const float2*>(p.part) + (long long)b * p.q_len + row0 + g;  // group 0's
  const long long group_stride = (long long)p.batch * p.q_len;
  int* words = p.tickets + ((long long)b * p.row_blocks + row_block) * 2;
  if (p.share_stats && warp_rows) {  // this item's group, published for the others
    float own[4];
    const int c_begin = min(D, group * cols);
    column_group_sums(p, p.x + batch_off, row0, c_begin, min(D, c_begin + cols), own, lane);
    if ((lane & 3) == 0) {
      float2* mine = reinterpret_cast<float2*>(p.part) + group * group_stride + (long long)b * p.q_len + row0 + g;
      if (live_a) mine[0] = make_float2(own[0], own[1]);
      if (live_b) mine[8] = make_float2(own[2], own[3]);
    }
  }
  bool shared = false;
  if (p.share_stats) {  // every item of the launch arrives once, so the counters come back to zero
    __syncthreads();
    shared = __syncthreads_or(threadIdx.x == 0 && arrive_and_wait(words, G));  // one answer for every warp
  }
  float sum_a = 0.f, ss_a = 0.f, sum_b = 0.f, ss_b = 0.f;  // the groups' sums added in group order, either way
  if (warp_rows && shared) {  // lane t of a quad loads groups t and t + 4 of its rows, all at once, and the quad's
                              // lanes pass them round in group order: one round trip for 8 groups, in 8 registers
    const int t = lane & 3;
#pragma unroll 1
    for (int g0 = 0; g0 < G; g0 += 8) {
      float2 sa[2], sb[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int gr = g0 + h * 4 + t;
        sa[h] = live_a && gr < G ? __ldcg(parts + gr * group_stride) : make_float2(0.f, 0.f);
        sb[h] = live_b && gr < G ? __ldcg(parts + gr * group_stride + 8) : make_float2(0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < 8 && g0 + j < G; ++j) {
        const int from = (lane & ~3) | (j & 3);
        sum_a += __shfl_sync(FULL_WARP, sa[j / 4].x, from);
        ss_a += __shfl_sync(FULL_WARP, sa[j / 4].y, from);
        sum_b += __shfl_sync(FULL_WARP, sb[j / 4].x, from);
        ss_b += __shfl_sync(FULL_WARP, sb[j / 4].y, from);
      }
    }
  } else if (warp_rows) {  // not shared, or a partner late: every group summed here, by the same code
#pragma unroll 1
    for (int gr = 0; gr < G; ++gr) {
      float s[4];
      if (p.share_stats && gr == group) {  // this item's own, as it published them
        const float2 pa = live_a ? __ldcg(parts + gr * group_stride) : make_float2(0.f, 0.f);
        const float2 pb = live_b ? __ldcg(parts + gr * group_stride + 8) : make_float2(0.f, 0.f);
        s[0] = pa.x; s[1] = pa.y; s[2] = pb.x; s[3] = pb.y;
      } else {
        const int c_begin = min(D, gr * cols);
        column_group_sums(p, p.x + batch_off, row0, c_begin, min(D, c_begin + cols), s, lane);
      }
      if ((lane & 3) == 0) {  // the running sums wait in shared memory: registers are short in this loop
        mean_s[g] = (gr == 0 ? 0.f : mean_s[g]) + s[0];
        rstd_s[g] = (gr == 0 ? 0.f : rstd_s[g]) + s[1];
        mean_s[g + 8] = (gr == 0 ? 0.f : mean_s[g + 8]) + s[2];
        rstd_s[g + 8] = (gr == 0 ? 0.f : rstd_s[g + 8]) + s[3];
      }
    }
    __syncwarp();
    sum_a = mean_s[g]; ss_a = rstd_s[g]; sum_b = mean_s[g + 8]; ss_b = rstd_s[g + 8];
    __syncwarp();  // read by every lane before the statistics overwrite them
  }
  if (p.share_stats && threadIdx.x == 0) leave(words, G);  // (warp 0 has its sums: nothing else waits on this)
  if (!warp_rows) return;
  const bool redo = store_row_statistics(p, sum_a, ss_a, sum_b, ss_b, mean_s, rstd_s, lane);  // as the fast pass
  __syncwarp();
  if (__any_sync(FULL_WARP, redo)) row_statistics_exact(p, p.x + batch_off, row0, mean_s, rstd_s, lane);
}
