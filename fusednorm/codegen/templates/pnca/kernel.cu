// The pnca kernel itself: its flat sequence of steps (item, head, key tile), the pipeline that runs ahead along it,
// and the per-step order of steps 1-4.

// Position in the CTA's flat sequence of steps (item, head, key tile). Uniform across the CTA.
struct StepCursor {
  int item, b, row_block, head, tile;
  int head_in_item;  // 0 on an item's first head, whose step also computes the row statistics
  int head_seq;      // heads entered so far by this CTA: picks the x-slice slot (ONE_TILE: the stage does)
  int chunk, tile_begin, tile_end;  // KV_CHUNKED: the item's run of key tiles (every head of the item takes it)
};

// A head's first and last key tile in this item: all of them, or with KV_CHUNKED the item's run.
FN_INLINE int first_tile(const StepCursor& c) { return KV_CHUNKED ? c.tile_begin : 0; }
FN_INLINE int end_tile(const StepCursor& c, int key_tiles) { return KV_CHUNKED ? c.tile_end : key_tiles; }

FN_INLINE void cursor_enter_item(const Params& p, StepCursor& c, int key_tiles) {
  if (c.item >= p.items) return;
  const int chunks = KV_CHUNKED ? p.kv_chunks : 1;  // an item is (batch, row block, head group, run of keys)
  const int unit = c.item / chunks;
  unit_place(p, unit, c.b, c.row_block, c.head);
  c.head_in_item = 0;
  if constexpr (KV_CHUNKED) {  // the planner makes every run non-empty
    c.chunk = c.item - unit * chunks;
    c.tile_begin = c.chunk * p.chunk_tiles;
    c.tile_end = min(key_tiles, c.tile_begin + p.chunk_tiles);
  }
  c.tile = first_tile(c);
}

FN_INLINE void cursor_advance(const Params& p, StepCursor& c, int key_tiles) {
  if (++c.tile < end_tile(c, key_tiles)) return;
  c.tile = first_tile(c);
  ++c.head_seq;
  if (++c.head_in_item < p.heads_per_item && ++c.head < p.heads) return;
  c.item += gridDim.x;
  cursor_enter_item(p, c, key_tiles);
}

// The x-slice slot of a head: its first step's stage when every head is one step, else heads taken in turn.
FN_INLINE int x_slot(const StepCursor& c, int stage) { return ONE_TILE ? stage : c.head_seq % STAGES; }

// With USE_TMA: one operand's bulk tensor copies (part 0: K, 1: V, 2: the x slice), TMA_BOX_COLS columns at a time
// (keys and rows past the tensor's end arrive as zeros); part 0 also arms the stage's barrier with all the bytes to
// come. A copy that lands before the barrier is armed takes its bytes off early (the count may go below zero): the
// phase cannot complete before that one arrival. A k/v dim broadcast with stride 0
// (one key head for all query heads, one batch for all) has size 1 in its map: its coordinate stays 0.
FN_INLINE void load_step_tma(const Params& p, const TmaMaps& maps, const StepCursor& c, int stage, u16* k_stages,
                             u16* v_stages, u16* x_slots, u32 bar, int part) {
  constexpr u32 KV_BOX = KV_ROWS * TMA_BOX_COLS * 2, X_BOX = BLOCK_M * TMA_BOX_COLS * 2;  // bytes per box
  const bool with_x = NEEDS_X_SLICE && c.tile == first_tile(c);
  if (part == 0) mbar_arrive_expect_tx(bar, TMA_BOXES * (2 * KV_BOX + (with_x ? X_BOX : 0)));
  if (part == 2) {
    const u32 x_dst = smem_addr(x_slots + x_slot(c, stage) * X_TILE_ELEMS);
#pragma unroll
    for (int cb = 0; cb < TMA_BOXES && with_x; ++cb)
      tma_load_3d(x_dst + cb * X_BOX, &maps.x, c.head * HEAD_DIM + cb * TMA_BOX_COLS, c.row_block * BLOCK_M, c.b,
                  bar);
    return;
  }
  const bool k = part == 0;
  const TensorMap* map = k ? &maps.k : &maps.v;
  const int h = (k ? p.k_sh : p.v_sh) != 0 ? c.head : 0, b = (k ? p.k_sb : p.v_sb) != 0 ? c.b : 0;
  const u32 dst = smem_addr((k ? k_stages : v_stages) + stage * KV_TILE_ELEMS);
  const bool read_once = kv_read_once(p);
#pragma unroll
  for (int cb = 0; cb < TMA_BOXES; ++cb) {
    if (read_once)
      tma_load_4d_hint(dst + cb * KV_BOX, map, cb * TMA_BOX_COLS, c.tile * KV_ROWS, h, b, bar, l2_evict_first());
    else
      tma_load_4d(dst + cb * KV_BOX, map, cb * TMA_BOX_COLS, c.tile * KV_ROWS, h, b, bar);
  }
}

