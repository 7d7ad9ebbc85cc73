// The pnca kernel in warp-specialised form (TileConfig.producer: sm_90, d = 64, no mask, the many_keys role),
// rendered instead of kernel.cu. Steps 1, 2 and 4 are the same functions as there; what differs is who does what.
// The projection plan's stage takes it too (Q_FROM_QRAW, WRITE_O): q from qraw, o out, and no x slice to copy (its
// slots then only stage the o stores).
//
// A CTA (one per SM, persistent) is one producer warpgroup and two consumer warpgroups of 64 query rows,
// together BLOCK_M rows of one item at a time. The producer's first thread fills a ring of STAGES K/V stages and a
// ring of STAGES x-slice slots by bulk tensor copies, each guarded by a "full" mbarrier (the copies' bytes) and an
// "empty" one (one arrival per consumer warp). The producer warpgroup then gives up registers (setmaxnreg) so that
// the consumers can take 232 each: what the overlap below needs, and what kernel.cu, whose every warp both copies
// and computes, measured it could not afford (docs/PERF.md, thirty-second run).
// Each consumer warpgroup runs, per head: Q = norm(x slice) into registers (q_fragments), then over the key tiles
// FlashAttention-3's intra-warpgroup overlap: tile t's S = Q K^T is issued together with tile t-1's O += P V, and
// tile t's softmax runs while that P V is on the tensor cores; then y = x + O / l (store_output_rows). The rows'
// statistics are summed by each consumer warp at an item's start (row_statistics, as kernel.cu does), and each
// warp copies its head's norm parameters for itself. The arithmetic is kernel.cu's, in its order: the same bits.
// The first and the last key tile of a head are peeled out of the loop, so that the tiles between carry no test
// for keys past Lk, and the scale's sign picks one of two copies of the consumer: inside the overlap ptxas turns
// any branch into per-score predicates, which had cost 190 of the loop's 490 instructions. A basic-block boundary
// keeps the P V's wait after the softmax (block_boundary: -1 to -3 % on Lk 2048, thirty-seventh run).
// On an H100 (docs/PERF.md, thirty-sixth to thirty-eighth runs): Whisper prefill 162-163 µs in 96-key stages
// (spec.tile_for's many_keys_fine) against the long tile's 215, the seed with Lk 2048 1243-1323 in 128-key stages
// against 1715.

static_assert(USE_WGMMA && USE_TMA && ROWSUM_IN_PV && HEAD_DIM == 64 && MASK_KIND == 0 && MASK_ELEM_BYTES > 0 &&
                  !GROUPED_STATS && KEY_SPLIT == 1 && !ONE_TILE,
              "the warp-specialised kernel: sm_90 wgmma and bulk copies, d = 64, no mask");
constexpr int CTA_THREADS = THREADS + 128;  // THREADS (layout.cu) counts the consumer warps
// setmaxnreg counts: 128 x PRODUCER_REGS + THREADS x CONSUMER_REGS <= 65536 registers of the SM
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
static_assert(WARPS == 8 && 128 * PRODUCER_REGS + THREADS * CONSUMER_REGS <= 65536, "two consumer warpgroups");
constexpr u32 KV_TILE_BYTES = KV_TILE_ELEMS * 2, X_SLOT_BYTES = X_TILE_ELEMS * 2;
constexpr int WS_BAR_BYTES = 4 * STAGES * 8;
// Each consumer warp's own affine slot (q_kstep reads slot index WARP_AFFINE_SLOT0 + warp), after the barriers.
constexpr int WARP_AFFINE_SLOT0 =
    AFFINE_SLOT_BYTES == 0 ? 0 : (OFF_BARS + WS_BAR_BYTES - OFF_AFFINE + AFFINE_SLOT_BYTES - 1) / AFFINE_SLOT_BYTES;
static_assert(AFFINE_SLOT_BYTES <= 32 * 16, "a head's norm parameters: one 16-byte chunk per lane");

