// Device helpers shared by fusednorm's generated kernels.
// NVRTC runs without an include path, so the few 16-bit float conversions and the tensor-core / async-copy
// instructions are written here as small inline-PTX helpers instead of coming from cuda_bf16.h / cuda_fp16.h.
// Needs: ELEM_IS_BF16 (constexpr bool) declared before this file.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

struct __align__(16) u32x4 { u32 x, y, z, w; };
struct __align__(16) f32x4 { float x, y, z, w; };

#define FN_INLINE __device__ __forceinline__
#define FULL_WARP 0xffffffffu
#define LOG2E_F 1.4426950408889634f

// ---- 16-bit float <-> fp32 (bf16 or fp16, picked at compile time) ----

FN_INLINE float elem_to_f32(u16 bits) {
  if constexpr (ELEM_IS_BF16) {
    return __uint_as_float(((u32)bits) << 16);  // bf16 is the top half of an fp32
  } else {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
  }
}

// Two fp32 values -> one register of two 16-bit floats (round to nearest even); lo lands in the low half,
// which is the lower column / key index in every mma fragment.
FN_INLINE u32 pack2_elem(float lo, float hi) {
  u32 r;
  if constexpr (ELEM_IS_BF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

FN_INLINE float lo_to_f32(u32 pair) { return elem_to_f32((u16)(pair & 0xffffu)); }
FN_INLINE float hi_to_f32(u32 pair) { return elem_to_f32((u16)(pair >> 16)); }

// True when either half of a packed pair is Inf or NaN (all exponent bits set).
FN_INLINE bool pair_not_finite(u32 pair) {
  const u32 exp_mask = ELEM_IS_BF16 ? 0x7f807f80u : 0x7c007c00u;
  const u32 e = pair & exp_mask;
  return (e & 0xffffu) == (exp_mask & 0xffffu) || (e >> 16) == (exp_mask >> 16);
}

// ---- memory ----

// The compiler folds this builtin into 32-bit shared-window arithmetic (an inline-PTX cvta would not fold).
FN_INLINE u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16-byte global -> shared copy that bypasses L1; src_bytes == 0 fills the 16 bytes with zeros. The L2::128B
// prefetch size measured Whisper decode -1.6 %, other shapes level; L2::256B, which also fetches the neighbouring
// head's slice, cost decode 27 % (docs/PERF.md, 12-04).
FN_INLINE void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
FN_INLINE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
FN_INLINE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

FN_INLINE u32x4 ld_global16(const void* p) { return *reinterpret_cast<const u32x4*>(p); }

// A counter between CTAs of one launch, read with acquire: what its writers published before adding is visible after.
FN_INLINE int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
FN_INLINE unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// 4-byte shared loads and stores at computed addresses. volatile keeps them in the order written: a caller that
// issues its loads before its stores gets them overlapped (plain C++ on one array serializes each load after the
// previous store, which the compiler cannot prove is to another address).
FN_INLINE u32 ld_shared4(u32 addr) {
  u32 v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
FN_INLINE void st_shared4(u32 addr, u32 v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

FN_INLINE void st_global16(void* p, u32x4 v) { *reinterpret_cast<u32x4*>(p) = v; }

// The output is written once and not read again by this kernel: evict-first keeps x and K/V in L2.
FN_INLINE void st_global16_stream(void* p, u32x4 v) {
  asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// ---- tensor cores ----

FN_INLINE void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
FN_INLINE void ldmatrix_x2(u32& r0, u32& r1, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}
FN_INLINE void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
FN_INLINE void ldmatrix_x2_trans(u32& r0, u32& r1, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(addr));
}

// D += A(16x16, row) * B(16x8, col), fp32 accumulate. Registers only, so not volatile: the compiler may schedule it.
FN_INLINE void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if constexpr (ELEM_IS_BF16) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// D += A(16x8, row) * B(8x8, col): a k-step of 8 columns (d = 40's last), A in a[0] and a[1] as mma_16816 has them.
FN_INLINE void mma_1688(float (&d)[4], const u32 (&a)[4], u32 b0) {
  if constexpr (ELEM_IS_BF16) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b0));
  } else {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b0));
  }
}

// ---- Hopper warpgroup mma (sm_90a; used only when USE_WGMMA) ----
// A warpgroup (4 consecutive warps) issues one wgmma for a 64-row tile: A from registers (warp w of the group holds
// rows 16w..16w+15 in the mma.sync A-fragment order), B read by the tensor cores from shared memory through a
// descriptor, the fp32 accumulators in the mma.sync C-fragment order per 8 columns. It runs asynchronously: the
// registers it reads or writes must be left alone until wgmma_wait says it is done. The three shapes a kernel
// issues (wgmma_scores, wgmma_output, wgmma_row_sums) are written out by fusednorm/codegen/render.py.

