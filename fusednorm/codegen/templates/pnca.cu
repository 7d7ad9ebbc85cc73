// Pre-norm cross-attention: y = x + MHA(norm(x) split into heads, k, v), and the attention stage of the projection
// plan (fusednorm/plans): with Q_FROM_QRAW the queries come from qraw = x @ Wq'^T (float32, the norm folded into Wq',
// so q = rstd * (qraw - mean * u) + b'), and with WRITE_O the kernel writes o (no residual; the out GEMM adds it),
// plus, when asked, a ones column after the last head that carries bo through the out GEMM, and a copy of x (the
// statistics pass reads every element of x once: storing it there costs no read).
//
// A CTA works through work items (batch b, a block of BLOCK_M query rows, a group of heads), dealt round-robin over
// a persistent grid, so the result never depends on the grid size. The CTA's whole share is one flat sequence of
// steps (item, head, key tile), and a cp.async pipeline STAGES deep runs ahead along it, across heads and items:
// each stage brings one K and one V tile, and a head's first stage also brings that head's slice of x and its
// norm parameters. Per item, each warp computes its rows' statistics over the full model dim (sums on the tensor
// cores; rows with |mean| >> std exactly, by Welford: see row_statistics). Per head: Q = norm(x slice), rounded to
// the element type once (as eager rounds the norm's output), then FlashAttention-2 style attention over every key
// (mma.sync m16n8k16, online softmax in exp2, the scale applied to the fp32 scores inside the exponent's FFMA), then
// y = x + o for that head's columns, rounded once, staged in the x slice for 16-byte stores.
// With ONE_TILE (the run-time choice makes it so only when Lk <= BLOCK_N) a head is one step: its accumulators
// live within the step, so none of them is carried around the loop (fewer registers, more warps per SM), and the
// online-softmax rescale disappears.
// With USE_WGMMA (sm_90) QK^T and P V run on the warpgroup mma: each group of 4 warps issues one 64-row wgmma per
// k-step, A (Q, then P) from registers, B (K, then V) read by the tensor cores straight from the stage, which then
// holds K and V in the 128-byte-swizzle layout wgmma reads instead of padded rows. No K/V fragments pass through
// registers; the row sums of P come from P times a block of ones: 8 more columns of the P V wgmma (ROWSUM_IN_PV,
// d = 64), or a third, narrow wgmma.
// With USE_TMA (the sm_90 wgmma tiles, and d = 40's few-key tile: see DENSE_ROWS) the first lanes of warps 0-2
// fill a stage with bulk tensor copies (K and V, and on a head's first stage its x slice when needed, through the
// tensor maps in TmaMaps) that complete on the stage's mbarrier, instead of every thread issuing 16-byte copies:
// the x slice then lies in the same layout as K and V (see x_elem_offset); and each warp's y rows, staged there,
// leave by one bulk tensor store.
// USE_TMA without USE_WGMMA (DENSE_ROWS: sm_90, head dims of an odd number of 16-byte chunks, i.e. d = 40) fills
// the mma.sync tiles the same way: the copies write rows back to back (80 bytes at d = 40), which an ldmatrix reads
// without bank conflicts because 5 chunks per row put any 8 consecutive rows on distinct banks. With d = 40 the last
// k-step of QK^T is m16n8k8 (columns 32..39): no pad column is ever read, so none is stored or zeroed.
// Each warp owns 16 * M_TILES query rows. With KEY_SPLIT > 1 (few query rows, e.g. decode) the warps share the
// same 16 rows and split each K/V stage between them; their partial softmax states are merged in a fixed order.
// When (batch, head) pairs are too few to fill the GPU (decode at small batch), the key tiles of each pair are
// also split into kv_chunks runs, one work item each (KV_CHUNKED): each CTA leaves its merged partial state in
// p.part, and the CTA that finishes a pair's last chunk merges them in chunk order and writes y.
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
  u16* x_copy;         // [B, Lq, D] or null (WRITE_O only): x, written by the statistics pass as the out GEMM's C,
                       // which adds the residual in place: the plan then needs no copy kernel (one read of x fewer)
  float* part;         // [B * row_blocks * H][kv_chunks][16][PART_ROW]: chunks' partial states (kv_chunks > 1)
  int* tickets;        // [B * row_blocks * H], zero between launches: chunks of a pair done (kv_chunks > 1)
  long long k_sb, k_sh, k_sl;
  long long v_sb, v_sh, v_sl;
  long long m_sb, m_sh, m_sq;  // the key stride is 1 (run_kernel makes it so)
  long long q_ld, y_ld;        // row strides of qraw and y, in elements
  int batch, q_len, kv_len, heads, model_dim;
  int heads_per_item, head_groups, row_blocks, items;
  int ones_col;                // WRITE_O: also write [1, 0 x 7] at column H * d of every row
  int kv_chunks, chunk_tiles;  // KV_CHUNKED: runs of key tiles per (batch, row block, head), key tiles per run
  float eps;
  float scale_log2;            // the softmax scale times log2(e): scores are exponentiated as exp2(s * scale_log2 - m)
};
static_assert(sizeof(Params) == 256, "Params must match the packing in fusednorm/codegen/launch.py");

