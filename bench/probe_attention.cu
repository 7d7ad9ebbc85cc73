// Attention main-loop probe (bench/probe_attention.py): O = softmax(Q K^T * scale) V for Q, K, V of
// [B, H, L, 64] bf16 (contiguous), in FlashAttention-3's warp-specialised structure, to measure what that structure
// gives on fusednorm's long-key shapes before it is built into the generated kernel (FUSED: with fusednorm's norm
// and residual around it).
//
// A CTA is CONSUMERS + 1 warpgroups and owns 64 * CONSUMERS query rows of one item at a time (persistent: items
// strided by the grid). Warpgroup 0 is the producer: one thread fills a ring of STAGES K/V stages (and the Q
// tile) by bulk tensor copies, each stage guarded by a "full" barrier (the copies' bytes) and an "empty" one (every
// consumer warp's arrival); it gives up registers (setmaxnreg.dec) so that the consumer warpgroups, 64 rows each, can
// take them (ptxas allocates each side to its setmaxnreg count).
// An item is G consecutive heads of one row block (G = 1 for plain attention); the Q tile of each head comes through
// a ring of two Q slots, so that the next head's arrives during this one's keys.
// FUSED 1: fusednorm's whole block instead: y = x + attention(norm(x) split into heads, k, v) with LayerNorm (gamma,
// beta): the Q slot receives the head's slice of x, the consumers sum their rows' statistics at each item's start
// (straight from global memory, one pass of sum and sum of squares: a probe's shortcut), normalise the slice in
// registers into Q's fragments, and add the slice to O / l in the epilogue before releasing the slot. With
// STATS_AHEAD the producer warpgroup's three idle warps sum them instead, an item ahead, into a ring of two slots.
// Compiled after templates/prelude.cu and the wgmma helpers probe_attention.py writes, with first:
//   OVERLAP   0: each key tile in turn, S = Q K^T, softmax, O += P V, each wgmma waited for (fusednorm's order);
//             1: tile t's S = Q K^T is issued together with tile t-1's O += P V, and the softmax of tile t runs
//                while that P V is on the tensor cores (FlashAttention-3's intra-warpgroup overlap)
//   PINGPONG  1: the consumer warpgroups take turns to issue their wgmma (named barriers), so that one's softmax
//             runs while another's matrix products do
//   CONSUMERS (2 or 3), STAGES, BLOCK_N (keys per stage), PRODUCER_REGS and CONSUMER_REGS (setmaxnreg:
//   128 x P + 128 x CONSUMERS x C <= 64 K)

constexpr int D = 64, BLOCK_M = 64 * CONSUMERS, THREADS = 128 * (CONSUMERS + 1);
constexpr int TILE_BYTES = BLOCK_N * 128;  // BLOCK_N rows of 64 elements: one of K or V in a stage
constexpr int Q_BYTES = BLOCK_M * 128;
constexpr int Q_SLOTS = 2;
constexpr int OFF_Q = 0, OFF_K = Q_SLOTS * Q_BYTES, OFF_V = OFF_K + STAGES * TILE_BYTES;
constexpr int OFF_ONES = OFF_V + STAGES * TILE_BYTES;  // the ones: the row sums' 8 extra columns of O (wgmma_output)
// FUSED: rows' mean and 1 / std, per consumer warp (16 rows each) or, with STATS_AHEAD, per item in two slots
constexpr int OFF_STATS = OFF_ONES + TILE_BYTES, STATS_SLOTS = 2, STATS_WARPS = 3;
constexpr int OFF_BARS = OFF_STATS + STATS_SLOTS * BLOCK_M * 2 * 4;
constexpr int SMEM_BYTES = OFF_BARS + 8 * (2 * STAGES + 2 * Q_SLOTS + 2 * STATS_SLOTS);  // = probe_attention.py's
static_assert(SMEM_BYTES <= 227 * 1024, "one CTA per SM");
constexpr int CONSUMER_WARPS = 4 * CONSUMERS;
constexpr int S_NT = BLOCK_N / 8, PV_KSTEPS = BLOCK_N / 16, O_NT = D / 8 + 1;
extern __shared__ __align__(1024) u8 smem[];