// Issue the copies of one step into a pipeline stage (and, on a head's first step, its x slice if needed).
FN_INLINE void load_step(const Params& p, const TmaMaps& maps, const StepCursor& c, int stage, u16* k_stages,
                         u16* v_stages, u16* x_slots, u8* affine_slots, u32 bars, int tid) {
  if constexpr (USE_TMA) {
    const u32 bar = bars + stage * 8;
    if constexpr (COPY_WARPS == 1) {  // parts as constants: each call folds to its own copies
      if (tid == 0)
        for (int part = 0; part < 3; ++part) load_step_tma(p, maps, c, stage, k_stages, v_stages, x_slots, bar, part);
    } else if (tid % 32 == 0 && tid < 32 * COPY_WARPS) {
      load_step_tma(p, maps, c, stage, k_stages, v_stages, x_slots, bar, tid / 32);
    }
    if (c.tile == first_tile(c))  // by the last warp's threads: the copying warps' first lanes are busy above
      load_affine_slot(p, c.head, affine_slots + x_slot(c, stage) * AFFINE_SLOT_BYTES, THREADS - 1 - tid);
    return;
  }
  load_kv_tile(p, c.b, c.head, c.tile * KV_ROWS, k_stages + stage * KV_TILE_ELEMS, v_stages + stage * KV_TILE_ELEMS,
               tid);
  if (c.tile == first_tile(c)) {
    if (NEEDS_X_SLICE)
      load_x_tile(p, c.b, c.row_block * BLOCK_M, c.head * HEAD_DIM, x_slots + x_slot(c, stage) * X_TILE_ELEMS, tid);
    load_affine_slot(p, c.head, affine_slots + x_slot(c, stage) * AFFINE_SLOT_BYTES, tid);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS_PER_SM)
    KERNEL_NAME(const Params p, const __grid_constant__ TmaMaps maps) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  u16* k_stages = reinterpret_cast<u16*>(smem + OFF_K);
  u16* v_stages = reinterpret_cast<u16*>(smem + OFF_V);
  u16* q_tile = reinterpret_cast<u16*>(smem + OFF_Q) + warp * Q_TILE_ELEMS;
  u16* x_slots = reinterpret_cast<u16*>(smem + OFF_X);
  float* row_mean = reinterpret_cast<float*>(smem + OFF_STATS) + warp * 2 * ROWS_PER_WARP;
  float* row_rstd = row_mean + ROWS_PER_WARP;
  float* stat_parts = reinterpret_cast<float*>(smem + OFF_STAT_PARTS);
  u8* affine_slots = smem + OFF_AFFINE;
  const u32 bars = smem_addr(smem + OFF_BARS);
  u32 phases = 0;  // USE_TMA: bit s is the parity of the next phase of stage s's barrier to wait for

  if constexpr (USE_WGMMA) {  // the row sums' B; the first step's barrier publishes it
    for (int i = tid; i < ONES_BYTES / 4; i += THREADS)
      reinterpret_cast<u32*>(smem + OFF_ONES)[i] = pack2_elem(1.f, 1.f);
    fence_proxy_async();
  }
  if constexpr (USE_TMA) {
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < STAGES; ++s) mbar_init(bars + s * 8, 1);  // one arrival: the thread that arms it
      fence_mbar_init();
      prefetch_tensormap(&maps.x);  // the first bulk copies' maps, fetched while the kernel before may still run
      prefetch_tensormap(&maps.k);
      prefetch_tensormap(&maps.v);
    }
    __syncthreads();
  }
  wait_for_prior_grid();  // from here on global memory is this launch's (see prelude.cu)

  const int key_tiles = ONE_TILE ? 1 : (p.kv_len + KV_ROWS - 1) / KV_ROWS;
  bool bad = false;

  // Prologue: the first STAGES - 1 steps in flight.
  StepCursor cur;
  cur.item = blockIdx.x;
  cur.head_seq = 0;
  cursor_enter_item(p, cur, key_tiles);
  StepCursor ahead = cur;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (ahead.item < p.items) {
      load_step(p, maps, ahead, s, k_stages, v_stages, x_slots, affine_slots, bars, tid);
      cursor_advance(p, ahead, key_tiles);
    }
    cp_async_commit();
  }

  u32 qf[Q_IN_SMEM ? 1 : M_TILES][Q_IN_SMEM ? 1 : QK_KSTEPS][4];
  float o[M_TILES][O_ACC_NTILES][4];
  float m[M_TILES][2], l[M_TILES][2];

