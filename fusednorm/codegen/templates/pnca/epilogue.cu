// Step 4 of the pnca kernel: the epilogue, y = x + o (or o alone, WRITE_O) for one head's columns.

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
