// FUSED_PROJ: the projection plan's two GEMMs inside its attention stage, for the key-split tile's blocks of 16
// query rows (decode), so that the whole block is one launch. A cuBLAS launch of a GEMM of a few rows costs ~5 us
// whatever the rows (docs/PERF.md, twenty-eighth run); here each head does its own share while the K/V copies of
// the steps ahead are in flight:
//   project_q_head  qraw = x @ Wq'^T for the block's rows and the head's d columns, at the head's first step;
//   project_o_head  the head's share of the out projection, o_h @ Wo'[:, the head's columns]^T, at its last step,
//                   into p.proj_part; the CTA that finishes a row block's last head takes reduce_heads:
//   reduce_heads    y = x + (the heads' shares summed in head order + bo), rounded once (deterministic).
// Both GEMMs are mma.sync with B read straight from global memory (the weights stay in L2: every row block reads
// them). Lane quad t holds the k-slots {2t, 2t+1, 2t+8, 2t+9} of an m16n8k16 step in A and in B alike, so any map
// of those slots to real k gives the same product: here k = 4t .. 4t+3, one 8-byte load of a row per step.

// 4 consecutive 16-bit elements: the registers of k-slots (2t, 2t+1) and (2t+8, 2t+9) of one operand row.
FN_INLINE uint2 ld_quad(const u16* p) { return *reinterpret_cast<const uint2*>(p); }

constexpr int PROJ_Q_NTILES = HEAD_DIM / 8;  // n-tiles of a head's qraw columns
constexpr int PROJ_Q_NT_PER_WARP = (PROJ_Q_NTILES + WARPS - 1) / WARPS;
constexpr int PROJ_Q_GROUP = 2;              // n-tiles whose accumulators are live at once
constexpr int PROJ_O_KSTEPS = HEAD_DIM_PAD / 16;
constexpr int PROJ_O_GROUP = 4;              // n-tiles of y whose weights are in flight at once

// qraw [16][HEAD_DIM] (float32, into q_tile) for the rows from row_base on and the head's columns; rows past Lq
// come out 0. Warp w takes the head's n-tiles w, w + WARPS, ...; model_dim is a multiple of 8 (plans see to it).
FN_INLINE void project_q_head(const Params& p, int b, int row_base, int head, float* q_tile, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3, D = p.model_dim;
  const bool live0 = row_base + g < p.q_len, live1 = row_base + g + 8 < p.q_len;
  const u16* x0 = p.x + ((long long)b * p.q_len + row_base + g) * D + 4 * t;  // read only where live
  const u16* x1 = x0 + 8LL * D;
#pragma unroll 1
  for (int j0 = 0; j0 < PROJ_Q_NT_PER_WARP; j0 += PROJ_Q_GROUP) {
    const u16* w[PROJ_Q_GROUP];
    bool has[PROJ_Q_GROUP];
    float acc[2][PROJ_Q_GROUP][4];  // even and odd k-steps apart: two chains of mma half as long
#pragma unroll
    for (int j = 0; j < PROJ_Q_GROUP; ++j) {
      const int nt = warp + (j0 + j) * WARPS;
      has[j] = j0 + j < PROJ_Q_NT_PER_WARP && nt < PROJ_Q_NTILES;
      w[j] = p.wq + (long long)(head * HEAD_DIM + (has[j] ? nt : 0) * 8 + g) * D + 4 * t;
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[0][j][e] = acc[1][j][e] = 0.f;
    }
#pragma unroll 2
    for (int k = 0; k < D; k += 32) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int kk = k + 16 * h;
        const bool in = kk + 4 * t < D;  // D % 8 == 0: a lane's 4 elements are all in or all out
        const uint2 xa = live0 && in ? ld_quad(x0 + kk) : make_uint2(0u, 0u);
        const uint2 xb = live1 && in ? ld_quad(x1 + kk) : make_uint2(0u, 0u);
        const u32 a[4] = {xa.x, xb.x, xa.y, xb.y};
#pragma unroll
        for (int j = 0; j < PROJ_Q_GROUP; ++j) {
          if (!has[j]) continue;
          const uint2 wb = in ? ld_quad(w[j] + kk) : make_uint2(0u, 0u);
          mma_16816(acc[h][j], a, wb.x, wb.y);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < PROJ_Q_GROUP; ++j) {
      if (!has[j]) continue;
      const int c = (warp + (j0 + j) * WARPS) * 8 + 2 * t;
      *reinterpret_cast<float2*>(q_tile + g * HEAD_DIM + c) =
          make_float2(acc[0][j][0] + acc[1][j][0], acc[0][j][1] + acc[1][j][1]);
      *reinterpret_cast<float2*>(q_tile + (g + 8) * HEAD_DIM + c) =
          make_float2(acc[0][j][2] + acc[1][j][2], acc[0][j][3] + acc[1][j][3]);
    }
  }
}