#pragma unroll 1
  for (int stage = 0; cur.item < p.items; stage = stage + 1 == STAGES ? 0 : stage + 1) {
    const int row0 = cur.row_block * BLOCK_M + (KEY_SPLIT > 1 ? 0 : warp * ROWS_PER_WARP);
    const bool warp_rows = row0 < p.q_len;  // false for warps entirely past the last query row
    // a warpgroup issues its wgmma together: warps past Lq join while any warp of their group has rows (their Q
    // fragments are zeros and they store nothing)
    const bool attend_rows = USE_WGMMA ? cur.row_block * BLOCK_M + (warp & ~3) * ROWS_PER_WARP < p.q_len : warp_rows;
    u16* y_batch = p.y + (long long)cur.b * p.q_len * p.y_ld;
    const bool head_first = ONE_TILE || cur.tile == first_tile(cur);  // compile-time true with ONE_TILE
    const bool head_last = ONE_TILE || cur.tile == end_tile(cur, key_tiles) - 1;
    if (head_first) {  // a new head (the accumulators of the last one are dead here, which saves registers)
      if (cur.head_in_item == 0) {  // a new item: statistics of this warp's rows
        if (GROUPED_STATS && p.stat_col_groups > 1) {  // every warp: it may hold a CTA barrier
          grouped_row_statistics(p, cur.b, cur.row_block, cur.head / p.heads_per_item, warp_rows, row0, row_mean,
                                 row_rstd, lane);
        } else if (warp_rows) {
          const long long batch_off = (long long)cur.b * p.q_len * p.model_dim;
          // items of the later head groups hold the same rows: the first group's copies them
          u16* copy_batch = WRITE_O && p.x_copy != nullptr && cur.head == 0 ? p.x_copy + batch_off : nullptr;
          row_statistics(p, p.x + batch_off, copy_batch, row0, row_mean, row_rstd, stat_parts, warp, lane);
        }
      }
#pragma unroll
      for (int mt = 0; mt < M_TILES && !ONE_TILE; ++mt) {  // ONE_TILE: attend_tile starts them (Lk >= 1)
#pragma unroll
        for (int nt = 0; nt < O_ACC_NTILES; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.f;
        m[mt][0] = m[mt][1] = neg_inf();
        l[mt][0] = l[mt][1] = 0.f;
      }
    }

    u16* x_tile = x_slots + x_slot(cur, stage) * X_TILE_ELEMS;
    u16* x_warp = x_tile + (KEY_SPLIT > 1 ? 0 : warp * ROWS_PER_WARP * X_ROW_ELEMS);
    const int col0 = cur.head * HEAD_DIM;

    cp_async_wait<STAGES - 2>();
    if constexpr (USE_TMA) {  // this step's bulk copies have landed; this warp's y stores have read their slot
      mbar_wait(bars + stage * 8, (phases >> stage) & 1u);
      phases ^= 1u << stage;
      if (lane == 0) bulk_wait_read();
    }
    // this thread's copies, visible to wgmma after the barrier; with USE_TMA, its writes to the last step's x slot
    // ordered before the bulk copy that refills it
    if constexpr (USE_WGMMA || USE_TMA) fence_proxy_async();
    __syncthreads();  // this step's stage is visible to all warps; the stage refilled below is free
    if constexpr (ONE_TILE) {  // the step STAGES - 1 ahead, worked out again rather than carried (registers)
      ahead = cur;
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s) cursor_advance(p, ahead, key_tiles);
    }
    if (ahead.item < p.items) {
      load_step(p, maps, ahead, stage == 0 ? STAGES - 1 : stage - 1, k_stages, v_stages, x_slots, affine_slots, bars,
                tid);
      if constexpr (!ONE_TILE) cursor_advance(p, ahead, key_tiles);
    }
    cp_async_commit();

    const QSource src = q_source(p, row0, col0, row_mean, row_rstd, x_warp,
                                 p.qraw + ((long long)cur.b * p.q_len + row0) * p.q_ld,
                                 x_slot(cur, stage), lane);
    if (head_first && attend_rows) q_fragments(p, src, q_tile, qf, lane);

    const int warp_key_offset = KEY_SPLIT > 1 ? warp * BLOCK_N : 0;
    const int key0 = cur.tile * KV_ROWS + warp_key_offset;
    const int valid = min(BLOCK_N, p.kv_len - key0);
    if (attend_rows && valid > 0) {
      const long long mask_bh = MASK_KIND != 0 ? cur.b * p.m_sb + cur.head * p.m_sh : 0;
      const u16* k_tile = k_stages + stage * KV_TILE_ELEMS + warp_key_offset * KV_ROW_ELEMS;
      const u16* v_tile = v_stages + stage * KV_TILE_ELEMS + warp_key_offset * KV_ROW_ELEMS;
      if (valid == BLOCK_N)
        attend_tile<FILL_ALL>(p, src, qf, q_tile, k_tile, v_tile, key0, valid, row0, mask_bh, head_first, o, m, l,
                              lane);
      else if (ONE_TILE && valid > BLOCK_N - 16)  // every head's one tile: worth its own copy of the code
        attend_tile<FILL_LAST_PAIR>(p, src, qf, q_tile, k_tile, v_tile, key0, valid, row0, mask_bh, head_first, o,
                                    m, l, lane);
      else
        attend_tile<FILL_ANY>(p, src, qf, q_tile, k_tile, v_tile, key0, valid, row0, mask_bh, head_first, o, m, l,
                              lane);
    }

    if (head_last) {
      if constexpr (KEY_SPLIT > 1) {
        const long long unit = ((long long)cur.b * p.row_blocks + cur.row_block) * p.heads + cur.head;
        combine_and_store(p, unit, cur.chunk, x_tile, y_batch, row0, col0, o, m, l, k_stages + stage * KV_TILE_ELEMS,
                          v_stages + stage * KV_TILE_ELEMS, warp, lane, tid, bad);
      } else if (warp_rows) {
        store_output_rows(p, maps, cur.b, y_batch, row0, col0, o, l, x_warp, lane, bad);
      }
    }
    cursor_advance(p, cur, key_tiles);
  }
  cp_async_wait<0>();
  if constexpr (USE_TMA) {
    if (lane == 0) bulk_wait_all();  // y written before the CTA's shared memory goes
  }

  if constexpr (CHECK_NUMERICS) {
    if (__any_sync(FULL_WARP, bad) && lane == 0) atomicOr(p.flag, 1);
  }
}
