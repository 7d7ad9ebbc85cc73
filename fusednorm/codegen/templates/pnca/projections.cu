// PROJ_ITEMS: the projection plan's three steps in one launch, for a block of at most PROJ_M rows (B * Lq: decode).
// Two GEMMs of this size take ~5 us each as launches of their own, whatever their rows (docs/PERF.md, §2); here
// they become work items of the attention stage's persistent grid. Each GEMM is cut into tasks of PROJ_N output
// columns by PROJ_PART_K of its K (all rows), so that no CTA runs a long chain of K-steps: a tile of all of K was one
// CTA's serial chain of 20 steps at ~1 us each (thirty-third run), where cuBLAS spreads the GEMM over 80 CTAs.
//   Q tasks    part s of qraw[:, n0:n0+PROJ_N] = x[:, K_s] @ Wq'[n0:n0+PROJ_N, K_s]^T, float32, into the scratch;
//              the part that completes a tile adds the tile's parts in part order into qraw. Dealt from the last
//              CTA down, before the CTA's attention items (and where the stages allow, with the items' first copies
//              in flight: PROJ_RING_IN_STAGE)
//   attention  the stage as usual; an item's first step of a head waits until the Q tiles holding the head's
//              columns are summed; its last step counts the head done
//   out tasks  part s of x + [o, 1] @ [Wo, bo]^T for y's columns [n0, n0 + PROJ_N): waits for the heads whose o
//              columns K_s covers, writes a float32 partial; the part that finishes a tile last adds x and the
//              tile's partials in part order and rounds once into y. Taken from a queue (one atomic per task) by
//              the CTAs as their attention items run out, parts of the earliest heads first
// The items are dealt head-major (cursor_enter_item), so the heads finish one after another and the out tasks'
// waits are short. No wait can deadlock: Q tasks wait for nothing; attention waits only for Q tasks, which every
// CTA runs before its attention items; out tasks wait only for attention items, whose CTAs wait for nothing but Q
// tasks. The sums run in a fixed order, so y is the same bits whatever the grid (sm_count).
// Scratch (p.qraw, float32): qraw [rows][q_ld], its parts [q parts][rows][q_ld], then y's [out parts][rows][D].
// p.proj_flags (zero at the start, left zero by the last CTA to leave): [q tiles] summed, [heads] (batch, row block,
// key run) items done, [out tiles] parts written, [q tiles] parts written, [1] out tasks taken, [1] CTAs that left.

constexpr int PROJ_M = 64;                          // the block's rows, all in one tile
constexpr int PROJ_N = 32;                          // output columns per task: 40 tiles of Whisper's 1280
constexpr int PROJ_KC = 64;                         // K per copy chunk
constexpr int PROJ_PART_CHUNKS = 2;                 // chunks per task: 10 parts of Whisper's K = 1280
constexpr int PROJ_PART_K = PROJ_PART_CHUNKS * PROJ_KC;
constexpr int PROJ_LD = PROJ_KC + 8;                // padded rows: the 8 rows of an ldmatrix on distinct banks
constexpr int PROJ_CHUNK_ELEMS = (PROJ_M + PROJ_N) * PROJ_LD;  // rows of the block, then rows of the weight slice
constexpr int PROJ_WARP_MTILES = PROJ_ITEMS ? PROJ_M / 16 / WARPS : 1;  // 16-row m-tiles per warp
// A task's copies land in the K and V buffers of the last stage, where a chunk fits: the prologue leaves that stage
// free while its copies of the first STAGES - 1 steps are in flight, so the Q tasks run after it. Where a chunk does
// not fit a stage (d = 32, 40, 80, 96), at the start of shared memory, and the Q tasks run before the prologue. The
// out tasks run after the last step, when every stage is free.
constexpr bool PROJ_RING_IN_STAGE = KV_TILE_ELEMS >= PROJ_CHUNK_ELEMS && PROJ_PART_CHUNKS == 2;
static_assert(!PROJ_ITEMS || (KEY_SPLIT > 1 && !USE_TMA && Q_FROM_QRAW && WRITE_O && PROJ_WARP_MTILES >= 1),
              "one-launch projections: the key-split stage (plain stores of o), folded Q in, o out");
static_assert(!PROJ_ITEMS || PROJ_PART_CHUNKS * PROJ_CHUNK_ELEMS * 2 <= OFF_BARS, "a task's chunks fit the stages");