// y for the row block's live rows: x + (sum over heads, in head order, of their shares + bo), rounded once.
FN_INLINE void reduce_heads(const Params& p, int b, int row_base, int tid, bool& bad) {
  const int D = p.model_dim, quads = D / 4;
  const int rows = min(16, p.q_len - row_base);
#pragma unroll 1
  for (int i = tid; i < rows * quads; i += THREADS) {
    const int r = i / quads, c = (i - r * quads) * 4;
    const long long row = (long long)b * p.q_len + row_base + r;
    const float* share = p.proj_part + row * p.heads * D + c;
    float4 s = __ldcg(reinterpret_cast<const float4*>(share));
#pragma unroll 4
    for (int h = 1; h < p.heads; ++h) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(share + (long long)h * D));
      s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
    }
    float f[4] = {s.x, s.y, s.z, s.w};
    if (p.ones_col) {
#pragma unroll
      for (int e = 0; e < 4; ++e) f[e] += elem_to_f32(p.wo[(long long)(c + e) * p.wo_ld + p.heads * HEAD_DIM]);
    }
    const uint2 xv = ld_quad(p.x + row * D + c);
    const uint2 out = make_uint2(pack2_elem(lo_to_f32(xv.x) + f[0], hi_to_f32(xv.x) + f[1]),
                                 pack2_elem(lo_to_f32(xv.y) + f[2], hi_to_f32(xv.y) + f[3]));
    if constexpr (CHECK_NUMERICS) bad |= pair_not_finite(out.x) || pair_not_finite(out.y);
    *reinterpret_cast<uint2*>(p.y + row * p.y_ld + c) = out;
  }
}

// The head's share of the out projection from its o [16][ROW_STRIDE] (o_tile, written by the key split's merge),
// then the row block's ticket; the CTA that takes the last one writes y. Warp w takes y's n-tiles in runs of
// PROJ_O_GROUP, every WARPS-th run. Called by every thread of the CTA.
FN_INLINE void project_o_head(const Params& p, int b, int row_base, int head, const u16* o_tile, int warp, int lane,
                              int tid, bool& bad) {
  const int g = lane >> 2, t = lane & 3, D = p.model_dim;
  const bool live0 = row_base + g < p.q_len, live1 = row_base + g + 8 < p.q_len;
  __syncthreads();  // o_tile is whole
  const u16* o0 = o_tile + g * ROW_STRIDE + 4 * t;  // read only where live
  const u16* o1 = o0 + 8 * ROW_STRIDE;
  float* share0 = p.proj_part + (((long long)b * p.q_len + row_base + g) * p.heads + head) * D + 2 * t;
  float* share1 = share0 + 8LL * p.heads * D;
  const u16* w_rows = p.wo + (long long)g * p.wo_ld + head * HEAD_DIM + 4 * t;
  const int ntiles = D / 8;
#pragma unroll 1
  for (int n0 = warp * PROJ_O_GROUP; n0 < ntiles; n0 += WARPS * PROJ_O_GROUP) {
    float acc[PROJ_O_GROUP][4];
#pragma unroll
    for (int j = 0; j < PROJ_O_GROUP; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < PROJ_O_KSTEPS; ++kk) {
      const bool in = kk * 16 + 4 * t < HEAD_DIM;  // d = 40's last k-step: columns 40..47 are zeros
      const uint2 oa = live0 && in ? ld_quad(o0 + kk * 16) : make_uint2(0u, 0u);
      const uint2 ob = live1 && in ? ld_quad(o1 + kk * 16) : make_uint2(0u, 0u);
      const u32 a[4] = {oa.x, ob.x, oa.y, ob.y};
#pragma unroll
      for (int j = 0; j < PROJ_O_GROUP; ++j) {
        if (n0 + j >= ntiles) continue;
        const uint2 wb = in ? ld_quad(w_rows + (long long)(n0 + j) * 8 * p.wo_ld + kk * 16) : make_uint2(0u, 0u);
        mma_16816(acc[j], a, wb.x, wb.y);
      }
    }
#pragma unroll
    for (int j = 0; j < PROJ_O_GROUP; ++j) {
      if (n0 + j >= ntiles) continue;
      const int c = (n0 + j) * 8;
      if (live0) *reinterpret_cast<float2*>(share0 + c) = make_float2(acc[j][0], acc[j][1]);
      if (live1) *reinterpret_cast<float2*>(share1 + c) = make_float2(acc[j][2], acc[j][3]);
    }
  }
  int* is_last = reinterpret_cast<int*>(smem + OFF_MERGE_STATS);  // the key split's m, read by now
  __threadfence();  // this thread's share is visible device-wide before the CTA takes the ticket
  __syncthreads();
  if (tid == 0) {
    int* ticket = p.head_tickets + (long long)b * p.row_blocks + row_base / BLOCK_M;
    *is_last = atomicAdd(ticket, 1) == p.heads - 1;
    if (*is_last) *ticket = 0;  // every head has taken its ticket: zero again for the next launch
  }
  __syncthreads();
  if (!*is_last) return;
  __threadfence();  // the other heads' shares, written before their tickets
  reduce_heads(p, b, row_base, tid, bad);
}
