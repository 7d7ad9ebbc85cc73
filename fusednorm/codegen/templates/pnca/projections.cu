// PROJ_ITEMS: the projection plan's three steps in one launch, for a block of at most PROJ_M rows (B * Lq: decode).
// Two GEMMs of this size take ~5 us each as launches of their own, whatever their rows (docs/PERF.md, §2); here
// they become work items of the attention stage's persistent grid:
//   Q tiles    qraw[:, n0:n0+PROJ_N] = x @ Wq'[n0:n0+PROJ_N, :]^T    the CTAs blockIdx.x, + gridDim.x, ...: before
//                                                                     their attention items
//   attention  the stage as usual; an item's first step of a head waits for the Q tiles that hold the head's
//              columns, and its last step counts the head done
//   out tiles  y[:, n0:n0+PROJ_N] = x + [o, 1] @ [Wo, bo][n0:n0+PROJ_N, :]^T    the CTAs from the last one down
//              (those dealt the fewest items), after their attention items; K runs in head order, and each chunk
//              of K waits only for the heads it covers, so most of an out tile is summed while the last heads run
// Each tile reads its slice of the weights once for every row of the block: the weights cost what the two GEMMs
// read (a per-item projection read them once per (batch, head): 410 MB, thirtieth run). The items are dealt
// head-major (cursor_enter_item), so the heads finish one after another and the out tiles' waits are short.
// No wait can deadlock: Q tiles wait for nothing; attention waits only for Q tiles, which the lowest blockIdx CTAs
// compute first; out tiles wait only for attention items, whose CTAs wait for nothing but Q tiles. The sums run in
// a fixed order, so y is the same bits whatever the grid (sm_count).
// p.proj_flags (zero at the start, left zero by the last CTA to leave): [q tiles] a Q tile written, [heads]
// (batch, row block, key run) items done per head, [1] CTAs that left.

constexpr int PROJ_M = 64;                          // the block's rows, all in one tile
constexpr int PROJ_N = 32;                          // output columns per tile: 40 tiles of Whisper's 1280
constexpr int PROJ_KC = 64;                         // K per chunk of the copy ring
constexpr int PROJ_LD = PROJ_KC + 8;                // padded rows: the 8 rows of an ldmatrix on distinct banks
constexpr int PROJ_CHUNK_ELEMS = (PROJ_M + PROJ_N) * PROJ_LD;  // rows of the block, then rows of the weight slice
constexpr int PROJ_WARP_MTILES = PROJ_ITEMS ? PROJ_M / 16 / WARPS : 1;  // 16-row m-tiles per warp
static_assert(!PROJ_ITEMS || (KEY_SPLIT > 1 && !USE_TMA && Q_FROM_QRAW && WRITE_O && PROJ_WARP_MTILES >= 1),
              "one-launch projections: the key-split stage (plain stores of o), folded Q in, o out");
static_assert(!PROJ_ITEMS || PROJ_BUFS * PROJ_CHUNK_ELEMS * 2 <= SMEM_BYTES, "the copy ring fits shared memory");

FN_INLINE int proj_q_tiles(const Params& p) { return (p.heads * HEAD_DIM + PROJ_N - 1) / PROJ_N; }
FN_INLINE int proj_out_tiles(const Params& p) { return (p.model_dim + PROJ_N - 1) / PROJ_N; }
FN_INLINE int* proj_heads_done(const Params& p) { return p.proj_flags + proj_q_tiles(p); }