// The kernel's second argument: tensor maps of x [B, Lq, D], k and v [B, H, Lk, d] as strided (USE_TMA only; every
// kernel takes the argument, so that all launch alike), and of y [B, Lq, y_ld]. Boxes of 64 columns by BLOCK_M
// rows (x), KV_ROWS keys (k, v) or ROWS_PER_WARP rows (y: each warp stores its own rows).
struct TmaMaps {
  TensorMap x, k, v, y;
};
static_assert(sizeof(TmaMaps) == 512, "TmaMaps must match fusednorm/codegen/launch.py");

constexpr int THREADS = WARPS * 32;
constexpr int HEAD_DIM_PAD = (HEAD_DIM + 15) / 16 * 16;  // QK^T runs in k-steps of 16, d = 40's last one of 8
constexpr int ROW_STRIDE = HEAD_DIM_PAD + 8;             // +16 bytes: the 8 rows of an ldmatrix hit distinct banks
constexpr int CHUNKS = HEAD_DIM / 8;                     // 16-byte chunks per head row
constexpr bool LAST_KSTEP_K8 = HEAD_DIM % 16 != 0;       // QK^T's last k-step covers 8 columns (m16n8k8)
constexpr bool DENSE_ROWS = USE_TMA && !USE_WGMMA;       // K/V stages and x slots: unpadded rows, as bulk-copied
constexpr bool NEEDS_X_SLICE = !Q_FROM_QRAW || !WRITE_O;  // for the norm of Q, or for the residual
constexpr int ROWS_PER_WARP = 16 * M_TILES;
constexpr int BLOCK_M = KEY_SPLIT > 1 ? ROWS_PER_WARP : WARPS * ROWS_PER_WARP;
constexpr int KV_ROWS = BLOCK_N * KEY_SPLIT;             // keys per pipeline stage
constexpr int QK_KSTEPS = HEAD_DIM_PAD / 16;
constexpr int S_NTILES = BLOCK_N / 8;
constexpr int O_NTILES = HEAD_DIM / 8;
// ROWSUM_IN_PV: the P V wgmma also sums each row of P, as 8 more columns of O read from a block of ones: o holds
// one more n-tile (the row sums l, rescaled with o), and no separate row-sum wgmma is issued.
constexpr int O_ACC_NTILES = O_NTILES + (ROWSUM_IN_PV ? 1 : 0);
constexpr int PV_KSTEPS = BLOCK_N / 16;
constexpr bool KV_CHUNKED = KEY_SPLIT > 1;  // the key-split tiles may also split a head's keys between CTAs
constexpr int PART_ROW = HEAD_DIM + 4;      // floats per row of a chunk's partial state: o, then m and l, padded
static_assert(KEY_SPLIT == 1 || (KEY_SPLIT == WARPS && M_TILES == 1), "key split shares one m-tile");
static_assert(!ONE_TILE || KEY_SPLIT == 1, "one tile per head: every warp sees all keys");
static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 8 == 0, "tile shape");
static_assert(!USE_WGMMA || (M_TILES == 1 && KEY_SPLIT == 1 && WARPS % 4 == 0 && HEAD_DIM % 64 == 0 && !Q_IN_SMEM),
              "wgmma: warps in whole warpgroups, one m-tile each, rows of whole 128-byte swizzle blocks");
static_assert(!DENSE_ROWS || (CHUNKS % 2 == 1 && KEY_SPLIT == 1 && !Q_IN_SMEM),
              "unpadded rows: an odd number of 16-byte chunks per row keeps an ldmatrix's 8 rows on distinct banks");

