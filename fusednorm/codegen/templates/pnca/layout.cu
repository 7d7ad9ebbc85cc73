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
// With USE_TMA (the sm_90 wgmma tiles, and d = 40's few-key tile: see DENSE_ROWS) one thread, or in the dense tile
// the first lanes of warps 0-2 (COPY_WARPS), fill a stage with bulk tensor copies (K and V, and on a head's first
// stage its x slice when needed, through the tensor maps in TmaMaps) that complete on the stage's mbarrier, instead
// of every thread issuing 16-byte copies: the x slice then lies in the same layout as K and V (see x_elem_offset);
// and each warp's y rows, staged there, leave by one bulk tensor store.
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
// The kernel's parts follow in the files after this one in render.TEMPLATES: steps 1-4, the stage loads, and the
// kernel itself (kernel.cu).

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
  float* part;         // [B * row_blocks * H][kv_chunks][16][PART_ROW]: chunks' partial states (kv_chunks > 1);
                       // with share_stats [stat_col_groups][B * Lq]: the rows' (sum, sum of squares) per column group
  int* tickets;        // zero at the start, left zero at the end: [B * row_blocks * H], chunks of a pair done
                       // (kv_chunks > 1); with share_stats [B * row_blocks][2], items arrived and items left
  long long k_sb, k_sh, k_sl;
  long long v_sb, v_sh, v_sl;
  long long m_sb, m_sh, m_sq;  // the key stride is 1 (run_kernel makes it so)
  long long q_ld, y_ld;        // row strides of qraw and y, in elements
  int batch, q_len, kv_len, heads, model_dim;
  int heads_per_item, head_groups, row_blocks, items;
  int ones_col;                // WRITE_O: also write [1, 0 x 7] at column H * d of every row
  int stat_col_groups;         // > 1: row statistics summed in column groups, added in order (statistics.cu)
  int share_stats;             // with stat_col_groups > 1: an item sums its group's columns, takes the others' (p.part)
  int kv_chunks, chunk_tiles;  // KV_CHUNKED: runs of key tiles per (batch, row block, head), key tiles per run
  float eps;
  float scale_log2;            // the softmax scale times log2(e): scores are exponentiated as exp2(s * scale_log2 - m)
};
static_assert(sizeof(Params) == 264, "Params must match the packing in fusednorm/codegen/launch.py");

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
// Warps whose first lanes issue a stage's bulk copies (K, V, the x slice): three for the dense-row tile, whose
// mma.sync warps each carry a long chain (the tile was timed with the split: SD 1.5 -16 %); one elsewhere (the
// wgmma tiles with three measured Lk 2048 +3 %).
constexpr int COPY_WARPS = DENSE_ROWS ? 3 : 1;
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
static_assert(!USE_TMA || WARPS > COPY_WARPS, "bulk copies: warps below COPY_WARPS issue them, the last warp copies "
              "the norm parameters");
static_assert(!USE_TMA || (OFF_X % TMA_ALIGN == 0 && X_TILE_ELEMS * 2 % TMA_ALIGN == 0 && OFF_BARS % 8 == 0 &&
                           KV_TILE_ELEMS * 2 % TMA_ALIGN == 0 && OFF_V % TMA_ALIGN == 0 &&
                           ROWS_PER_WARP * X_ROW_ELEMS * 2 % (DENSE_ROWS ? 128 : 1) == 0),
              "bulk copies start on aligned shared addresses (swizzled slots: 1024-byte boundaries)");

extern __shared__ __align__(1024) u8 smem[];  // carved up as above; named here so that helpers address it directly

// ---- work items ----

// A work unit (an item less its run of keys: select.plan_launch) is (batch, row block, head group), the head group
// fastest: its batch, block of query rows and first head. (Written through references: returned as a struct, the
// same arithmetic changed the machine code of every kernel.)
FN_INLINE void unit_place(const Params& p, int unit, int& b, int& row_block, int& head0) {
  const int group = unit % p.head_groups;
  row_block = (unit / p.head_groups) % p.row_blocks;
  b = unit / (p.head_groups * p.row_blocks);
  head0 = group * p.heads_per_item;
}

// K/V tiles that no other item reads (one row block, no broadcast dims) stream through L2 evict-first, so that
// they do not push out the x rows that the other head groups' items read again (T5: 67 MB of K/V, 8 MB of x).
// Elsewhere the copies carry no policy at all (a normal-priority one measured slower on SDXL).
FN_INLINE bool kv_read_once(const Params& p) {
  return p.row_blocks == 1 && p.k_sb != 0 && p.k_sh != 0 && p.v_sb != 0 && p.v_sh != 0;
}

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