struct Maps { TensorMap q, k, v; };  // FUSED: q maps x ([B, Lq, H * 64], 3 dims)
struct Args {
  u16* o;                         // plain: O of [B, H, Lq, 64]; FUSED: y of [B, Lq, H * 64]
  const u16 *x, *gamma, *beta;    // FUSED
  int heads, q_len, kv_len, row_blocks, items, heads_per_item;
  float scale_log2, eps;
};

// (setmaxnreg_inc / _dec and mbar_arrive: the generator's prelude.cu, which probe_attention.py puts first)
FN_INLINE void named_bar_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
FN_INLINE void named_bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }

struct Item { int b, h0, rb; };  // h0: the item's first head
FN_INLINE Item item_at(const Args& a, int item) {  // row blocks innermost: neighbouring CTAs share K/V in L2
  const int groups = a.heads / a.heads_per_item;
  Item it;
  it.rb = item % a.row_blocks;
  it.h0 = (item / a.row_blocks) % groups * a.heads_per_item;
  it.b = item / (a.row_blocks * groups);
  return it;
}

// A ring position: slot index and the parity of its barriers' phase.
template <int N>
struct Ring {
  int stage = 0;
  u32 phase = 0;
  FN_INLINE void next() {
    if (++stage == N) { stage = 0; phase ^= 1u; }
  }
};

// Barriers: full / empty per K/V stage, per Q slot and per statistics slot (8 bytes each).
struct Bars {
  u32 base;
  FN_INLINE u32 full(int s) const { return base + 8 * s; }
  FN_INLINE u32 empty(int s) const { return base + 8 * (STAGES + s); }
  FN_INLINE u32 q_full(int s) const { return base + 8 * (2 * STAGES + s); }
  FN_INLINE u32 q_empty(int s) const { return base + 8 * (2 * STAGES + Q_SLOTS + s); }
  FN_INLINE u32 s_full(int s) const { return base + 8 * (2 * STAGES + 2 * Q_SLOTS + s); }
  FN_INLINE u32 s_empty(int s) const { return base + 8 * (2 * STAGES + 2 * Q_SLOTS + STATS_SLOTS + s); }
};

FN_INLINE void produce(const Args& a, const Maps& maps, Bars bars) {
  const int tiles = (a.kv_len + BLOCK_N - 1) / BLOCK_N;
  Ring<STAGES> ring;
  Ring<Q_SLOTS> qs;
  for (int item = blockIdx.x; item < a.items; item += gridDim.x) {
    const Item it = item_at(a, item);
    for (int h = it.h0; h < it.h0 + a.heads_per_item; ++h, qs.next()) {
      mbar_wait(bars.q_empty(qs.stage), qs.phase ^ 1u);  // the slot's last head is done with it (new: passes)
      mbar_arrive_expect_tx(bars.q_full(qs.stage), Q_BYTES);
      const u32 q_dst = smem_addr(smem + OFF_Q + qs.stage * Q_BYTES);
      if (FUSED)
        tma_load_3d(q_dst, &maps.q, h * D, it.rb * BLOCK_M, it.b, bars.q_full(qs.stage));
      else
        tma_load_4d(q_dst, &maps.q, 0, it.rb * BLOCK_M, h, it.b, bars.q_full(qs.stage));
      for (int t = 0; t < tiles; ++t, ring.next()) {
        const u32 f = bars.full(ring.stage);
        mbar_wait(bars.empty(ring.stage), ring.phase ^ 1u);
        mbar_arrive_expect_tx(f, 2 * TILE_BYTES);
        tma_load_4d(smem_addr(smem + OFF_K + ring.stage * TILE_BYTES), &maps.k, 0, t * BLOCK_N, h, it.b, f);
        tma_load_4d(smem_addr(smem + OFF_V + ring.stage * TILE_BYTES), &maps.v, 0, t * BLOCK_N, h, it.b, f);
      }
    }
  }
}

