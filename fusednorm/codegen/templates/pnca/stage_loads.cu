// The pnca kernel's stage loads by 16-byte copies (whole CTA): K/V tiles, the x slice, the norm parameters. The
// bulk copies of the USE_TMA tiles are issued from kernel.cu (load_step_tma).

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