FN_INLINE u32 proj_chunk_addr(int c) {
  if constexpr (PROJ_RING_IN_STAGE)
    return smem_addr(smem + (c == 0 ? OFF_K : OFF_V) + (STAGES - 1) * KV_TILE_ELEMS * 2);
  return smem_addr(smem + c * PROJ_CHUNK_ELEMS * 2);
}

FN_INLINE int proj_parts(int K) { return (K + PROJ_PART_K - 1) / PROJ_PART_K; }
FN_INLINE int proj_q_tiles(const Params& p) { return (p.heads * HEAD_DIM + PROJ_N - 1) / PROJ_N; }
FN_INLINE int proj_out_tiles(const Params& p) { return (p.model_dim + PROJ_N - 1) / PROJ_N; }
FN_INLINE int proj_q_parts(const Params& p) { return proj_parts(p.model_dim); }
FN_INLINE int proj_out_parts(const Params& p) { return proj_parts((int)p.y_ld); }
FN_INLINE int* proj_heads_done(const Params& p) { return p.proj_flags + proj_q_tiles(p); }
FN_INLINE int* proj_out_done(const Params& p) { return proj_heads_done(p) + p.heads; }
FN_INLINE int* proj_q_done(const Params& p) { return proj_out_done(p) + proj_out_tiles(p); }
FN_INLINE int* proj_out_next(const Params& p) { return proj_q_done(p) + proj_q_tiles(p); }
FN_INLINE long long proj_rows(const Params& p) { return (long long)p.batch * p.q_len; }
FN_INLINE float* proj_q_partials(const Params& p) { return const_cast<float*>(p.qraw) + proj_rows(p) * p.q_ld; }
FN_INLINE float* proj_out_partials(const Params& p) {
  return proj_q_partials(p) + proj_q_parts(p) * proj_rows(p) * p.q_ld;
}