// FUSED: one 16-byte chunk of a row of x (8 elements) added to the row's sum and sum of squares.
FN_INLINE void add_chunk(const u16* chunk, float& sum, float& sq) {
  const u32x4 v = ld_global16(chunk);
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = lo_to_f32(w[i]), hi = hi_to_f32(w[i]);
    sum += lo + hi;
    sq = fmaf(lo, lo, fmaf(hi, hi, sq));
  }
}

// A row's mean and 1 / std from its sums, into its two statistics slots.
FN_INLINE void store_statistics(float* slot, float sum, float sq, int model_dim, float eps) {
  const float mean = sum / model_dim, var = fmaxf(sq / model_dim - mean * mean, 0.f);
  slot[0] = mean;
  slot[1] = rsqrtf(var + eps);
}

// FUSED: mean and 1 / std of this warp's 16 rows (rows past Lq: 0 and 1 / sqrt(eps)), into its stats slots. Lane l
// sums half l / 16 of row l % 16, eight 16-byte loads in flight at a time; one shuffle adds the halves.
FN_INLINE void row_statistics(const Args& a, int b, int row0, float* stats, int lane) {
  const int model_dim = a.heads * D, half_chunks = model_dim / 16, r = lane & 15;
  float sum = 0.f, sq = 0.f;
  if (row0 + r < a.q_len) {
    const u16* row = a.x + ((long long)b * a.q_len + row0 + r) * model_dim + (lane >> 4) * (model_dim / 2);
#pragma unroll 8
    for (int ch = 0; ch < half_chunks; ++ch) add_chunk(row + ch * 8, sum, sq);
  }
  sum += __shfl_xor_sync(FULL_WARP, sum, 16);
  sq += __shfl_xor_sync(FULL_WARP, sq, 16);
  if (lane < 16) store_statistics(stats + 2 * r, sum, sq, model_dim, a.eps);
  __syncwarp();
}