// Shared memory, in bytes: K stages, V stages, (USE_WGMMA only) the ones of the row sums, (Q_IN_SMEM only) one Q
// tile per warp, STAGES x-slice slots (a head's x slice lives from its first stage to its epilogue, which also
// stages y there), per-row statistics, (key split only) the warps' partial row sums and the m and l of their
// partial softmax states, STAGES slots for a head's norm parameters (gamma and beta, or u and b'), and (USE_TMA
// only) the stage barriers. The key split merges the warps' partial o in the K and V tiles of the stage the head's
// last step has just read (see combine_and_store): no buffer of its own, which leaves room for wider stages.
constexpr bool AFFINE_WIDE = Q_FROM_QRAW || AFFINE_IS_F32;  // fp32 parameters, else two 16-bit ones per register
constexpr bool HAS_SCALE_VEC = Q_FROM_QRAW ? !NORM_IS_RMS : HAS_GAMMA;  // gamma, or u
constexpr bool HAS_SHIFT_VEC = Q_FROM_QRAW || HAS_BETA;                 // beta, or b'
constexpr int AFFINE_SLOT_BYTES = (HAS_SCALE_VEC || HAS_SHIFT_VEC) ? 2 * HEAD_DIM * (AFFINE_WIDE ? 4 : 2) : 0;
// K/V rows: padded (ROW_STRIDE) for ldmatrix, unpadded (DENSE_ROWS), or with KV_SWIZZLED (every USE_WGMMA tile,
// and the key-split tiles of d = 64 and 128: spec.kv_swizzled) 64-element column blocks of KV_ROWS rows of 128
// bytes each, 16-byte chunk c of row r at chunk c ^ (r % 8) (with USE_WGMMA each stage starts on a 1024-byte
// boundary).
constexpr int KV_ROW_ELEMS = KV_SWIZZLED ? 64 : DENSE_ROWS ? HEAD_DIM : ROW_STRIDE;  // one row (of a column block)
constexpr int KV_TILE_ELEMS = KV_ROWS * (KV_SWIZZLED || DENSE_ROWS ? HEAD_DIM : ROW_STRIDE);
constexpr int KV_ROW_BYTES = KV_ROW_ELEMS * 2;
static_assert(!USE_WGMMA || KV_SWIZZLED, "wgmma reads the swizzled layout");
static_assert(!KV_SWIZZLED || HEAD_DIM % 64 == 0, "swizzled rows are whole 64-column blocks");
constexpr int Q_TILE_ELEMS = ROWS_PER_WARP * ROW_STRIDE;
constexpr int X_ROW_ELEMS = DENSE_ROWS ? HEAD_DIM : USE_TMA ? 64 : ROW_STRIDE;  // one row of an x slot to the next
// USE_TMA: a bulk copy moves TMA_BOX_COLS columns (a 128-byte swizzle block, or a whole unpadded row)
constexpr int TMA_BOX_COLS = DENSE_ROWS ? HEAD_DIM : 64;
constexpr int TMA_BOXES = HEAD_DIM / TMA_BOX_COLS;
constexpr int X_TILE_ELEMS = BLOCK_M * (USE_TMA ? HEAD_DIM : ROW_STRIDE);
constexpr int OFF_K = 0;
constexpr int OFF_V = OFF_K + STAGES * KV_TILE_ELEMS * 2;
// USE_WGMMA: ones, the B of the row sums: 1 KB (16 keys x 8 columns, K-major), or with ROWSUM_IN_PV a block the
// size of a 64-column V tile (KV_ROWS keys of 128 bytes), which P V reads as its columns 64..71
constexpr int ONES_BYTES = !USE_WGMMA ? 0 : ROWSUM_IN_PV ? KV_ROWS * 128 : 1024;
constexpr int OFF_ONES = OFF_V + STAGES * KV_TILE_ELEMS * 2;
constexpr int OFF_Q = OFF_ONES + ONES_BYTES;
constexpr int OFF_X = OFF_Q + (Q_IN_SMEM ? WARPS * Q_TILE_ELEMS * 2 : 0);
constexpr int OFF_STATS = OFF_X + STAGES * X_TILE_ELEMS * 2;
constexpr int OFF_STAT_PARTS = OFF_STATS + WARPS * ROWS_PER_WARP * 2 * 4;
constexpr int OFF_MERGE_STATS = OFF_STAT_PARTS + (KEY_SPLIT > 1 ? WARPS * 16 * 2 * 4 : 0);  // key split: m and l
constexpr int OFF_AFFINE = OFF_MERGE_STATS + (KEY_SPLIT > 1 ? WARPS * 16 * 2 * 4 : 0);
constexpr int OFF_BARS = OFF_AFFINE + STAGES * AFFINE_SLOT_BYTES;  // USE_TMA: one mbarrier per stage
static_assert(OFF_BARS + (USE_TMA ? STAGES * 8 : 0) <= SMEM_BYTES, "launch.py's shared-memory size is too small");
// key split: the first half of the warps' partial o in a K tile, the second half in a V tile
constexpr int COMBINE_K_WARPS = (WARPS + 1) / 2;
static_assert(KEY_SPLIT == 1 || COMBINE_K_WARPS * 16 * HEAD_DIM * 4 <= KV_TILE_ELEMS * 2,
              "the key split's merge fits one K tile and one V tile");