// Barriers after layout.cu's carve-up, then the warps' affine slots (spec.smem_bytes counts both): full / empty per
// K/V stage and per x slot.
struct WsBars {
  u32 base;
  FN_INLINE u32 full(int s) const { return base + 8 * s; }
  FN_INLINE u32 empty(int s) const { return base + 8 * (STAGES + s); }
  FN_INLINE u32 x_full(int s) const { return base + 8 * (2 * STAGES + s); }
  FN_INLINE u32 x_empty(int s) const { return base + 8 * (3 * STAGES + s); }
};
static_assert(OFF_BARS + WS_BAR_BYTES <= SMEM_BYTES &&
                  OFF_AFFINE + (WARP_AFFINE_SLOT0 + WARPS) * AFFINE_SLOT_BYTES <= SMEM_BYTES,
              "launch.py's shared-memory size is too small");

// A position in a ring of STAGES slots, and the parity of its barriers' current phase.
struct Ring {
  int slot = 0;
  u32 phase = 0;
  FN_INLINE void next() {
    if (++slot == STAGES) { slot = 0; phase ^= 1u; }
  }
};

// Work item -> (batch, row block, heads [head0, head_end)): layout.cu's unit_place (items here have no runs of keys).
struct WsItem { int b, row_block, head0, head_end; };
FN_INLINE WsItem ws_item(const Params& p, int item) {
  WsItem it;
  unit_place(p, item, it.b, it.row_block, it.head0);
  it.head_end = min(p.heads, it.head0 + p.heads_per_item);
  return it;
}

// The producer's first thread: per head its x slice, then its key tiles, each into the next free slot of its ring.
FN_INLINE void produce(const Params& p, const TmaMaps& maps, WsBars bars) {
  const int key_tiles = (p.kv_len + KV_ROWS - 1) / KV_ROWS;
  const bool read_once = kv_read_once(p);  // through L2 evict-first (layout.cu)
  const u64 policy = l2_evict_first();
  Ring kv, xs;
  for (int item = blockIdx.x; item < p.items; item += gridDim.x) {
    const WsItem it = ws_item(p, item);
    for (int h = it.head0; h < it.head_end; ++h, xs.next()) {
      mbar_wait(bars.x_empty(xs.slot), xs.phase ^ 1u);  // the slot's last head is stored (a new slot: passes)
      if constexpr (NEEDS_X_SLICE) {
        mbar_arrive_expect_tx(bars.x_full(xs.slot), X_SLOT_BYTES);
        tma_load_3d(smem_addr(smem + OFF_X + xs.slot * X_SLOT_BYTES), &maps.x, h * HEAD_DIM, it.row_block * BLOCK_M,
                    it.b, bars.x_full(xs.slot));
      } else {  // the plan's stage (q from qraw, o out): the slot only stages the o store
        mbar_arrive(bars.x_full(xs.slot));
      }
      const int kh = p.k_sh != 0 ? h : 0, kb = p.k_sb != 0 ? it.b : 0;  // a broadcast dim has size 1 in its map
      const int vh = p.v_sh != 0 ? h : 0, vb = p.v_sb != 0 ? it.b : 0;
      for (int t = 0; t < key_tiles; ++t, kv.next()) {
        const u32 full = bars.full(kv.slot);
        const u32 k_dst = smem_addr(smem + OFF_K + kv.slot * KV_TILE_BYTES);
        const u32 v_dst = smem_addr(smem + OFF_V + kv.slot * KV_TILE_BYTES);
        mbar_wait(bars.empty(kv.slot), kv.phase ^ 1u);
        mbar_arrive_expect_tx(full, 2 * KV_TILE_BYTES);
        if (read_once) {
          tma_load_4d_hint(k_dst, &maps.k, 0, t * KV_ROWS, kh, kb, full, policy);
          tma_load_4d_hint(v_dst, &maps.v, 0, t * KV_ROWS, vh, vb, full, policy);
        } else {
          tma_load_4d(k_dst, &maps.k, 0, t * KV_ROWS, kh, kb, full);
          tma_load_4d(v_dst, &maps.v, 0, t * KV_ROWS, vh, vb, full);
        }
      }
    }
  }
}