// acc = a[0:rows, 0:K] @ w[0:w_rows, 0:K]^T for this warp's m-tiles and PROJ_N columns (w: the tile's first
// weight row), K in chunks of PROJ_KC through a ring of PROJ_BUFS in shared memory (the stages' space: no stage is
// in flight around it). before_chunk(c) runs in every thread before chunk c's copies are issued (the out tile
// waits there for its heads). Rows past `rows` and columns past K read
// as zeros.
template <class BeforeChunk>
FN_INLINE void proj_gemm(const u16* a, long long lda, int rows, const u16* w, long long ldw, int w_rows, int K,
                         float (&acc)[PROJ_WARP_MTILES][PROJ_N / 8][4], int warp, int lane, int tid,
                         BeforeChunk before_chunk) {
  u16* ring = reinterpret_cast<u16*>(smem);
  const int chunks = (K + PROJ_KC - 1) / PROJ_KC;
  const int a_rows = (rows + 15) / 16 * 16;  // whole m-tiles: the m-tiles past them are neither loaded nor run
  const int warp_row0 = warp * PROJ_WARP_MTILES * 16;
#pragma unroll
  for (int mt = 0; mt < PROJ_WARP_MTILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < PROJ_N / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
  const auto issue = [&](int c) {
    if (c < chunks) {
      before_chunk(c);
      const u32 dst = smem_addr(ring + (c % PROJ_BUFS) * PROJ_CHUNK_ELEMS);
      const int k0 = c * PROJ_KC;
      for (int i = tid; i < (PROJ_M + PROJ_N) * (PROJ_KC / 8); i += THREADS) {
        const int r = i / (PROJ_KC / 8), k = k0 + (i % (PROJ_KC / 8)) * 8;
        const bool is_a = r < PROJ_M;
        if (is_a && r >= a_rows) continue;
        const int rr = is_a ? r : r - PROJ_M;
        const bool live = (is_a ? rr < rows : rr < w_rows) && k < K;
        const u16* src = is_a ? a + rr * lda + k : w + rr * ldw + k;
        cp_async16(dst + (r * PROJ_LD + (i % (PROJ_KC / 8)) * 8) * 2, live ? src : a, live ? 16 : 0);
      }
    }
    cp_async_commit();  // empty groups past the end keep the wait count below uniform
  };
#pragma unroll 1
  for (int c = 0; c < PROJ_BUFS - 1; ++c) issue(c);
#pragma unroll 1
  for (int c = 0; c < chunks; ++c) {
    cp_async_wait<PROJ_BUFS - 2>();
    __syncthreads();  // chunk c is in for every thread; the slot refilled next was last read for chunk c - 1
    issue(c + PROJ_BUFS - 1);
    const u32 base = smem_addr(ring + (c % PROJ_BUFS) * PROJ_CHUNK_ELEMS);
#pragma unroll
    for (int kk = 0; kk < PROJ_KC / 16; ++kk) {
      u32 b[PROJ_N / 8][2];
#pragma unroll
      for (int np = 0; np < PROJ_N / 16; ++np) {  // weight rows are the B columns: ldmatrix without transpose
        u32 r[4];
        const int n = PROJ_M + np * 16 + ((lane >> 4) << 3) + (lane & 7);
        ldmatrix_x4(r, base + (n * PROJ_LD + kk * 16 + ((lane >> 3) & 1) * 8) * 2);
        b[2 * np][0] = r[0];
        b[2 * np][1] = r[1];
        b[2 * np + 1][0] = r[2];
        b[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < PROJ_WARP_MTILES; ++mt) {
        const int m0 = warp_row0 + mt * 16;
        if (m0 >= a_rows) break;  // warp-uniform
        u32 af[4];
        ldmatrix_x4(af, base + ((m0 + (lane & 15)) * PROJ_LD + kk * 16 + (lane >> 4) * 8) * 2);
#pragma unroll
        for (int nt = 0; nt < PROJ_N / 8; ++nt) mma_16816(acc[mt][nt], af, b[nt][0], b[nt][1]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is free again
}

// Calls f(row, column within the tile, value pair) for this thread's accumulator pairs that lie in the block.
template <class F>
FN_INLINE void proj_for_each_pair(const float (&acc)[PROJ_WARP_MTILES][PROJ_N / 8][4], int rows, int warp, int lane,
                                  F f) {
  const int g = lane >> 2, t2 = (lane & 3) * 2;
#pragma unroll
  for (int mt = 0; mt < PROJ_WARP_MTILES; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp * PROJ_WARP_MTILES * 16 + mt * 16 + g + 8 * half;
      if (r >= rows) continue;
#pragma unroll
      for (int nt = 0; nt < PROJ_N / 8; ++nt)
        f(r, nt * 8 + t2, make_float2(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]));
    }
}

// One Q tile: qraw's columns [n0, n0 + PROJ_N) in float32 (as the plan's cuBLAS GEMM leaves them), then its flag.
FN_INLINE void project_q_tile(const Params& p, int tile, int warp, int lane, int tid) {
  const int n_all = p.heads * HEAD_DIM, n0 = tile * PROJ_N, rows = p.batch * p.q_len;
  float acc[PROJ_WARP_MTILES][PROJ_N / 8][4];
  proj_gemm(p.x, p.model_dim, rows, p.wq + (long long)n0 * p.model_dim, p.model_dim, min(PROJ_N, n_all - n0),
            p.model_dim, acc, warp, lane, tid, [](int) {});
  float* qraw = const_cast<float*>(p.qraw);
  proj_for_each_pair(acc, rows, warp, lane, [&](int r, int c, float2 v) {
    if (n0 + c < n_all) *reinterpret_cast<float2*>(qraw + (long long)r * p.q_ld + n0 + c) = v;  // n_all is even
  });
  __threadfence();  // every thread's qraw stores before the flag
  __syncthreads();
  if (tid == 0) atomicExch(p.proj_flags + tile, 1);
}

// One thread of the CTA polls (not all of them: one word, polled from every SM), and the barrier passes what it
// acquired on to the CTA's other threads.
FN_INLINE void wait_until_at_least(const int* word, int value, int tid) {
  if (tid == 0)
    while (ld_acquire_gpu(word) < value) __nanosleep(256);
  __syncthreads();
}

// Before a head's first step (every thread): wait until the Q tiles holding the head's columns are written.
FN_INLINE void wait_for_q_tiles(const Params& p, int head, int tid) {
  const int first = head * HEAD_DIM / PROJ_N, last = ((head + 1) * HEAD_DIM - 1) / PROJ_N;
  for (int t = first; t <= last; ++t) wait_until_at_least(p.proj_flags + t, 1, tid);
}

// After a head's last step of an item: the item's o columns of that head are written (every thread's stores).
FN_INLINE void count_head_done(const Params& p, int head, int tid) {
  __threadfence();
  __syncthreads();
  if (tid == 0) atomicAdd(proj_heads_done(p) + head, 1);
}

// One out tile: y's columns [n0, n0 + PROJ_N) = x + [o, 1, 0..] @ [Wo, bo, 0..]^T, rounded once. o is the stage's
// output (p.y, y_ld = o's columns = K); chunk c waits for the heads whose columns it covers (the ones column, past
// the last head, for all of them).
FN_INLINE void project_out_tile(const Params& p, int tile, int warp, int lane, int tid, bool& bad) {
  const int D = p.model_dim, n0 = tile * PROJ_N, rows = p.batch * p.q_len, K = (int)p.y_ld;
  const int attn_cols = p.heads * HEAD_DIM;
  const int items_per_head = p.batch * p.row_blocks * (KV_CHUNKED ? p.kv_chunks : 1);
  const int* done = proj_heads_done(p);
  int heads_ready = 0;
  const auto wait_for_heads = [&](int c) {
    const int end = min(K, (c + 1) * PROJ_KC);
    const int need = end > attn_cols ? p.heads : (end + HEAD_DIM - 1) / HEAD_DIM;
    for (; heads_ready < need; ++heads_ready) wait_until_at_least(done + heads_ready, items_per_head, tid);
  };
  float acc[PROJ_WARP_MTILES][PROJ_N / 8][4];
  proj_gemm(p.y, p.y_ld, rows, p.wo + (long long)n0 * K, K, min(PROJ_N, D - n0), K, acc, warp, lane, tid,
            wait_for_heads);
  proj_for_each_pair(acc, rows, warp, lane, [&](int r, int c, float2 v) {
    if (n0 + c >= D) return;  // D is a multiple of 8
    const long long at = (long long)r * D + n0 + c;
    const u32 xr = *reinterpret_cast<const u32*>(p.x + at);
    const u32 out = pack2_elem(lo_to_f32(xr) + v.x, hi_to_f32(xr) + v.y);
    if constexpr (CHECK_NUMERICS) bad |= pair_not_finite(out);
    *reinterpret_cast<u32*>(p.y_out + at) = out;
  });
}

// The last CTA to leave zeroes p.proj_flags for the next launch (every CTA has read its last flag before leaving).
FN_INLINE void proj_leave(const Params& p, int tid) {
  __syncthreads();
  if (tid != 0) return;
  const int words = proj_q_tiles(p) + p.heads;
  __threadfence();
  if (atomicAdd(p.proj_flags + words, 1) == (int)gridDim.x - 1) {
    for (int i = 0; i <= words; ++i) p.proj_flags[i] = 0;
  }
}