constexpr int TMA_ALIGN = DENSE_ROWS ? 128 : 1024;  // bulk copies' shared addresses (swizzled: the pattern's period)
static_assert(!USE_TMA || WARPS >= 4, "bulk copies: warps 0-2 issue them, the last warp copies the norm parameters");
static_assert(!USE_TMA || (OFF_X % TMA_ALIGN == 0 && X_TILE_ELEMS * 2 % TMA_ALIGN == 0 && OFF_BARS % 8 == 0 &&
                           KV_TILE_ELEMS * 2 % TMA_ALIGN == 0 && OFF_V % TMA_ALIGN == 0 &&
                           ROWS_PER_WARP * X_ROW_ELEMS * 2 % (DENSE_ROWS ? 128 : 1) == 0),
              "bulk copies start on aligned shared addresses (swizzled slots: 1024-byte boundaries)");

extern __shared__ __align__(1024) u8 smem[];  // carved up as above; named here so that helpers address it directly

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

// Element offset of 16-byte chunk c of row r in an x slot, from the warp's first row (a multiple of 8): padded or
// (DENSE_ROWS) unpadded rows, or with the wgmma tiles' USE_TMA 64-element column blocks of BLOCK_M rows of 128
// bytes, chunk c of row r at chunk c ^ (r % 8).
FN_INLINE int x_elem_offset(int r, int c) {
  if constexpr (USE_TMA && !DENSE_ROWS) return (c >> 3) * (BLOCK_M * 64) + r * 64 + (((c & 7) ^ (r & 7)) << 3);
  return r * X_ROW_ELEMS + c * 8;
}

// The same layout as a byte address: the pair (row r, columns nt * 8 + t2 + {0, 1}) of an x slot that starts at
// tile (a shared address). The swizzle becomes one XOR per access: the slot starts on a 1024-byte boundary, so
// bits 4-6 of every row's start are free for the 16-byte chunk index, which the swizzle XORs with r % 8.
FN_INLINE u32 x_pair_addr(u32 tile, int r, int nt, int t2) {
  if constexpr (USE_TMA && !DENSE_ROWS)
    return (tile + (nt >> 3) * (BLOCK_M * 128) + r * 128 + ((r & 7) << 4) + t2 * 2) ^ ((nt & 7) << 4);
  return tile + (r * X_ROW_ELEMS + nt * 8 + t2) * 2;
}

// ---- 1. row statistics (one warp, its own rows) ----

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

// ---- 2. the Q fragments of one head: norm(x slice), rounded to the element type (one warp, its own rows) ----

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

// ---- K/V stage loads (whole CTA) ----

// Element offset of 16-byte chunk c of row r in a swizzled K/V stage (see KV_SWIZZLED). Padded stages keep their
// address expressions written out where they are used: routed through one helper, ptxas scheduled the padded
// kernels differently (SD 1.5's few-key kernel grew by 80 instructions).
FN_INLINE int kv_swizzled_offset(int r, int c) { return ((c / 8) * KV_ROWS + r) * 64 + ((c % 8) ^ (r % 8)) * 8; }

// Copies are 16-byte chunks. Thread tid always copies chunk tid % CHUNKS of rows tid / CHUNKS + i * COPY_ROWS, so the
// row and column offsets are worked out once per tile and each further row costs one pointer add (threads past
// COPY_ROWS * CHUNKS have no chunk and return at once).
constexpr int COPY_ROWS = THREADS / CHUNKS;  // rows the CTA copies per pass