// Scores of one key tile, in place: with PRESCALE (a scale that is not positive) scaled first; with EDGE keys past
// Lk (valid of them are real) become -inf; then the running maximum, the rescale factor of the accumulators and the
// exponentials, as attend.cu's online softmax (the scale inside the exponent's FFMA when it is positive: c).
template <bool PRESCALE, bool EDGE>
FN_INLINE void softmax_tile(float (&s)[S_NTILES][4], float (&m)[2], float (&alpha)[2], bool first, int valid,
                            float c, float scale_log2, int lane) {
  const int t2 = (lane & 3) * 2;
#pragma unroll
  for (int nt = 0; nt < S_NTILES; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (PRESCALE) s[nt][e] *= scale_log2;
      if (EDGE && nt * 8 + t2 + (e & 1) >= valid) s[nt][e] = neg_inf();
    }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = neg_inf();
#pragma unroll
    for (int nt = 0; nt < S_NTILES; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * half], s[nt][2 * half + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 2)) * c;
    const float m_new = first ? mx : fmaxf(m[half], mx);
    const float m_use = m_new == neg_inf() ? 0.f : m_new;
    alpha[half] = first ? 0.f : fast_exp2(m[half] - m_use);
    m[half] = m_new;
#pragma unroll
    for (int nt = 0; nt < S_NTILES; ++nt) {
      s[nt][2 * half] = fast_exp2(fmaf(s[nt][2 * half], c, -m_use));
      s[nt][2 * half + 1] = fast_exp2(fmaf(s[nt][2 * half + 1], c, -m_use));
    }
  }
}

// Ends ptxas's basic block here. ptxas schedules each block on its own, and inside one it hoists a wgmma wait
// into the first stall it finds: in the overlap below that is the row maximum's shuffle, which left every
// exponential after the P V's wait (the warpgroup's P V then overlapped only the maximum). The branch is never
// taken (Lk >= 1); the fence only gives its block a body, so that ptxas keeps it. The test reads Lk through an
// opaque move each time, or the compiler moves it out of the loop (the plan's stage had two copies of the loop,
// neither with the boundary). tests/test_codegen_compile.py reads the exponentials' place from the machine code.
FN_INLINE void block_boundary(int kv_len) {
  int opaque;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(opaque) : "r"(kv_len));
  if (opaque < 0) asm volatile("membar.cta;\n" ::: "memory");
}

// P as the A operand of O += P V: k-step ks holds keys 16 ks .. 16 ks + 15.
FN_INLINE void pack_p(const float (&s)[S_NTILES][4], u32 (&pa)[PV_KSTEPS][4]) {
#pragma unroll
  for (int ks = 0; ks < PV_KSTEPS; ++ks) {
    pa[ks][0] = pack2_elem(s[2 * ks][0], s[2 * ks][1]);
    pa[ks][1] = pack2_elem(s[2 * ks][2], s[2 * ks][3]);
    pa[ks][2] = pack2_elem(s[2 * ks + 1][0], s[2 * ks + 1][1]);
    pa[ks][3] = pack2_elem(s[2 * ks + 1][2], s[2 * ks + 1][3]);
  }
}

FN_INLINE void issue_scores(float (&s)[S_NTILES][4], const u32 (&q)[QK_KSTEPS][4], int slot) {
  const u64 k_desc = sw128_desc(smem_addr(smem + OFF_K + slot * KV_TILE_BYTES), 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < QK_KSTEPS; ++kk) wgmma_scores(s, q[kk], desc_advance(k_desc, kk * 32), kk > 0);
  wgmma_commit();
}

// O (+)= P V, with 8 more columns read from the block of ones: o[O_NTILES] holds the row sums (ROWSUM_IN_PV).
FN_INLINE void issue_output(float (&o)[O_ACC_NTILES][4], const u32 (&pa)[PV_KSTEPS][4], int slot, bool accumulate) {
  const u32 v_addr = smem_addr(smem + OFF_V + slot * KV_TILE_BYTES);
  const u64 v_desc = sw128_desc(v_addr, smem_addr(smem + OFF_ONES) - v_addr, 1024);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < PV_KSTEPS; ++ks)
    wgmma_output(o, pa[ks], desc_advance(v_desc, ks * 16 * 128), accumulate || ks > 0);
  wgmma_commit();
}

