// Copy probe (bench/probe_copies.py): the decode tile's K/V stream with nothing computed, one copy form per build.
// Each CTA streams the rows of one (batch, head) after another through STAGES shared-memory stages of ROWS K rows
// and ROWS V rows, each row a 128-byte head slice of a [B, Lk, H, 64] tensor (row stride H * 128 bytes), as the
// generated kernel's short tile does. Compiled after templates/prelude.cu (for smem_addr and the mbarrier
// helpers) with COPY_FORM, STAGES defined first:
//   0  cp.async, 16 bytes per thread, eight threads per row, with a source size (the short tile's form until 12-04)
//   1  the same with the L2::128B prefetch size (the short tile's form since 12-04)
//   2  ld.global 16 bytes per thread into registers, then st.shared (no async copy)
//   3  cp.async.bulk: one 128-byte bulk copy per row, issued by the 32 threads of warp 0, on a stage mbarrier

constexpr int THREADS = 128, ROWS = 64, ROW_BYTES = 128;
constexpr int STAGE_BYTES = 2 * ROWS * ROW_BYTES;  // K rows then V rows, unpadded: 16 KB
constexpr int CHUNKS = ROW_BYTES / 16, COPY_ROWS = THREADS / CHUNKS;

struct Stream {  // the rows of one (batch, head): K and V from row `first`, `rows` of them
  const u8* k;
  const u8* v;
  long long row_stride;  // bytes
  int first, rows;
};

FN_INLINE void cp_async16_sized(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

FN_INLINE void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Issue one stage's copies (forms 0, 1, 3; form 2 copies synchronously in the loop). Rows past the stream's end
// are zero-filled (forms 0, 1) or left as they are (form 3: nothing reads them).
FN_INLINE void issue_stage(const Stream& s, int tile, u32 stage_addr, u32 bar, int tid) {
  const int row_base = s.first + tile * ROWS;
  if constexpr (COPY_FORM == 3) {
    if (tid >= 32) return;
    const int valid = min(ROWS, s.rows - tile * ROWS);
    if (tid == 0) mbar_arrive_expect_tx(bar, 2 * valid * ROW_BYTES);
    __syncwarp();
    for (int r = tid; r < valid; r += 32) {
      bulk_copy(stage_addr + r * ROW_BYTES, s.k + (row_base + r) * s.row_stride, ROW_BYTES, bar);
      bulk_copy(stage_addr + (ROWS + r) * ROW_BYTES, s.v + (row_base + r) * s.row_stride, ROW_BYTES, bar);
    }
  } else {
    const int r0 = tid / CHUNKS, c = (tid % CHUNKS) * 16;
#pragma unroll
    for (int i = 0; i < ROWS / COPY_ROWS; ++i) {
      const int r = r0 + i * COPY_ROWS;
      const bool in_range = tile * ROWS + r < s.rows;
      const u8* kp = in_range ? s.k + (row_base + r) * s.row_stride + c : s.k;
      const u8* vp = in_range ? s.v + (row_base + r) * s.row_stride + c : s.v;
      const u32 k_dst = stage_addr + r * ROW_BYTES + c, v_dst = k_dst + ROWS * ROW_BYTES;
      if constexpr (COPY_FORM == 0) {
        cp_async16_sized(k_dst, kp, in_range ? 16 : 0);
        cp_async16_sized(v_dst, vp, in_range ? 16 : 0);
      } else {
        cp_async16(k_dst, kp, in_range ? 16 : 0);
        cp_async16(v_dst, vp, in_range ? 16 : 0);
      }
    }
  }
}

// One read of the stage per thread, folded into a register the kernel writes out, so no copy is dead.
FN_INLINE u32 touch(const u8* stage, int tid) { return reinterpret_cast<const u32*>(stage)[tid * 32 % 4096]; }

extern "C" __global__ void __launch_bounds__(THREADS) probe_copies(const u8* k, const u8* v, long long row_stride,
                                                                   long long batch_stride, int heads, int kv_len,
                                                                   int items, u32* sink) {
  extern __shared__ __align__(128) u8 smem[];
  const int tid = threadIdx.x;
  const u32 stages = smem_addr(smem), bars = stages + STAGES * STAGE_BYTES;
  if (COPY_FORM == 3 && tid == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(bars + 8 * s, 1);
    fence_mbar_init();
  }
  __syncthreads();
  const int tiles = (kv_len + ROWS - 1) / ROWS;
  u32 acc = 0, phases = 0;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int b = item / heads, h = item % heads;
    const Stream s{k + b * batch_stride + h * ROW_BYTES, v + b * batch_stride + h * ROW_BYTES, row_stride, 0,
                   kv_len};
    if constexpr (COPY_FORM == 2) {
      const int r0 = tid / CHUNKS, c = (tid % CHUNKS) * 16;
      for (int tile = 0; tile < tiles; ++tile) {
        u32x4 kr[ROWS / COPY_ROWS], vr[ROWS / COPY_ROWS];
#pragma unroll
        for (int i = 0; i < ROWS / COPY_ROWS; ++i) {
          const int row = tile * ROWS + r0 + i * COPY_ROWS;
          const bool in_range = row < kv_len;
          kr[i] = in_range ? *reinterpret_cast<const u32x4*>(s.k + row * s.row_stride + c) : u32x4{0, 0, 0, 0};
          vr[i] = in_range ? *reinterpret_cast<const u32x4*>(s.v + row * s.row_stride + c) : u32x4{0, 0, 0, 0};
        }
        __syncthreads();  // the last tile's reads are done
#pragma unroll
        for (int i = 0; i < ROWS / COPY_ROWS; ++i) {
          const int r = r0 + i * COPY_ROWS;
          *reinterpret_cast<u32x4*>(smem + r * ROW_BYTES + c) = kr[i];
          *reinterpret_cast<u32x4*>(smem + (ROWS + r) * ROW_BYTES + c) = vr[i];
        }
        __syncthreads();
        acc ^= touch(smem, tid);
      }
    } else {
      // the same pipeline as the generated kernel: STAGES - 1 stages in flight, one CTA barrier per stage
      for (int t = 0; t < STAGES - 1; ++t) {
        if (t < tiles) issue_stage(s, t, stages + t * STAGE_BYTES, bars + 8 * t, tid);
        cp_async_commit();
      }
      for (int tile = 0; tile < tiles; ++tile) {
        const int stage = tile % STAGES;
        if constexpr (COPY_FORM == 3) {
          mbar_wait(bars + 8 * stage, (phases >> stage) & 1u);
          phases ^= 1u << stage;
        } else {
          cp_async_wait<STAGES - 2>();
        }
        __syncthreads();  // this stage is visible; the stage refilled below was read before this barrier
        const int next = tile + STAGES - 1;
        if (next < tiles)
          issue_stage(s, next, stages + (next % STAGES) * STAGE_BYTES, bars + 8 * (next % STAGES), tid);
        cp_async_commit();
        acc ^= touch(smem + stage * STAGE_BYTES, tid);
      }
      cp_async_wait<0>();
      __syncthreads();  // every stage read before the next item refills them (mbarrier phases carry over)
    }
  }
  sink[blockIdx.x * THREADS + tid] = acc;
}