// Keys [key_base, key_base + KV_ROWS) of one head into a stage. Rows up to the next multiple of 16 past Lk are
// zero-filled (the mma k-steps read them); rows beyond that are never read and are not touched, except with
// USE_WGMMA, whose P V runs every k-step of the stage (a branch around a wgmma makes ptxas serialize them all).
FN_INLINE void load_kv_tile(const Params& p, int b, int head, int key_base, u16* k_stage, u16* v_stage, int tid) {
  const int r0 = tid / CHUNKS, c = (tid % CHUNKS) * 8;
  if (r0 >= COPY_ROWS) return;
  const int kv_pad16 = (p.kv_len + 15) & ~15;
  const u16* k_head = p.k + b * p.k_sb + head * p.k_sh;
  const u16* v_head = p.v + b * p.v_sb + head * p.v_sh;
  const u16* kp = k_head + (key_base + r0) * p.k_sl + c;
  const u16* vp = v_head + (key_base + r0) * p.v_sl + c;
  const long long k_step = COPY_ROWS * p.k_sl, v_step = COPY_ROWS * p.v_sl;
  // swizzled: rows r0 + i * COPY_ROWS share r0 % 8, so one offset serves every row of this thread
  static_assert(!KV_SWIZZLED || COPY_ROWS % 8 == 0, "swizzled stages: a thread's rows share their swizzle");
  const u32 dst_off = KV_SWIZZLED ? kv_swizzled_offset(r0, c / 8) * 2 : (r0 * ROW_STRIDE + c) * 2;
  const u32 k_dst = smem_addr(k_stage) + dst_off, v_dst = smem_addr(v_stage) + dst_off;
#pragma unroll
  for (int i = 0; i < (KV_ROWS + COPY_ROWS - 1) / COPY_ROWS; ++i) {
    const int r = r0 + i * COPY_ROWS, key = key_base + r;
    if ((KV_ROWS % COPY_ROWS == 0 || r < KV_ROWS) && (USE_WGMMA || key < kv_pad16)) {
      const bool in_range = key < p.kv_len;  // else: zero-fill, reading nothing (the head's base stands in)
      cp_async16(k_dst + i * COPY_ROWS * KV_ROW_BYTES, in_range ? kp : k_head, in_range ? 16 : 0);
      cp_async16(v_dst + i * COPY_ROWS * KV_ROW_BYTES, in_range ? vp : v_head, in_range ? 16 : 0);
    }
    kp += k_step;
    vp += v_step;
  }
}