// One consumer warp (warp of the consumers, 0 .. WARPS - 1; its warpgroup issues the wgmma together). PRESCALE: the
// softmax scale is not positive (applied to the scores first, as attend.cu does).
template <bool PRESCALE>
FN_INLINE void consume(const Params& p, const TmaMaps& maps, WsBars bars, int warp, int lane, bool& bad) {
  const int key_tiles = (p.kv_len + KV_ROWS - 1) / KV_ROWS;
  const float c = PRESCALE ? 1.f : p.scale_log2;
  float* row_mean = reinterpret_cast<float*>(smem + OFF_STATS) + warp * 2 * ROWS_PER_WARP;
  float* row_rstd = row_mean + ROWS_PER_WARP;
  float* stat_parts = reinterpret_cast<float*>(smem + OFF_STAT_PARTS);
  const int affine_slot = WARP_AFFINE_SLOT0 + warp;
  Ring kv, xs;
  // The x slot of the head before, handed back to the producer only once this head is under way, so that the wait
  // for its y store to have read it costs nothing
  int stored_slot = -1;
  auto release_stored_slot = [&]() {
    if (lane == 0 && stored_slot >= 0) {
      bulk_wait_read();
      mbar_arrive(bars.x_empty(stored_slot));
    }
    stored_slot = -1;
  };
  for (int item = blockIdx.x; item < p.items; item += gridDim.x) {
    const WsItem it = ws_item(p, item);
    const int row0 = it.row_block * BLOCK_M + warp * ROWS_PER_WARP;
    const bool warp_rows = row0 < p.q_len;
    // a warpgroup wholly past Lq only passes the stages on; one with rows issues its wgmma with all four warps
    const bool group_rows = it.row_block * BLOCK_M + (warp & ~3) * ROWS_PER_WARP < p.q_len;
    const long long batch_off = (long long)it.b * p.q_len * p.model_dim;
    u16* y_batch = p.y + (long long)it.b * p.q_len * p.y_ld;
    // the plan's stage copies x for the out GEMM, in the items of the first head group (the others hold the same rows)
    u16* copy_batch = WRITE_O && p.x_copy != nullptr && it.head0 == 0 ? p.x_copy + batch_off : nullptr;
    __syncwarp();  // every lane has read the last item's statistics (a warp past Lq stores no y: no other sync)
    if (warp_rows) row_statistics(p, p.x + batch_off, copy_batch, row0, row_mean, row_rstd, stat_parts, warp, lane);
    for (int h = it.head0; h < it.head_end; ++h, xs.next()) {
      u16* x_warp = reinterpret_cast<u16*>(smem + OFF_X + xs.slot * X_SLOT_BYTES) + warp * ROWS_PER_WARP * X_ROW_ELEMS;
      if (!group_rows) {
        mbar_wait(bars.x_full(xs.slot), xs.phase);
        release_stored_slot();
        for (int t = 0; t < key_tiles; ++t, kv.next()) {
          mbar_wait(bars.full(kv.slot), kv.phase);
          if (lane == 0) mbar_arrive(bars.empty(kv.slot));
        }
        if (lane == 0) mbar_arrive(bars.x_empty(xs.slot));
        continue;
      }
      __syncwarp();  // every lane has read the slot's last head
      load_affine_slot(p, h, smem + OFF_AFFINE + affine_slot * AFFINE_SLOT_BYTES, lane);  // lands during the wait
      cp_async_commit();
      mbar_wait(bars.x_full(xs.slot), xs.phase);
      cp_async_wait<0>();
      __syncwarp();
      u32 qf[1][QK_KSTEPS][4];
      const float* q_rows = Q_FROM_QRAW ? p.qraw + ((long long)it.b * p.q_len + row0) * p.q_ld : nullptr;
      const QSource src = q_source(p, row0, h * HEAD_DIM, row_mean, row_rstd, x_warp, q_rows, affine_slot, lane);
      q_fragments(p, src, nullptr, qf, lane);

      float s[S_NTILES][4], o[1][O_ACC_NTILES][4], m[2], alpha[2];
      u32 pa[PV_KSTEPS][4];
      // The first tile, peeled: no earlier P V to overlap, and every wgmma group's wait on a straight path (a
      // branch between an issue and its wait makes ptxas serialize them or insert waits)
      mbar_wait(bars.full(kv.slot), kv.phase);
      issue_scores(s, qf[0], kv.slot);
      wgmma_wait<0>();
      pin_all(s);
      softmax_tile<PRESCALE, true>(s, m, alpha, true, min(BLOCK_N, p.kv_len), c, p.scale_log2, lane);
      pack_p(s, pa);
      release_stored_slot();
      Ring prev = kv;  // the stage whose P V is still to be issued
      kv.next();
      // Tile t (t >= 1): its scores issued with tile t-1's P V, its softmax while that P V runs. edge: the last
      // tile (a constant at each call, which inlining folds: no branch is left in the overlap)
      auto step = [&](bool edge, int t) {
        mbar_wait(bars.full(kv.slot), kv.phase);
        issue_scores(s, qf[0], kv.slot);
        if (t > 1) rescale(o[0], alpha);
        issue_output(o[0], pa, prev.slot, t > 1);
        wgmma_wait<1>();  // the scores
        pin_all(s);
        if (edge)
          softmax_tile<PRESCALE, true>(s, m, alpha, false, p.kv_len - t * KV_ROWS, c, p.scale_log2, lane);
        else
          softmax_tile<PRESCALE, false>(s, m, alpha, false, BLOCK_N, c, p.scale_log2, lane);
        block_boundary(p.kv_len);  // the P V's wait stays below the exponentials
        wgmma_wait<0>();
        pin_all(o[0]);
        pin_all(pa);
        if (lane == 0) mbar_arrive(bars.empty(prev.slot));  // both of the stage's tiles read
        pack_p(s, pa);
        prev = kv;
        kv.next();
      };
      for (int t = 1; t < key_tiles - 1; ++t) step(false, t);
      if (key_tiles > 1) step(true, key_tiles - 1);
      if (key_tiles > 1) rescale(o[0], alpha);  // the last tile's P V
      issue_output(o[0], pa, prev.slot, key_tiles > 1);
      wgmma_wait<0>();
      pin_all(o[0]);
      pin_all(pa);
      if (lane == 0) mbar_arrive(bars.empty(prev.slot));

      const float l[1][2] = {{o[0][O_NTILES][0], o[0][O_NTILES][2]}};  // rows g and g + 8
      if (warp_rows) store_output_rows(p, maps, it.b, y_batch, row0, h * HEAD_DIM, o, l, x_warp, lane, bad);
      stored_slot = xs.slot;
    }
  }
  release_stored_slot();  // (the producer has stopped: only to leave the barriers balanced)
}

