// The skinny GEMM of the projection plan: out[M, N] (=|+=) a[M, K] @ w[N, K]^T for M <= 64 rows (a decode step's
// batch), on sm_90. cuBLAS takes ~5 µs for such a GEMM whatever M, far above its weights at the copy rate
// (docs/PERF.md, twenty-eighth run): its K loop runs serially on few CTAs. Here K is split between the 8 CTAs of
// a cluster, so that every SM loads its ~20 KB of w at once, and the 8 partial tiles are summed through
// distributed shared memory in a fixed order: the same bits on every run.
// Needs (render): ELEM_IS_BF16, K_LEN (the exact K), K_SLICE (K columns per CTA, a multiple of 32), ROW_BYTES,
// OUT_F32 (true: out = a w^T in float32; false: out (16-bit) += a w^T, rounded once), SMEM_BYTES.

constexpr int TILE_M = 64;          // rows of a and out (a launch takes M <= TILE_M)
constexpr int TILE_N = 64;          // columns of out per cluster: 4 warps of 16
constexpr int SPLITS = 8;           // CTAs per cluster, each K_SLICE of K
constexpr int THREADS = 128;
constexpr int PART_STRIDE = TILE_N + 8;  // floats per row of the partial tile (the pad spreads the float2 stores)
constexpr int OFF_A = 0, OFF_W = TILE_M * ROW_BYTES, OFF_PART = 2 * TILE_M * ROW_BYTES;
static_assert(K_SLICE % 32 == 0 && ROW_BYTES >= K_SLICE * 2 && ROW_BYTES % 16 == 0, "slice layout");
static_assert(OFF_PART + TILE_M * PART_STRIDE * 4 <= SMEM_BYTES, "shared memory carve-up");

// The kernel's argument has the byte layout of the pnca kernel's Params (launch.py packs one struct for both);
// only these fields are read.
struct SkinnyParams {
  const u16* a;       // [M, lda]
  const u16* w;       // [N, ldw]
  void* out;          // [M, ldo], float32 or the element type
  u64 unused_ptrs[11];
  long long lda, ldw, ldo;
  long long unused_strides[8];
  int m, n;
  int w_before_wait;  // w may be read before the kernel before ends: that kernel does not write it
  int unused_ints[12];
  float unused_floats[2];
};
static_assert(sizeof(SkinnyParams) == 272, "the size launch.py packs");

extern __shared__ __align__(128) u8 smem[];

FN_INLINE u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every CTA of the cluster past this point has made its shared-memory writes visible to the others.
FN_INLINE void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
FN_INLINE f32x4 ld_cluster_f32x4(u32 local_addr, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local_addr), "r"(rank));
  f32x4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
  return v;
}

// Rows [0, tile_rows) x this CTA's K slice of a matrix into shared memory, 16-byte copies; rows past `rows` repeat
// the last row (their results are never stored), columns past K_LEN arrive as zeros.
FN_INLINE void load_slice(u32 dst, const u16* src, long long ld, int tile_rows, int rows, int row0, int k0, int tid) {
  constexpr int CHUNKS = K_SLICE / 8;
  for (int c = tid; c < tile_rows * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, ch = c % CHUNKS, k = k0 + ch * 8;
    const int row = min(row0 + r, rows - 1);
    cp_async16(dst + r * ROW_BYTES + ch * 16, src + row * ld + (k < K_LEN ? k : 0), k < K_LEN ? 16 : 0);
  }
}