// STATS_AHEAD: the producer warpgroup's warp sw (of STATS_WARPS) sums rows sw, sw + 3, ... of each of the CTA's
// items into the next statistics slot while the consumers attend to the item before; two of a row's 16-byte loads
// per lane in flight (more spill in the 40 registers the warpgroup keeps).
FN_INLINE void statistics_ahead(const Args& a, Bars bars, int sw, int lane) {
  const int model_dim = a.heads * D, chunks = model_dim / 8;
  Ring<STATS_SLOTS> ss;
  for (int item = blockIdx.x; item < a.items; item += gridDim.x, ss.next()) {
    const Item it = item_at(a, item);
    float* out = reinterpret_cast<float*>(smem + OFF_STATS) + ss.stage * BLOCK_M * 2;
    mbar_wait(bars.s_empty(ss.stage), ss.phase ^ 1u);  // the consumers have read the slot's last item
    for (int r = sw; r < BLOCK_M; r += STATS_WARPS) {
      const int row = it.rb * BLOCK_M + r;
      float sum = 0.f, sq = 0.f;
      if (row < a.q_len) {
        const u16* src = a.x + ((long long)it.b * a.q_len + row) * model_dim;
#pragma unroll 2
        for (int ch = lane; ch < chunks; ch += 32) add_chunk(src + ch * 8, sum, sq);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        sum += __shfl_xor_sync(FULL_WARP, sum, off);
        sq += __shfl_xor_sync(FULL_WARP, sq, off);
      }
      if (lane == 0) store_statistics(out + 2 * r, sum, sq, model_dim, a.eps);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(bars.s_full(ss.stage));  // releases the slot's writes to the consumers' wait
  }
}

// Scores of one key tile, in place: max, rescale factor, exponentials (fp32, not yet packed). Keys past Lk (zeros
// from the copy) become -inf first.
FN_INLINE void softmax_tile(float (&s)[S_NT][4], float (&m)[2], float (&alpha)[2], bool first, int valid, float c,
                            int lane) {
  const int t2 = (lane & 3) * 2;
  if (valid < BLOCK_N) {
#pragma unroll
    for (int nt = 0; nt < S_NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (nt * 8 + t2 + (e & 1) >= valid) s[nt][e] = neg_inf();
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = neg_inf();
#pragma unroll
    for (int nt = 0; nt < S_NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * half], s[nt][2 * half + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 2)) * c;
    const float m_new = first ? mx : fmaxf(m[half], mx);
    alpha[half] = first ? 0.f : fast_exp2(m[half] - m_new);
    m[half] = m_new;
#pragma unroll
    for (int nt = 0; nt < S_NT; ++nt) {
      s[nt][2 * half] = fast_exp2(fmaf(s[nt][2 * half], c, -m_new));
      s[nt][2 * half + 1] = fast_exp2(fmaf(s[nt][2 * half + 1], c, -m_new));
    }
  }
}

// P as the A operand of O += P V: k-step ks holds keys 16 ks .. 16 ks + 15.
FN_INLINE void pack_p(const float (&s)[S_NT][4], u32 (&p)[PV_KSTEPS][4]) {
#pragma unroll
  for (int ks = 0; ks < PV_KSTEPS; ++ks) {
    p[ks][0] = pack2_elem(s[2 * ks][0], s[2 * ks][1]);
    p[ks][1] = pack2_elem(s[2 * ks][2], s[2 * ks][3]);
    p[ks][2] = pack2_elem(s[2 * ks + 1][0], s[2 * ks + 1][1]);
    p[ks][3] = pack2_elem(s[2 * ks + 1][2], s[2 * ks + 1][3]);
  }
}

FN_INLINE void issue_scores(float (&s)[S_NT][4], const u32 (&q)[4][4], int stage) {
  const u64 k_desc = sw128_desc(smem_addr(smem + OFF_K + stage * TILE_BYTES), 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_scores(s, q[kk], desc_advance(k_desc, kk * 32), kk > 0);
  wgmma_commit();
}

// O (+)= P V with 8 more columns read from the block of ones: o[D / 8] holds the row sums, rescaled with O.
FN_INLINE void issue_output(float (&o)[O_NT][4], const u32 (&p)[PV_KSTEPS][4], int stage, bool accumulate) {
  const u32 v_addr = smem_addr(smem + OFF_V + stage * TILE_BYTES);
  const u64 v_desc = sw128_desc(v_addr, smem_addr(smem + OFF_ONES) - v_addr, 1024);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < PV_KSTEPS; ++ks) wgmma_output(o, p[ks], desc_advance(v_desc, ks * 16 * 128), accumulate || ks);
  wgmma_commit();
}

FN_INLINE void consume(const Args& a, Bars bars, int cw, int warp_in_wg, int lane) {
  const int tiles = (a.kv_len + BLOCK_N - 1) / BLOCK_N, g = lane >> 2, t2 = (lane & 3) * 2;
  const float c = a.scale_log2;
  float* stats = reinterpret_cast<float*>(smem + OFF_STATS) + (cw * 4 + warp_in_wg) * 32;
  Ring<STAGES> ring;
  Ring<Q_SLOTS> qs;
  Ring<STATS_SLOTS> ss;
  // PINGPONG: consumer cw issues after barrier 1 + cw, then lets the next one issue; the last starts the round
  const int my_turn = 1 + cw, next_turn = 1 + (cw + 1) % CONSUMERS;
  if (PINGPONG && cw == CONSUMERS - 1) named_bar_arrive(1);
  for (int item = blockIdx.x; item < a.items; item += gridDim.x) {
    const Item it = item_at(a, item);
    const int row = it.rb * BLOCK_M + cw * 64 + warp_in_wg * 16 + g;  // this thread's rows: row and row + 8
    float mean[2] = {0.f, 0.f}, rstd[2] = {1.f, 1.f};
    if (FUSED && STATS_AHEAD) {  // this thread's rows in the item's slot, then the slot back to the summing warps
      const float* slot_stats = reinterpret_cast<const float*>(smem + OFF_STATS) + ss.stage * BLOCK_M * 2;
      mbar_wait(bars.s_full(ss.stage), ss.phase);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = row - it.rb * BLOCK_M + 8 * i;
        mean[i] = slot_stats[2 * r];
        rstd[i] = slot_stats[2 * r + 1];
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(bars.s_empty(ss.stage));
      ss.next();
    } else if (FUSED) {
      row_statistics(a, it.b, row - g, stats, lane);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mean[i] = stats[2 * (g + 8 * i)];
        rstd[i] = stats[2 * (g + 8 * i) + 1];
      }
    }
    for (int h = it.h0; h < it.h0 + a.heads_per_item; ++h, qs.next()) {
      u32 q[4][4];  // this warp's 16 rows of Q as the A fragments of the 4 k-steps (128-byte swizzled rows)
      const u8* slot = smem + OFF_Q + qs.stage * Q_BYTES;
      mbar_wait(bars.q_full(qs.stage), qs.phase);
      const int qrow = cw * 64 + warp_in_wg * 16 + (lane & 15);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        ldmatrix_x4(q[kk], smem_addr(slot + qrow * 128 + (((2 * kk + (lane >> 4)) ^ (qrow & 7)) * 16)));
        if (FUSED) {  // register e: row g + 8 (e & 1), columns 16 kk + t2 + 8 (e >> 1) + {0, 1}
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = h * D + 16 * kk + t2 + 8 * (e >> 1), i = e & 1;
            const u32 gm = *reinterpret_cast<const u32*>(a.gamma + col);
            const u32 bt = *reinterpret_cast<const u32*>(a.beta + col);
            const float lo = fmaf((lo_to_f32(q[kk][e]) - mean[i]) * rstd[i], lo_to_f32(gm), lo_to_f32(bt));
            const float hi = fmaf((hi_to_f32(q[kk][e]) - mean[i]) * rstd[i], hi_to_f32(gm), hi_to_f32(bt));
            q[kk][e] = pack2_elem(lo, hi);
          }
        }
      }
      if (!FUSED) {  // Q is in registers: the slot may take the next head's
        __syncwarp();
        if (lane == 0) mbar_arrive(bars.q_empty(qs.stage));
      }

      float s[S_NT][4], o[O_NT][4], m[2], alpha[2];
      u32 p[PV_KSTEPS][4];
      // O (+)= P V of the tile in `stage` on its own, waited for, then the stage released
      auto output_now = [&](int stage, bool accumulate) {
        if (PINGPONG) named_bar_sync(my_turn);
        issue_output(o, p, stage, accumulate);
        if (PINGPONG) named_bar_arrive(next_turn);
        wgmma_wait<0>();
        pin_all(o);
        pin_all(p);
        if (lane == 0) mbar_arrive(bars.empty(stage));
      };
      // The first tile, peeled: no P V of an earlier tile to overlap, and ptxas sees every wgmma group's waits on
      // straight paths (a branch between an issue and its wait makes it serialize or insert waits)
      mbar_wait(bars.full(ring.stage), ring.phase);
      if (PINGPONG) named_bar_sync(my_turn);
      issue_scores(s, q, ring.stage);
      if (PINGPONG) named_bar_arrive(next_turn);
      wgmma_wait<0>();
      pin_all(s);
      softmax_tile(s, m, alpha, true, min(BLOCK_N, a.kv_len), c, lane);
      pack_p(s, p);
      if (!OVERLAP) output_now(ring.stage, false);
      Ring<STAGES> prev = ring;  // with OVERLAP, the stage whose P V is still to be issued
      ring.next();
      for (int t = 1; t < tiles; ++t) {
        const int valid = min(BLOCK_N, a.kv_len - t * BLOCK_N);
        mbar_wait(bars.full(ring.stage), ring.phase);
        if (PINGPONG) named_bar_sync(my_turn);
        issue_scores(s, q, ring.stage);
        if constexpr (OVERLAP) {  // tile t - 1's P V behind tile t's scores, then tile t's softmax behind that P V
          if (t > 1) rescale(o, alpha);
          issue_output(o, p, prev.stage, t > 1);
          if (PINGPONG) named_bar_arrive(next_turn);
          wgmma_wait<1>();
          pin_all(s);
          softmax_tile(s, m, alpha, false, valid, c, lane);
          wgmma_wait<0>();
          pin_all(o);
          pin_all(p);
          if (lane == 0) mbar_arrive(bars.empty(prev.stage));
          pack_p(s, p);
        } else {
          if (PINGPONG) named_bar_arrive(next_turn);
          wgmma_wait<0>();
          pin_all(s);
          softmax_tile(s, m, alpha, false, valid, c, lane);
          pack_p(s, p);
          rescale(o, alpha);
          output_now(ring.stage, true);
        }
        prev = ring;
        ring.next();
      }
      if constexpr (OVERLAP) {  // the last tile's P V
        if (tiles > 1) rescale(o, alpha);
        output_now(prev.stage, tiles > 1);
      }

      // O / l (FUSED: plus the slice of x), rows row and row + 8
      const float inv[2] = {1.f / o[D / 8][0], 1.f / o[D / 8][2]};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = row + 8 * i, local = r - it.rb * BLOCK_M;
        u16* out = FUSED ? a.o + ((long long)it.b * a.q_len + r) * (a.heads * D) + h * D + t2
                         : a.o + (((long long)it.b * a.heads + h) * a.q_len + r) * D + t2;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
          float lo = o[nt][2 * i] * inv[i], hi = o[nt][2 * i + 1] * inv[i];
          if (FUSED) {  // 16-byte chunk nt of the slice's row, swizzled as the copy left it
            const u32 xv = *reinterpret_cast<const u32*>(slot + local * 128 + ((nt ^ (local & 7)) * 16) + t2 * 2);
            lo += lo_to_f32(xv);
            hi += hi_to_f32(xv);
          }
          if (r < a.q_len) *reinterpret_cast<u32*>(out + nt * 8) = pack2_elem(lo, hi);
        }
      }
      if (FUSED) {  // the slice's last reader: the slot may take the next head's
        __syncwarp();
        if (lane == 0) mbar_arrive(bars.q_empty(qs.stage));
      }
    }
  }
  if (PINGPONG && cw == 0) named_bar_sync(1);  // takes the last consumer's last turn: every barrier ends balanced
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    probe_attention(const Args a, const __grid_constant__ Maps maps) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  const Bars bars{smem_addr(smem + OFF_BARS)};
  for (int i = tid; i < TILE_BYTES / 4; i += THREADS)
    reinterpret_cast<u32*>(smem + OFF_ONES)[i] = pack2_elem(1.f, 1.f);
  fence_proxy_async();
  if (tid == 0) {  // full barriers: the producer's arming; empty ones: every consumer warp
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bars.full(s), 1);
      mbar_init(bars.empty(s), CONSUMER_WARPS);
    }
    for (int s = 0; s < Q_SLOTS; ++s) {
      mbar_init(bars.q_full(s), 1);
      mbar_init(bars.q_empty(s), CONSUMER_WARPS);
    }
    for (int s = 0; s < STATS_SLOTS; ++s) {
      mbar_init(bars.s_full(s), STATS_WARPS);
      mbar_init(bars.s_empty(s), CONSUMER_WARPS);
    }
    fence_mbar_init();
  }
  __syncthreads();
  if (wg == 0) {
    setmaxnreg_dec<PRODUCER_REGS>();
    if (warp == 0 && lane == 0) produce(a, maps, bars);
    if (FUSED && STATS_AHEAD && warp > 0) statistics_ahead(a, bars, warp - 1, lane);
    return;
  }
  setmaxnreg_inc<CONSUMER_REGS>();
  consume(a, bars, wg - 1, warp & 3, lane);
}