extern "C" __global__ void __launch_bounds__(CTA_THREADS, 1)
    KERNEL_NAME(const Params p, const __grid_constant__ TmaMaps maps) {
  // the warp index through a shuffle, so that ptxas knows it is warp-uniform: else every shuffle below carries a
  // divergence check (a branch)
  const int tid = threadIdx.x, warp = __shfl_sync(FULL_WARP, tid >> 5, 0), lane = tid & 31;
  const WsBars bars{smem_addr(smem + OFF_BARS)};
  for (int i = tid; i < ONES_BYTES / 4; i += CTA_THREADS)  // the row sums' B (ROWSUM_IN_PV)
    reinterpret_cast<u32*>(smem + OFF_ONES)[i] = pack2_elem(1.f, 1.f);
  fence_proxy_async();
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bars.full(s), 1);  // the producer's arming; the copies' bytes complete the phase
      mbar_init(bars.empty(s), WARPS);
      mbar_init(bars.x_full(s), 1);
      mbar_init(bars.x_empty(s), WARPS);
    }
    fence_mbar_init();
    prefetch_tensormap(&maps.x);
    prefetch_tensormap(&maps.k);
    prefetch_tensormap(&maps.v);
  }
  __syncthreads();
  wait_for_prior_grid();  // from here on global memory is this launch's (see prelude.cu)
  if (warp >= WARPS) {  // the producer warpgroup: the last, so that the consumers keep kernel.cu's warp numbers
    setmaxnreg_dec<PRODUCER_REGS>();
    if (warp == WARPS && lane == 0) produce(p, maps, bars);
    return;
  }
  setmaxnreg_inc<CONSUMER_REGS>();
  bool bad = false;
  if (p.scale_log2 > 0.f)
    consume<false>(p, maps, bars, warp, lane, bad);
  else
    consume<true>(p, maps, bars, warp, lane, bad);
  if (lane == 0) bulk_wait_all();  // y written before the CTA's shared memory goes
  if constexpr (CHECK_NUMERICS) {
    if (__any_sync(FULL_WARP, bad) && lane == 0) atomicOr(p.flag, 1);
  }
}