extern "C" __global__ void __cluster_dims__(SPLITS, 1, 1) __launch_bounds__(THREADS)
    KERNEL_NAME(const SkinnyParams p) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const u32 split = cluster_rank();             // this CTA's K slice
  const int n0 = (blockIdx.x / SPLITS) * TILE_N;  // the cluster's columns
  const int k0 = split * K_SLICE;
  const u32 a_s = smem_addr(smem + OFF_A), w_s = smem_addr(smem + OFF_W);

  const int m_tiles = (p.m + 15) / 16;  // a's rows past them are neither loaded nor multiplied
  // The out projection (w_before_wait) starts while the attention stage before it finishes (a programmatic
  // launch): its slice of the weights is on its way before a (that stage's o) exists.
  if (p.w_before_wait) load_slice(w_s, p.w, p.ldw, TILE_N, p.n, n0, k0, tid);
  wait_for_prior_grid();  // a and out may be the previous kernel's output (see prelude.cu)
  allow_next_grid();      // the Q projection's stage may start prefetching its K/V beside this kernel
  load_slice(a_s, p.a, p.lda, m_tiles * 16, p.m, 0, k0, tid);
  if (!p.w_before_wait) load_slice(w_s, p.w, p.ldw, TILE_N, p.n, n0, k0, tid);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  // Each 32 columns of K are two k-steps of m16n8k16. A lane loads 8 consecutive k of a row (one 16-byte read)
  // for both a and w, and the k-steps take them in the same permuted order (k-step 0: 8t..8t+3, k-step 1:
  // 8t+4..8t+7), which leaves the sum unchanged: no ldmatrix, no shuffles.
  float acc[4][2][4] = {};
#pragma unroll 1
  for (int kb = 0; kb < K_SLICE / 32; ++kb) {
    u32x4 b[2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const u32 addr = w_s + (warp * 16 + nt * 8 + g) * ROW_BYTES + kb * 64 + t * 16;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(b[nt].x), "=r"(b[nt].y), "=r"(b[nt].z), "=r"(b[nt].w) : "r"(addr));
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      if (mt >= m_tiles) break;  // warp-uniform
      u32x4 lo, hi;  // rows mt*16 + g and + 8
      const u32 addr = a_s + (mt * 16 + g) * ROW_BYTES + kb * 64 + t * 16;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(lo.x), "=r"(lo.y), "=r"(lo.z), "=r"(lo.w)
                   : "r"(addr));
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(hi.x), "=r"(hi.y), "=r"(hi.z), "=r"(hi.w)
                   : "r"(addr + 8 * ROW_BYTES));
      const u32 a0[4] = {lo.x, hi.x, lo.y, hi.y}, a1[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_16816(acc[mt][nt], a0, b[nt].x, b[nt].y);
        mma_16816(acc[mt][nt], a1, b[nt].z, b[nt].w);
      }
    }
  }

  // This CTA's partial tile, then the cluster's: CTA `split` sums rows [8 split, 8 split + 8) of all 8 partials,
  // in CTA order.
  float* part = reinterpret_cast<float*>(smem + OFF_PART);
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(part + (mt * 16 + g + 8 * h) * PART_STRIDE + warp * 16 + nt * 8 + 2 * t) =
            make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
  cluster_sync();

  const int row = split * 8 + tid / 16, col = (tid % 16) * 4;
  if (row < p.m && n0 + col < p.n) {
    const u32 mine = smem_addr(part + row * PART_STRIDE + col);
    f32x4 s = ld_cluster_f32x4(mine, 0);
#pragma unroll
    for (u32 r = 1; r < SPLITS; ++r) {
      const f32x4 v = ld_cluster_f32x4(mine, r);
      s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
    }
    if constexpr (OUT_F32) {
      *reinterpret_cast<f32x4*>(static_cast<float*>(p.out) + row * p.ldo + n0 + col) = s;
    } else {
      u32* dst = reinterpret_cast<u32*>(static_cast<u16*>(p.out) + row * p.ldo + n0 + col);
      const u32 y01 = dst[0], y23 = dst[1];
      dst[0] = pack2_elem(lo_to_f32(y01) + s.x, hi_to_f32(y01) + s.y);
      dst[1] = pack2_elem(lo_to_f32(y23) + s.z, hi_to_f32(y23) + s.w);
    }
  }
  cluster_sync();  // no CTA leaves while another still reads its partial tile
}