// The head's norm parameters into its slot: [gamma | beta] (or [u | b'] with Q_FROM_QRAW), d values each, as
// stored (fp32, or x's type). Slices start at head * d, a multiple of 16 bytes (d is a multiple of 8). copier: the
// thread's place among the CTA's threads in copying (0 copies the first chunk).
FN_INLINE void load_affine_slot(const Params& p, int head, u8* slot, int copier) {
  if constexpr (AFFINE_SLOT_BYTES == 0) return;
  constexpr int VEC_BYTES = AFFINE_SLOT_BYTES / 2, VEC_CHUNKS = VEC_BYTES / 16;
#pragma unroll
  for (int i0 = 0; i0 < 2 * VEC_CHUNKS; i0 += THREADS) {
    const int i = i0 + copier;
    if ((2 * VEC_CHUNKS) % THREADS != 0 && i >= 2 * VEC_CHUNKS) break;
    const bool second = i >= VEC_CHUNKS;
    const void* vec = !second ? (Q_FROM_QRAW ? static_cast<const void*>(p.q_u) : p.gamma)
                              : (Q_FROM_QRAW ? static_cast<const void*>(p.q_b) : p.beta);
    if (vec != nullptr)  // absent (RMS without gamma or u, LayerNorm without beta): never read
      cp_async16(smem_addr(slot + i * 16), static_cast<const u8*>(vec) + head * VEC_BYTES + (i % VEC_CHUNKS) * 16, 16);
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

// ---- 4. epilogue: y = x + o (or o alone, WRITE_O) for one head's columns ----

// The chunk [1, 0, ..., 0] after the last head's columns: bo rides through the out GEMM as one more K column.
FN_INLINE void store_ones_chunk(const Params& p, u16* y_batch, int q) {
  st_global16_stream(y_batch + (long long)q * p.y_ld + p.heads * HEAD_DIM, u32x4{pack2_elem(1.f, 0.f), 0u, 0u, 0u});
}

// The warp's rows of y, staged in its x slice, to global memory in 16-byte stores (rows past Lq are skipped).
FN_INLINE void store_staged_rows(const Params& p, u16* y_batch, int row0, int col0, const u16* x_tile, int lane) {
  constexpr int TOTAL = ROWS_PER_WARP * CHUNKS;
  if constexpr (32 % CHUNKS == 0) {  // each pass covers whole rows: one pointer, stepped (d = 32, 64, 128, 256)
    constexpr int PASS_ROWS = 32 / CHUNKS;
    const int r0 = lane / CHUNKS, c = (lane % CHUNKS) * 8;
    u16* yp = y_batch + (long long)(row0 + r0) * p.y_ld + col0 + c;
    const long long step = (long long)PASS_ROWS * p.y_ld;
    const int rows_left = p.q_len - row0 - r0;
#pragma unroll
    for (int it = 0; it < ROWS_PER_WARP / PASS_ROWS; ++it, yp += step)
      if (it * PASS_ROWS < rows_left)
        st_global16_stream(yp, *reinterpret_cast<const u32x4*>(x_tile + x_elem_offset(r0 + it * PASS_ROWS, c / 8)));
  } else {
#pragma unroll
    for (int it = 0; it < (TOTAL + 31) / 32; ++it) {
      const int i = lane + it * 32;
      const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
      if ((TOTAL % 32 == 0 || i < TOTAL) && row0 + r < p.q_len) {
        st_global16_stream(y_batch + (long long)(row0 + r) * p.y_ld + col0 + c,
                           *reinterpret_cast<const u32x4*>(x_tile + x_elem_offset(r, c / 8)));
      }
    }
  }
}

// One warp, its own rows. x comes from the head's x slice in shared memory, and y overwrites it there (each element
// is read and written by the same thread) so that the global stores are 16 bytes wide, or with USE_TMA one bulk
// tensor store per 64 columns, issued by lane 0 (rows past Lq are clipped by the map; the main loop waits for the
// store to have read the slot before the slot is refilled). A thread's x pairs are loaded (up to 8 n-tiles at a
// time) before its first y pair is stored, so the loads overlap.
FN_INLINE void store_output_rows(const Params& p, const TmaMaps& maps, int b, u16* y_batch, int row0, int col0,
                                 const float (&o)[M_TILES][O_ACC_NTILES][4], const float (&l)[M_TILES][2], u16* x_tile,
                                 int lane, bool& bad) {
  const int g = lane >> 2, t2 = (lane & 3) * 2;
  const u32 tile = smem_addr(x_tile);
  constexpr int GROUP = O_NTILES < 8 ? O_NTILES : 8;  // n-tiles whose x is loaded at once (d = 256: 4 groups)
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
    float inv[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) inv[half] = l[mt][half] > 0.f ? fast_rcp(l[mt][half]) : 0.f;  // masked: 0
#pragma unroll
    for (int n0 = 0; n0 < O_NTILES; n0 += GROUP) {
      u32 xv[2][GROUP];
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int j = 0; j < GROUP && n0 + j < O_NTILES; ++j)  // +0.0 pairs with WRITE_O: o alone
          xv[half][j] = WRITE_O ? 0u : ld_shared4(x_pair_addr(tile, mt * 16 + g + half * 8, n0 + j, t2));
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mt * 16 + g + half * 8;
        if (row0 + r >= p.q_len) continue;  // also keeps ptxas from interleaving all of d = 256's n-tiles (spills)
#pragma unroll
        for (int j = 0; j < GROUP && n0 + j < O_NTILES; ++j) {
          const int nt = n0 + j;
          const u32 yp = pack2_elem(fmaf(o[mt][nt][2 * half], inv[half], lo_to_f32(xv[half][j])),
                                    fmaf(o[mt][nt][2 * half + 1], inv[half], hi_to_f32(xv[half][j])));
          if constexpr (CHECK_NUMERICS) bad |= pair_not_finite(yp);
          st_shared4(x_pair_addr(tile, r, nt, t2), yp);
        }
      }
    }
  }
  if constexpr (USE_TMA) {
    fence_proxy_async();  // the y just written, visible to the copy engine
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int cb = 0; cb < TMA_BOXES; ++cb)
        tma_store_3d(&maps.y, smem_addr(x_tile + cb * BLOCK_M * TMA_BOX_COLS), col0 + cb * TMA_BOX_COLS, row0, b);
      bulk_commit();
    }
  } else {
    __syncwarp();
    store_staged_rows(p, y_batch, row0, col0, x_tile, lane);
  }
  if (WRITE_O && p.ones_col && col0 == 0)
    for (int r = lane; r < ROWS_PER_WARP && row0 + r < p.q_len; r += 32) store_ones_chunk(p, y_batch, row0 + r);
  __syncwarp();
}

// y = x + f / total for 8 columns of row r (o alone with WRITE_O), rounded once, streamed out.
FN_INLINE void store_merged_chunk(const Params& p, const u16* x_tile, u16* y_batch, int r, int c, int q, int col0,
                                  float (&f)[8], float total, bool& bad) {
  const float inv = total > 0.f ? 1.f / total : 0.f;
  float xf[8];
  unpack8(WRITE_O ? u32x4{0u, 0u, 0u, 0u} : *reinterpret_cast<const u32x4*>(x_tile + x_elem_offset(r, c / 8)), xf);
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = xf[e] + f[e] * inv;
  const u32x4 out = pack8(f);
  if constexpr (CHECK_NUMERICS) bad |= chunk_not_finite(out);
  st_global16_stream(y_batch + (long long)q * p.y_ld + col0 + c, out);
}