// acc = a[0:rows, k0:k1] @ w[0:w_rows, k0:k1]^T for this warp's m-tiles and PROJ_N columns (w: the tile's first
// weight row; k1 - k0 <= PROJ_PART_K). Every chunk is copied at once, then multiplied: a task is one round trip to
// L2 or DRAM. Rows past `rows` and columns past k1 read as zeros.
FN_INLINE void proj_gemm(const u16* a, long long lda, int rows, const u16* w, long long ldw, int w_rows, int k0,
                         int k1, float (&acc)[PROJ_WARP_MTILES][PROJ_N / 8][4], int warp, int lane, int tid) {
  const int chunks = (k1 - k0 + PROJ_KC - 1) / PROJ_KC;
  const int a_rows = (rows + 15) / 16 * 16;  // whole m-tiles: the m-tiles past them are neither loaded nor run
  const int warp_row0 = warp * PROJ_WARP_MTILES * 16;
#pragma unroll
  for (int mt = 0; mt < PROJ_WARP_MTILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < PROJ_N / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
  for (int c = 0; c < chunks; ++c) {
    const u32 dst = proj_chunk_addr(c);
    const int kc = k0 + c * PROJ_KC;
    for (int i = tid; i < (PROJ_M + PROJ_N) * (PROJ_KC / 8); i += THREADS) {
      const int r = i / (PROJ_KC / 8), k = kc + (i % (PROJ_KC / 8)) * 8;
      const bool is_a = r < PROJ_M;
      if (is_a && r >= a_rows) continue;
      const int rr = is_a ? r : r - PROJ_M;
      const bool live = (is_a ? rr < rows : rr < w_rows) && k < k1;
      const u16* src = is_a ? a + rr * lda + k : w + rr * ldw + k;
      cp_async16(dst + (r * PROJ_LD + (i % (PROJ_KC / 8)) * 8) * 2, live ? src : a, live ? 16 : 0);
    }
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();  // every chunk is in for every thread
#pragma unroll 1
  for (int c = 0; c < chunks; ++c) {
    const u32 base = proj_chunk_addr(c);
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
  __syncthreads();  // the chunks' memory is free again
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


// One thread of the CTA polls (not all of them: one word, polled from every SM), and the barrier passes what it
// acquired on to the CTA's other threads.
FN_INLINE void wait_until_at_least(const int* word, int value, int tid) {
  if (tid == 0)
    while (ld_acquire_gpu(word) < value) __nanosleep(128);
  __syncthreads();
}

// Every thread's stores before the count: the task's output is published by the atomic that counts it. Returns, in
// every thread, the count before this one.
FN_INLINE int publish_and_count(int* counter, int tid) {
  __shared__ int before;
  __threadfence();
  __syncthreads();
  if (tid == 0) before = atomicAdd(counter, 1);
  __syncthreads();
  return before;
}

// For each element pair (r, n0 + c) of a tile's rows and PROJ_N columns below n_end: the sum of its `parts` float32
// parts (part j at base + j * part_stride + r * ld + n0 + c), added in part order, handed to f(offset r * ld + n0 + c,
// sum). A thread loads PROJ_SUM_BATCH parts of all its pairs at once (16 loads in flight): the loads are L2 round
// trips, which one after another took ~50 us per tile (thirty-fourth run).
constexpr int PROJ_SUM_PAIRS = (PROJ_M * PROJ_N / 2 + THREADS - 1) / THREADS;  // pairs per thread
constexpr int PROJ_SUM_BATCH = PROJ_SUM_PAIRS >= 16 ? 1 : 16 / PROJ_SUM_PAIRS;
template <class F>
FN_INLINE void sum_parts(const float* base, long long part_stride, long long ld, int rows, int n0, int n_end,
                         int parts, int tid, F f) {
  float2 sum[PROJ_SUM_PAIRS];
  long long at[PROJ_SUM_PAIRS];
  bool live[PROJ_SUM_PAIRS];
#pragma unroll
  for (int u = 0; u < PROJ_SUM_PAIRS; ++u) {
    const int i = tid + u * THREADS, r = i / (PROJ_N / 2), c = n0 + (i % (PROJ_N / 2)) * 2;
    live[u] = r < rows && c < n_end;  // n_end is even
    at[u] = r * ld + c;
    sum[u] = make_float2(0.f, 0.f);
  }
  for (int j0 = 0; j0 < parts; j0 += PROJ_SUM_BATCH) {
    float2 v[PROJ_SUM_BATCH][PROJ_SUM_PAIRS];
#pragma unroll
    for (int j = 0; j < PROJ_SUM_BATCH; ++j)
#pragma unroll
      for (int u = 0; u < PROJ_SUM_PAIRS; ++u)
        v[j][u] = live[u] && j0 + j < parts
                      ? __ldcg(reinterpret_cast<const float2*>(base + (j0 + j) * part_stride + at[u]))
                      : make_float2(0.f, 0.f);
#pragma unroll
    for (int j = 0; j < PROJ_SUM_BATCH; ++j)
#pragma unroll
      for (int u = 0; u < PROJ_SUM_PAIRS; ++u) {
        sum[u].x += v[j][u].x;
        sum[u].y += v[j][u].y;
      }
  }
#pragma unroll
  for (int u = 0; u < PROJ_SUM_PAIRS; ++u)
    if (live[u]) f(at[u], sum[u]);
}

// Q task t (tile-major: the first heads' tiles first): part s of qraw's columns [n0, n0 + PROJ_N), float32.
FN_INLINE void project_q_part(const Params& p, int task, int warp, int lane, int tid) {
  const int parts = proj_q_parts(p), tile = task / parts, s = task - tile * parts;
  const int n_all = p.heads * HEAD_DIM, n0 = tile * PROJ_N, rows = (int)proj_rows(p);
  const int k0 = s * PROJ_PART_K, k1 = min(p.model_dim, k0 + PROJ_PART_K);
  float acc[PROJ_WARP_MTILES][PROJ_N / 8][4];
  proj_gemm(p.x, p.model_dim, rows, p.wq + (long long)n0 * p.model_dim, p.model_dim, min(PROJ_N, n_all - n0), k0,
            k1, acc, warp, lane, tid);
  float* parts_base = proj_q_partials(p);
  proj_for_each_pair(acc, rows, warp, lane, [&](int r, int c, float2 v) {
    if (n0 + c < n_all) __stcg(reinterpret_cast<float2*>(parts_base + (s * proj_rows(p) + r) * p.q_ld + n0 + c), v);
  });
  if (publish_and_count(proj_q_done(p) + tile, tid) != parts - 1) return;
  __threadfence();  // the other parts, published before their counts, are read below
  float* qraw = const_cast<float*>(p.qraw);
  sum_parts(parts_base, proj_rows(p) * p.q_ld, p.q_ld, rows, n0, n_all, parts, tid,
            [&](long long at, float2 sum) { __stcg(reinterpret_cast<float2*>(qraw + at), sum); });
  publish_and_count(p.proj_flags + tile, tid);
}

// This CTA's Q tasks, dealt from the last CTA down (every attention item waits for some of them).
FN_INLINE void project_q_parts(const Params& p, int warp, int lane, int tid) {
  for (int t = gridDim.x - 1 - blockIdx.x; t < proj_q_tiles(p) * proj_q_parts(p); t += gridDim.x)
    project_q_part(p, t, warp, lane, tid);
}

// Before a head's first step (every thread): wait until the Q tiles holding the head's columns are summed.
FN_INLINE void wait_for_q_tiles(const Params& p, int head, int tid) {
  const int first = head * HEAD_DIM / PROJ_N, last = ((head + 1) * HEAD_DIM - 1) / PROJ_N;
  for (int t = first; t <= last; ++t) wait_until_at_least(p.proj_flags + t, 1, tid);
}

// After a head's last step of an item: the item's o columns of that head are written (every thread's stores).
FN_INLINE void count_head_done(const Params& p, int head, int tid) {
  publish_and_count(proj_heads_done(p) + head, tid);
}

// Out task t (part-major: the parts over the first heads' columns first): part s of [o, 1, 0..] @ [Wo, bo, 0..]^T
// for y's columns [n0, n0 + PROJ_N), a float32 partial; the part that completes the tile writes y = x + the tile's
// partials summed in part order, rounded once. o is the stage's output (p.y, y_ld = o's columns = K).
FN_INLINE void project_out_part(const Params& p, int task, int warp, int lane, int tid, bool& bad) {
  const int D = p.model_dim, tiles = proj_out_tiles(p), s = task / tiles, tile = task - s * tiles;
  const int n0 = tile * PROJ_N, rows = (int)proj_rows(p), K = (int)p.y_ld, attn_cols = p.heads * HEAD_DIM;
  const int k0 = s * PROJ_PART_K, k1 = min(K, k0 + PROJ_PART_K);
  const int items_per_head = p.batch * p.row_blocks * (KV_CHUNKED ? p.kv_chunks : 1);
  const int* done = proj_heads_done(p);
  for (int h = k0 / HEAD_DIM; h < p.heads && h * HEAD_DIM < k1; ++h) wait_until_at_least(done + h, items_per_head, tid);
  if (k1 > attn_cols) wait_until_at_least(done, items_per_head, tid);  // the ones column: head 0's items write it
  float acc[PROJ_WARP_MTILES][PROJ_N / 8][4];
  proj_gemm(p.y, p.y_ld, rows, p.wo + (long long)n0 * K, K, min(PROJ_N, D - n0), k0, k1, acc, warp, lane, tid);
  float* partials = proj_out_partials(p);
  proj_for_each_pair(acc, rows, warp, lane, [&](int r, int c, float2 v) {
    if (n0 + c < D) __stcg(reinterpret_cast<float2*>(partials + (s * proj_rows(p) + r) * D + n0 + c), v);
  });
  const int parts = proj_out_parts(p);
  if (publish_and_count(proj_out_done(p) + tile, tid) != parts - 1) return;
  __threadfence();  // the other parts' partials, published before their counts, are read below
  sum_parts(partials, proj_rows(p) * D, D, rows, n0, D, parts, tid, [&](long long at, float2 sum) {
    const u32 xr = *reinterpret_cast<const u32*>(p.x + at);
    const u32 out = pack2_elem(lo_to_f32(xr) + sum.x, hi_to_f32(xr) + sum.y);
    if constexpr (CHECK_NUMERICS) bad |= pair_not_finite(out);
    *reinterpret_cast<u32*>(p.y_out + at) = out;
  });
}

// Out tasks from the queue until it is empty (a CTA whose attention items ran out early takes more of them).
FN_INLINE void project_out_parts(const Params& p, int warp, int lane, int tid, bool& bad) {
  const int tasks = proj_out_tiles(p) * proj_out_parts(p);
  for (;;) {
    const int t = publish_and_count(proj_out_next(p), tid);  // (publishes nothing: one atomic, shared)
    if (t >= tasks) return;
    project_out_part(p, t, warp, lane, tid, bad);
  }
}

// The last CTA to leave zeroes p.proj_flags for the next launch (every CTA has read its last flag before leaving).
FN_INLINE void proj_leave(const Params& p, int tid) {
  __syncthreads();
  if (tid != 0) return;
  const int words = 2 * proj_q_tiles(p) + p.heads + proj_out_tiles(p) + 1;
  __threadfence();
  if (atomicAdd(p.proj_flags + words, 1) == (int)gridDim.x - 1) {
    for (int i = 0; i <= words; ++i) p.proj_flags[i] = 0;
  }
}