// Descriptor of a 128-byte-swizzled tile: rows of 128 bytes, 16-byte chunk c of row r stored at chunk c ^ (r % 8),
// the pattern repeating every 1024 bytes from a 1024-byte-aligned base (base offset 0). stride_bytes: from one group
// of 8 rows to the next; leading_bytes: from one 64-element column block to the next (N-major B only).
FN_INLINE u64 sw128_desc(u32 addr, u32 leading_bytes, u32 stride_bytes) {
  return (u64)((addr & 0x3FFFFu) >> 4) | (u64)((leading_bytes & 0x3FFFFu) >> 4) << 16 |
         (u64)((stride_bytes & 0x3FFFFu) >> 4) << 32 | 1ull << 62;
}
// The same descriptor for a tile `bytes` further on: only the start-address field moves, and it cannot carry out
// (it holds bits 4-17 of a shared address, and shared memory ends below 256 KB).
FN_INLINE u64 desc_advance(u64 desc, u32 bytes) { return desc + (bytes >> 4); }
// A warpgroup takes registers from the CTA's pool or gives them back, to N per thread (warp-specialised kernels:
// ptxas allocates the code after each to its count).
template <int N> FN_INLINE void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> FN_INLINE void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
FN_INLINE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
FN_INLINE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
FN_INLINE void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Shared memory written by cp.async (the generic proxy) becomes visible to wgmma (the async proxy) after this fence,
// issued by the writing thread before the barrier that publishes the writes.
FN_INLINE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Pins a register's value at this point: reads after a wgmma_wait cannot move above it, and registers an in-flight
// wgmma still reads are not reused before it.
FN_INLINE void pin(float& r) { asm volatile("" : "+f"(r)::"memory"); }
FN_INLINE void pin(u32& r) { asm volatile("" : "+r"(r)::"memory"); }
template <typename T, int R, int C>
FN_INLINE void pin_all(T (&r)[R][C]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < C; ++j) pin(r[i][j]);
}
// An accumulator's rows g and g + 8 (elements 0-1 and 2-3 of each n-tile) times their online-softmax factors.
template <int N>
FN_INLINE void rescale(float (&o)[N][4], const float (&alpha)[2]) {
#pragma unroll
  for (int nt = 0; nt < N; ++nt) {
    o[nt][0] *= alpha[0];
    o[nt][1] *= alpha[0];
    o[nt][2] *= alpha[1];
    o[nt][3] *= alpha[1];
  }
}

// ---- Hopper bulk tensor copies (TMA) and transaction barriers (sm_90; used only when USE_TMA) ----
// One thread copies a whole box of a tensor into shared memory with one instruction, in the 128-byte-swizzle layout
// wgmma reads (the tensor map, built on the host, says so); rows outside the tensor arrive as zeros. The copy
// completes on an mbarrier that the same thread armed with the number of bytes to expect; waiting on the barrier's
// phase makes the bytes visible to every thread that waited.

struct __align__(64) TensorMap { u64 opaque[16]; };  // a CUtensorMap, passed by value as a __grid_constant__

FN_INLINE void mbar_init(u32 bar, u32 arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// Makes the initialised barriers visible to the async proxy (the copies that complete on them).
FN_INLINE void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
FN_INLINE void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// One arrival and no bytes: a consumer handing a stage back (warp-specialised kernels).
FN_INLINE void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Spins until the barrier has completed the phase of this parity.
FN_INLINE void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
FN_INLINE void tma_load_3d(u32 dst, const TensorMap* map, int c0, int c1, int c2, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
FN_INLINE void tma_load_4d(u32 dst, const TensorMap* map, int c0, int c1, int c2, int c3, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
// The same with an L2 eviction priority for the copied lines (a createpolicy result).
FN_INLINE void tma_load_4d_hint(u32 dst, const TensorMap* map, int c0, int c1, int c2, int c3, u32 bar, u64 policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, "
      "{%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar),
      "l"(policy) : "memory");
}
FN_INLINE u64 l2_evict_first() {
  u64 policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// The reverse: a box of shared memory (same swizzle) to global memory, read from shared memory asynchronously; box
// rows outside the tensor are not written. The shared memory may be reused once bulk_wait_read says it was read.
FN_INLINE void tma_store_3d(const TensorMap* map, u32 src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(map),
               "r"(src), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
FN_INLINE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
FN_INLINE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
FN_INLINE void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// ---- programmatic dependent launch (sm_90) ----
// A kernel launched with it (launch.py) may start while the kernel before it in the stream is still finishing, so
// its CTAs are resident and set up when that one ends. Nothing in global memory may be read or written before this
// wait returns: the kernel before may still write the inputs, or read what becomes the output. The wait returns at
// once in a kernel launched without it. The tensor maps live in the kernel's parameters, which nothing writes:
// fetching them early is safe.
FN_INLINE void wait_for_prior_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
FN_INLINE void prefetch_tensormap(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// ---- math ----

// 2^x with the MUFU unit; ex2.approx(-inf) is +0, which the masked softmax relies on.
FN_INLINE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1/x with the MUFU unit alone (about 1 ulp; x here is a row sum of exponentials, >= 1 when not 0).
FN_INLINE float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

FN_INLINE float neg_inf() { return __uint_as_float(0xff800000u); }