// KV_CHUNKED with kv_chunks > 1: this CTA's partial state of a (batch, row block, head) is in p.part; the CTA
// that takes the pair's last ticket merges every chunk's state in chunk order (deterministic) and writes y.
FN_INLINE void merge_key_chunks(const Params& p, const float* unit_part, int* ticket, const u16* x_tile,
                                u16* y_batch, int row0, int col0, int tid, bool& bad) {
  int* is_last = reinterpret_cast<int*>(smem + OFF_MERGE_STATS);  // the warps' m, read by now
  __threadfence();  // this thread's partial state is visible device-wide before the CTA takes its ticket
  __syncthreads();
  if (tid == 0) {
    *is_last = atomicAdd(ticket, 1) == p.kv_chunks - 1;
    if (*is_last) *ticket = 0;  // every chunk has taken its ticket: zero again for the next launch
  }
  __syncthreads();
  if (!*is_last) return;
  __threadfence();  // the other chunks' states, written before their tickets
#pragma unroll 1
  for (int i = tid; i < 16 * CHUNKS; i += THREADS) {
    const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
    const int q = row0 + r;
    if (q >= p.q_len) continue;
    const float* row = unit_part + r * PART_ROW;  // chunk j's row r at row + j * 16 * PART_ROW
    float m_max = neg_inf();
    for (int j = 0; j < p.kv_chunks; ++j) m_max = fmaxf(m_max, __ldcg(row + j * 16 * PART_ROW + HEAD_DIM));
    const float m_use = m_max == neg_inf() ? 0.f : m_max;
    float total = 0.f, f[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = 0.f;
    for (int j = 0; j < p.kv_chunks; ++j) {
      const float* chunk_row = row + j * 16 * PART_ROW;
      const float wt = fast_exp2(__ldcg(chunk_row + HEAD_DIM) - m_use);  // 0 for a chunk whose keys are all masked
      total += wt * __ldcg(chunk_row + HEAD_DIM + 1);
      const float4 lo = __ldcg(reinterpret_cast<const float4*>(chunk_row + c));
      const float4 hi = __ldcg(reinterpret_cast<const float4*>(chunk_row + c + 4));
      const float part[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = fmaf(wt, part[e], f[e]);
    }
    store_merged_chunk(p, x_tile, y_batch, r, c, q, col0, f, total, bad);
  }
  if (WRITE_O && p.ones_col && col0 == 0 && tid < 16 && row0 + tid < p.q_len) store_ones_chunk(p, y_batch, row0 + tid);
}

// Key split: every warp holds a partial (m, l, o) for the same 16 rows; merge them in warp order (deterministic).
// The partial o go to the K and V tiles of the stage this step has read (k_tile, v_tile): once every warp is past
// its reads, nothing else touches that stage until the next step's barrier, after which it is refilled.
// With keys split between CTAs, ``unit`` numbers the (batch, row block, head) and ``chunk`` the run of keys.
FN_INLINE void combine_and_store(const Params& p, long long unit, int chunk, const u16* x_tile, u16* y_batch, int row0,
                                 int col0, const float (&o)[M_TILES][O_ACC_NTILES][4], const float (&m)[M_TILES][2],
                                 const float (&l)[M_TILES][2], u16* k_tile, u16* v_tile, int warp, int lane, int tid,
                                 bool& bad) {
  float* acc_k = reinterpret_cast<float*>(k_tile);                  // [COMBINE_K_WARPS][16][HEAD_DIM]
  float* acc_v = reinterpret_cast<float*>(v_tile);                  // [the other warps][16][HEAD_DIM]
  float* m_all = reinterpret_cast<float*>(smem + OFF_MERGE_STATS);  // [WARPS][16]
  float* l_all = m_all + WARPS * 16;                                // [WARPS][16]
  const auto rows_of = [&](int w) {  // warp w's 16 rows of partial o
    return w < COMBINE_K_WARPS ? acc_k + w * 16 * HEAD_DIM : acc_v + (w - COMBINE_K_WARPS) * 16 * HEAD_DIM;
  };
  const bool chunked = KV_CHUNKED && p.kv_chunks > 1;
  float* unit_part = chunked ? p.part + unit * p.kv_chunks * 16 * PART_ROW : nullptr;
  const int g = lane >> 2, t2 = (lane & 3) * 2;
  __syncthreads();  // every warp has read the stage
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float lsum = l[0][half];
    const int r = g + half * 8;
    if (t2 == 0) {
      m_all[warp * 16 + r] = m[0][half];
      l_all[warp * 16 + r] = lsum;
    }
    float* acc_row = rows_of(warp) + r * HEAD_DIM;
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
      const float* acc_row = rows_of(w) + r * HEAD_DIM + c;
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = fmaf(wt, acc_row[e], f[e]);
    }
    if (chunked) {  // this chunk's state, o relative to m_use, for merge_key_chunks
      float* row = unit_part + (chunk * 16 + r) * PART_ROW;
      *reinterpret_cast<float4*>(row + c) = make_float4(f[0], f[1], f[2], f[3]);
      *reinterpret_cast<float4*>(row + c + 4) = make_float4(f[4], f[5], f[6], f[7]);
      if (c == 0) *reinterpret_cast<float2*>(row + HEAD_DIM) = make_float2(m_max, total);
      continue;
    }
    store_merged_chunk(p, x_tile, y_batch, r, c, q, col0, f, total, bad);
  }
  if (chunked) {
    merge_key_chunks(p, unit_part, p.tickets + unit, x_tile, y_batch, row0, col0, tid, bad);
    return;
  }
  if (WRITE_O && p.ones_col && col0 == 0 && tid < 16 && row0 + tid < p.q_len) store_ones_chunk(p, y_batch, row0 + tid);
}

// ---- the kernel ----

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
  const int group = unit % p.head_groups;
  c.row_block = (unit / p.head_groups) % p.row_blocks;
  c.b = unit / (p.head_groups * p.row_blocks);
  c.head = group * p.heads_per_item;
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

// With USE_TMA: the first lane of warp ``part`` issues one operand's bulk tensor copies (0: K, 1: V, 2: the x
// slice), TMA_BOX_COLS columns at a time (keys and rows past the tensor's end arrive as zeros), so that no warp
// carries the whole issue (every warp waits for the slowest at the step's barrier); warp 0's also arms the stage's
// barrier with all the bytes to come. A copy that lands before the barrier is armed takes its bytes off early (the
// count may go below zero): the phase cannot complete before that one arrival. A k/v dim broadcast with stride 0
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
  // K/V tiles that no other item reads (one row block, no broadcast dims) stream through L2 evict-first, so that
  // they do not push out the x rows that the other head groups' items read again (T5: 67 MB of K/V, 8 MB of x).
  // Elsewhere the copies carry no policy at all (a normal-priority one measured slower on SDXL).
  const bool kv_read_once = p.row_blocks == 1 && p.k_sb != 0 && p.k_sh != 0 && p.v_sb != 0 && p.v_sh != 0;
#pragma unroll
  for (int cb = 0; cb < TMA_BOXES; ++cb) {
    if (kv_read_once)
      tma_load_4d_hint(dst + cb * KV_BOX, map, cb * TMA_BOX_COLS, c.tile * KV_ROWS, h, b, bar, l2_evict_first());
    else
      tma_load_4d(dst + cb * KV_BOX, map, cb * TMA_BOX_COLS, c.tile * KV_ROWS, h, b, bar);
  }
}

// Issue the copies of one step into a pipeline stage (and, on a head's first step, its x slice if needed).
FN_INLINE void load_step(const Params& p, const TmaMaps& maps, const StepCursor& c, int stage, u16* k_stages,
                         u16* v_stages, u16* x_slots, u8* affine_slots, u32 bars, int tid) {
  if constexpr (USE_TMA) {
    if (tid % 32 == 0 && tid < 96) load_step_tma(p, maps, c, stage, k_stages, v_stages, x_slots, bars + stage * 8,
                                                 tid / 32);
    if (c.tile == first_tile(c))  // by the last warp's threads: warps 0-2's first lanes are busy above
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
    }
    __syncthreads();
  }

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
      if (cur.head_in_item == 0 && warp_rows) {  // a new item: statistics of this warp's rows
        const long long batch_off = (long long)cur.b * p.q_len * p.model_dim;
        // items of the later head groups hold the same rows: the first group's copies them
        u16* copy_batch = WRITE_O && p.x_copy != nullptr && cur.head == 0 ? p.x_copy + batch_off : nullptr;
        row_statistics(p, p.x + batch_off, copy_batch, row0, row_mean, row_rstd, stat_parts, warp, lane);
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
