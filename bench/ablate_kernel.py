"""Where the few_keys kernel's GPU time goes: the kernel rebuilt with one phase cut out at a time, timed on the
short-key shapes in one run. The cut kernels compute wrong results on purpose; only their time is read.

    PYTHONPATH=. python bench/ablate_kernel.py [--shapes seed,sdxl64,sd15_64] [--all-roles --shapes t5_dec,...]

Each cut is an exact text replacement in the rendered source of the one-tile kernels (with --all-roles, of every
kernel: for shapes that other roles take);
a replacement that no longer matches the template stops the run, so the cuts cannot silently go stale. The mma cuts
edit both the mma.sync and the warpgroup-mma (sm_90) code, so they cut whichever the GPU runs.

    PYTHONPATH=. python bench/ablate_kernel.py --variants [--shapes ...]

Variants are edits that keep the result: each kernel's output must equal the baseline's bit for bit (the run
stops otherwise; those in TOLERANT, which sum in another order, must stay close), and they are timed over rotating
input sets, as bench_block.py times the block, because they are about what stays in L2 (the cuts are timed on one
set).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["FUSEDNORM_CACHE_DIR"] = tempfile.mkdtemp(prefix="fusednorm_ablate_")  # cut kernels stay out of the cache
import fusednorm.codegen as codegen  # noqa: E402
from bench_block import SHAPES, NoProjForm, graph_time_us, input_sets_for  # noqa: E402
from fusednorm.codegen import cache, render as render_mod, select  # noqa: E402

CUTS = {  # name -> (what it removes, [(old, new), ...])
    "baseline": ("nothing", []),
    "no_refill": ("the per-step copies (K, V, x slice, norm parameters): stages keep the prologue's data",
                  [("    if (ahead.item < p.items) {\n      load_step(p, maps, ahead, stage == 0",
                    "    if (false) {\n      load_step(p, maps, ahead, stage == 0")]),
    "no_x_slice": ("the x-slice copy of each head (Q and the residual read stale x)",
                   [("    if (NEEDS_X_SLICE)\n      load_x_tile(", "    if (false)\n      load_x_tile(")]),
    "no_statistics": ("the row-statistics pass at each item's start",
                      [("      if (cur.head_in_item == 0 && warp_rows) {  // a new item",
                        "      if (false) {  // a new item")]),
    "no_barrier": ("the CTA barrier of each step (warps run unsynchronised)",
                   [("    __syncthreads();  // this step's stage is visible",
                     "    __syncwarp();  // this step's stage is visible")]),
    "no_y_store": ("the global stores of y (y is still computed and staged in shared memory)",
                   [("        st_global16_stream(yp, ", "        if (p.q_len < 0) st_global16_stream(yp, "),
                    ("        tma_store_3d(&maps.y, ", "        if (p.q_len < 0) tma_store_3d(&maps.y, ")]),
    "no_qk_mma": ("the QK^T mma (scores stay 0; Q and the K fragments are then never built)",
                  [("          mma_16816(s[mt][2 * np], a[mt], b[0], b[1]);\n"
                    "          mma_16816(s[mt][2 * np + 1], a[mt], b[2], b[3]);\n", ""),
                   ("            mma_1688(s[mt][2 * np], a[mt], b0);\n"
                    "            mma_1688(s[mt][2 * np + 1], a[mt], b1);\n", ""),  # d = 40's last k-step
                   ("      wgmma_scores(s[0], a[kk], ", "      if (p.q_len < 0) wgmma_scores(s[0], a[kk], ")]),
    "no_pv_mma": ("the P V mma (o stays 0; the V fragments are then never loaded)",
                  [("          mma_16816(o[mt][2 * dp], a[mt], b[0], b[1]);\n"
                    "          mma_16816(o[mt][2 * dp + 1], a[mt], b[2], b[3]);\n", ""),
                   ("      wgmma_output(o[0], a[ks], ", "      if (p.q_len < 0) wgmma_output(o[0], a[ks], ")]),
    "no_rowsum_mma": ("the P * 1 mma that sums each row of P",
                      [("        mma_16816(lc[mt], a[mt], ones, ones);\n", ""),
                       ("      wgmma_row_sums(lc, a[ks], ", "      if (p.q_len < 0) wgmma_row_sums(lc, a[ks], ")]),
    "no_exp": ("the exponentials (p = s - m)",
               [("const float e0 = fast_exp2(fmaf(", "const float e0 = (fmaf("),
                ("const float e1 = fast_exp2(fmaf(", "const float e1 = (fmaf(")]),
    "no_max_shuffle": ("the two shuffles that spread each row's max over its quad",
                       [("      mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 1));\n"
                         "      mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 2)) * c;\n", "      mx *= c;\n")]),
    "no_max": ("the row max (its chain and its shuffles; m = 0)",
               [("      mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 1));\n"
                 "      mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 2)) * c;\n", "      mx *= c;\n"),
                ("        if (FILL != FILL_ANY || nt / 2 * 16 < valid)\n          mx = fmaxf(",
                 "        if (false)\n          mx = fmaxf(")]),
}


# L2 eviction priorities for x. The few-key kernels read each row of x twice: whole, in the statistics pass at an
# item's start, then head by head in slices; at the seed's 264 CTAs x 256 KB of rows the first read is more than
# L2 holds, so the second may go to DRAM again. These mark the first read's lines evict-last and the second's
# (their last use) and y's evict-first. The helpers are added beside the prelude's own.
_LD_ANCHOR = "FN_INLINE u32x4 ld_global16(const void* p) { return *reinterpret_cast<const u32x4*>(p); }\n"
_HINT_HELPERS = (_LD_ANCHOR, _LD_ANCHOR + r"""FN_INLINE u64 l2_evict_last(float fraction) {
  u64 policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, %1;\n" : "=l"(policy) : "f"(fraction));
  return policy;
}
FN_INLINE u32x4 ld_global16_hint(const void* p, u64 policy) {
  u32x4 v;
  asm("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(policy));
  return v;
}
FN_INLINE void cp_async16_hint(u32 dst, const void* src, int src_bytes, u64 policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
               ::"r"(dst), "l"(src), "r"(src_bytes), "l"(policy));
}
""")
_TMA_ANCHOR = "FN_INLINE u64 l2_evict_first() {"
_TMA_HELPERS = (_TMA_ANCHOR, r"""
FN_INLINE void tma_load_3d_hint(u32 dst, const TensorMap* map, int c0, int c1, int c2, u32 bar, u64 policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], "
      "[%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "l"(policy)
      : "memory");
}
FN_INLINE void tma_store_3d_hint(const TensorMap* map, u32 src, int c0, int c1, int c2, u64 policy) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3, %4}], [%1], "
               "%5;\n" ::"l"(map), "r"(src), "r"(c0), "r"(c1), "r"(c2), "l"(policy) : "memory");
}
""" + _TMA_ANCHOR)


def _stats_keep(fraction):
    return [_HINT_HELPERS,
            ("  const u32 ones = pack2_elem(1.f, 1.f);\n  bool redo = false;\n",
             f"  const u32 ones = pack2_elem(1.f, 1.f);\n  bool redo = false;\n"
             f"  const u64 keep = l2_evict_last({fraction:.2f}f);\n"),
            ("ld_global16(xa + c)", "ld_global16_hint(xa + c, keep)"),
            ("ld_global16(xb + c)", "ld_global16_hint(xb + c, keep)")]


_SLICE_LAST_USE = [  # the x slice's copy (bulk or 16-byte) marks the lines evict-first: x is not read again
    ("      tma_load_3d(x_dst + cb * X_BOX, &maps.x, c.head * HEAD_DIM + cb * TMA_BOX_COLS, "
     "c.row_block * BLOCK_M, c.b,\n                  bar);",
     "      tma_load_3d_hint(x_dst + cb * X_BOX, &maps.x, c.head * HEAD_DIM + cb * TMA_BOX_COLS, "
     "c.row_block * BLOCK_M, c.b, bar, l2_evict_first());"),
    ("      cp_async16(dst + i * COPY_ROWS * ROW_STRIDE * 2, xp, 16);",
     "      cp_async16_hint(dst + i * COPY_ROWS * ROW_STRIDE * 2, xp, 16, l2_evict_first());")]
_Y_EVICT_FIRST = [  # y's bulk stores evict-first (its 16-byte stores already are: st.global.cs)
    ("tma_store_3d(&maps.y, smem_addr(x_tile + cb * BLOCK_M * TMA_BOX_COLS), col0 + cb * TMA_BOX_COLS, row0, b);",
     "tma_store_3d_hint(&maps.y, smem_addr(x_tile + cb * BLOCK_M * TMA_BOX_COLS), col0 + cb * TMA_BOX_COLS, row0, b, "
     "l2_evict_first());")]


def _stat_groups(n):  # the columns are summed in the same order whatever the groups: the same bits
    return [("constexpr int STAT_GROUPS = MIN_CTAS_PER_SM > 1 ? 4 : 8;",
             f"constexpr int STAT_GROUPS = MIN_CTAS_PER_SM > 1 ? {n} : 8;")]


# Statistics shared between the items of one row block (twenty-third run, docs/PERF.md §1). Where every item runs at
# once (items <= grid) and a block of rows is split between head groups, the row statistics are summed once per
# block: by rows (shared_stats: each CTA sums the rows of its warps w with w % groups == its group, the same code on
# the same rows, so the same bits) or by columns (shared_column_stats: each CTA sums its group's share of every row's
# columns, 1/groups of the round trips, the groups' sums added in order: other bits, checked with a tolerance),
# exchanged through module-global buffers after an arrival counter per row block (reset by the last CTA to leave).
# Experiments only: they wait on CTAs of the same launch without a bound, and two launches at once share the buffers.
_SHARED_EXCHANGE = """__device__ int fn_arrive[4096], fn_leave[4096];

FN_INLINE void shared_arrive_and_wait(const Params& p, int rb, int tid) {
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    atomicAdd(&fn_arrive[rb], 1);
    while (atomicAdd(&fn_arrive[rb], 0) < p.head_groups) __nanosleep(32);
    __threadfence();
  }
  __syncthreads();
}

FN_INLINE void shared_leave(const Params& p, int rb, int tid) {
  if (tid == 0 && atomicAdd(&fn_leave[rb], 1) == p.head_groups - 1) {
    fn_arrive[rb] = 0;
    fn_leave[rb] = 0;
  }
}

// false, with this warp's statistics summed as main's kernel sums them, where sharing does not apply
FN_INLINE bool statistics_shared_here(const Params& p, const u16* x_batch, int row0, bool warp_rows, float* row_mean,
                                      float* row_rstd, float* stat_parts, int warp, int lane) {
  if (!WRITE_O && KEY_SPLIT == 1 && !KV_CHUNKED && M_TILES == 1 && p.head_groups > 1 && p.head_groups <= 16 &&
      p.items <= (int)gridDim.x && p.q_len % BLOCK_M == 0 && (long long)p.batch * p.q_len <= (1 << 16) &&
      p.batch * p.row_blocks <= 4096)
    return true;
  if (warp_rows) row_statistics(p, x_batch, nullptr, row0, row_mean, row_rstd, stat_parts, warp, lane);
  return false;
}
"""
_KERNEL_HEAD = 'extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS_PER_SM)'
_SHARED_BY_ROWS = (_KERNEL_HEAD, """__device__ float2 fn_shared_stats[1 << 16];
""" + _SHARED_EXCHANGE + """
FN_INLINE void shared_or_own_statistics(const Params& p, const StepCursor& cur, int row0, bool warp_rows,
                                        float* row_mean, float* row_rstd, float* stat_parts, int warp, int lane,
                                        int tid) {
  const long long batch_off = (long long)cur.b * p.q_len * p.model_dim;
  if (!statistics_shared_here(p, p.x + batch_off, row0, warp_rows, row_mean, row_rstd, stat_parts, warp, lane)) return;
  const int group = cur.head / p.heads_per_item, rb = cur.b * p.row_blocks + cur.row_block;
  float2* rows = fn_shared_stats + (long long)cur.b * p.q_len + row0;  // this warp's rows
  if (warp % p.head_groups == group) {
    row_statistics(p, p.x + batch_off, nullptr, row0, row_mean, row_rstd, stat_parts, warp, lane);
    if (lane < ROWS_PER_WARP) rows[lane] = make_float2(row_mean[lane], row_rstd[lane]);
  }
  shared_arrive_and_wait(p, rb, tid);
  if (lane < ROWS_PER_WARP) {
    const float2 s = __ldcg(rows + lane);
    row_mean[lane] = s.x;
    row_rstd[lane] = s.y;
  }
  __syncwarp();
  shared_leave(p, rb, tid);
}

""" + _KERNEL_HEAD)
_SHARED_BY_COLUMNS = (_KERNEL_HEAD, """__device__ float2 fn_col_parts[16 << 16];
""" + _SHARED_EXCHANGE + """
FN_INLINE void row_partials(const Params& p, const u16* x_batch, int row0, int c_begin, int c_end, float& sum_a,
                            float& ss_a, float& sum_b, float& ss_b, int lane) {
  const int D = p.model_dim, g = lane >> 2, t = lane & 3;
  const u32 ones = pack2_elem(1.f, 1.f);
  const u16* xa = x_batch + (long long)(row0 + g) * D + t * 8;
  const u16* xb = xa + 8LL * D;
  float sum[4] = {0.f, 0.f, 0.f, 0.f}, sq_lo[4] = {0.f, 0.f, 0.f, 0.f}, sq_hi[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
  for (int c0 = c_begin; c0 < c_end; c0 += STAT_GROUPS * 32) {
    u32x4 va[STAT_GROUPS], vb[STAT_GROUPS];
#pragma unroll
    for (int j = 0; j < STAT_GROUPS; ++j) {
      const bool in = c0 + j * 32 + t * 8 < c_end;
      va[j] = in ? ld_global16(xa + c0 + j * 32) : u32x4{0u, 0u, 0u, 0u};
      vb[j] = in ? ld_global16(xb + c0 + j * 32) : u32x4{0u, 0u, 0u, 0u};
    }
#pragma unroll
    for (int j = 0; j < STAT_GROUPS; ++j) {
      if (c0 + j * 32 >= c_end) break;
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
  const int holder = (lane & ~3) | (g >> 1);
  ss_a = __shfl_sync(FULL_WARP, (g & 1) ? sq_lo[1] : sq_lo[0], holder);
  ss_b = __shfl_sync(FULL_WARP, (g & 1) ? sq_hi[3] : sq_hi[2], holder);
  sum_a = sum[0];
  sum_b = sum[2];
}

FN_INLINE void shared_or_own_statistics(const Params& p, const StepCursor& cur, int row0, bool warp_rows,
                                        float* row_mean, float* row_rstd, float* stat_parts, int warp, int lane,
                                        int tid) {
  const long long batch_off = (long long)cur.b * p.q_len * p.model_dim;
  if (!statistics_shared_here(p, p.x + batch_off, row0, warp_rows, row_mean, row_rstd, stat_parts, warp, lane)) return;
  const int group = cur.head / p.heads_per_item, rb = cur.b * p.row_blocks + cur.row_block;
  const int cols = ((p.model_dim + p.head_groups - 1) / p.head_groups + 31) / 32 * 32;
  const int c_begin = min(p.model_dim, group * cols), c_end = min(p.model_dim, c_begin + cols);
  const int g = lane >> 2, t = lane & 3;
  const long long row_base = (long long)cur.b * p.q_len + row0;
  float sa, qa, sb, qb;
  row_partials(p, p.x + batch_off, row0, c_begin, c_end, sa, qa, sb, qb, lane);
  if (t == 0) {
    fn_col_parts[((long long)group << 16) + row_base + g] = make_float2(sa, qa);
    fn_col_parts[((long long)group << 16) + row_base + g + 8] = make_float2(sb, qb);
  }
  shared_arrive_and_wait(p, rb, tid);
  float sum_a = 0.f, ss_a = 0.f, sum_b = 0.f, ss_b = 0.f;
  for (int gr = 0; gr < p.head_groups; ++gr) {
    const float2 pa = __ldcg(fn_col_parts + ((long long)gr << 16) + row_base + g);
    const float2 pb = __ldcg(fn_col_parts + ((long long)gr << 16) + row_base + g + 8);
    sum_a += pa.x; ss_a += pa.y; sum_b += pb.x; ss_b += pb.y;
  }
  const float inv_d = 1.f / (float)p.model_dim;
  const float mean_a = NORM_IS_RMS ? 0.f : sum_a * inv_d, mean_b = NORM_IS_RMS ? 0.f : sum_b * inv_d;
  const float var_a = fmaf(-mean_a, mean_a, ss_a * inv_d), var_b = fmaf(-mean_b, mean_b, ss_b * inv_d);
  const bool redo = !NORM_IS_RMS && (mean_a * mean_a > 16.f * var_a || mean_b * mean_b > 16.f * var_b);
  if (t == 0) {
    row_mean[g] = mean_a;
    row_rstd[g] = rsqrtf(fmaxf(var_a, 0.f) + p.eps);
    row_mean[g + 8] = mean_b;
    row_rstd[g + 8] = rsqrtf(fmaxf(var_b, 0.f) + p.eps);
  }
  __syncwarp();
  if (__any_sync(FULL_WARP, redo)) row_statistics_exact(p, p.x + batch_off, row0, row_mean, row_rstd, lane);
  shared_leave(p, rb, tid);
}

""" + _KERNEL_HEAD)
_SHARED_CALL = ("""      if (cur.head_in_item == 0 && warp_rows) {  // a new item: statistics of this warp's rows
        const long long batch_off = (long long)cur.b * p.q_len * p.model_dim;
        // items of the later head groups hold the same rows: the first group's copies them
        u16* copy_batch = WRITE_O && p.x_copy != nullptr && cur.head == 0 ? p.x_copy + batch_off : nullptr;
        row_statistics(p, p.x + batch_off, copy_batch, row0, row_mean, row_rstd, stat_parts, warp, lane);
      }""", """      if (cur.head_in_item == 0 && !WRITE_O)  // (every warp: the exchange holds CTA barriers)
        shared_or_own_statistics(p, cur, row0, warp_rows, row_mean, row_rstd, stat_parts, warp, lane, tid);
      else if (cur.head_in_item == 0 && warp_rows) {
        const long long batch_off = (long long)cur.b * p.q_len * p.model_dim;
        u16* copy_batch = WRITE_O && p.x_copy != nullptr && cur.head == 0 ? p.x_copy + batch_off : nullptr;
        row_statistics(p, p.x + batch_off, copy_batch, row0, row_mean, row_rstd, stat_parts, warp, lane);
      }""")
TOLERANT = {"shared_column_stats"}  # variants whose sums come in another order: checked against a tolerance


VARIANTS = {  # name -> (what it changes, [(old, new), ...]); results must stay bit-identical (TOLERANT: close)
    "shared_stats": ("single-wave items: each row block's statistics summed once, split by rows between its head "
                     "groups' CTAs and exchanged through global memory", [_SHARED_BY_ROWS, _SHARED_CALL]),
    "shared_column_stats": ("the same exchange with each group's CTA summing its share of every row's columns "
                            "(1/groups of the round trips)", [_SHARED_BY_COLUMNS, _SHARED_CALL]),
    "stats_keep": ("the statistics pass's x loads evict-last in L2", _stats_keep(1.0)),
    "stats_keep_half": ("the same for half of the lines (createpolicy fraction 0.5)", _stats_keep(0.5)),
    "slice_last_use": ("the x slice copies evict-first (x's last read)",
                       [_HINT_HELPERS, _TMA_HELPERS] + _SLICE_LAST_USE),
    "stats_keep_slice_last": ("both of the above", _stats_keep(1.0) + [_TMA_HELPERS] + _SLICE_LAST_USE),
    "all_l2_hints": ("both, and the bulk stores of y evict-first",
                     _stats_keep(1.0) + [_TMA_HELPERS] + _SLICE_LAST_USE + _Y_EVICT_FIRST),
    "slice_last_y_first": ("the x slice copies and y's bulk stores evict-first",
                           [_HINT_HELPERS, _TMA_HELPERS] + _SLICE_LAST_USE + _Y_EVICT_FIRST),
    "stat_groups_5": ("the statistics pass with 5 loads of 16 bytes per row and lane in flight, not 4",
                      _stat_groups(5)),
    "stat_groups_6": ("the same with 6 (the most that spills nothing at 128 registers)", _stat_groups(6)),
}


def edited_render(original, name, edits, all_roles):
    """``render`` with ``edits`` applied to the one-tile kernels (every kernel with ``all_roles``)."""
    def render(spec):
        src = original(spec)
        if not (spec.tile.one_tile or all_roles):
            return src
        if name == "no_refill" and spec.tile.tma:  # its stages' barriers would never complete again
            raise SystemExit("cut 'no_refill' would hang a tile whose stages are bulk copies; time its twin "
                             "without tma (spec.tile_for) instead")
        for old, new in edits:
            if src.count(old) != 1:
                raise SystemExit(f"{name!r}: {old!r} is not found exactly once in the template")
            src = src.replace(old, new)
        return src
    return render


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="seed,sdxl64,sd15_64")
    ap.add_argument("--cuts", default=",".join(CUTS), help="which cuts, baseline first")
    ap.add_argument("--variants", nargs="?", const=",".join(VARIANTS), default=None,
                    help="time these result-keeping variants (none named, or 'all': every one) instead of the cuts")
    ap.add_argument("--all-roles", action="store_true", help="cut every role's kernel, not only the one-tile ones")
    ap.add_argument("--heads-per-item", type=int, default=None, help="pin G, the heads of one work item")
    args = ap.parse_args()
    select.force_heads_per_item = args.heads_per_item
    form = NoProjForm()
    gen = torch.Generator(device="cuda").manual_seed(0)
    original = render_mod.render
    if args.variants is None:
        names, table = args.cuts.split(","), CUTS
        inputs = {name: [form.make_inputs(SHAPES[name], torch.bfloat16, gen)] for name in args.shapes.split(",")}
    else:
        chosen = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
        names, table = ["baseline", *chosen], {"baseline": CUTS["baseline"], **VARIANTS}
        l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
        inputs = {name: input_sets_for(form, SHAPES[name], torch.bfloat16, gen, l2_bytes)
                  for name in args.shapes.split(",")}
    unknown = [name for name in names if name not in table]
    if unknown:
        raise SystemExit(f"unknown: {unknown}; known: {', '.join(table)}")
    print("cut".ljust(22) + "".join(f"{n:>12s}" for n in inputs) + "   (us, CUDA-graph replay median)")
    expected = {}
    for name in names:
        what, edits = table[name]
        cache.render = edited_render(original, name, edits, args.all_roles)
        codegen.forget_loaded_kernels()  # also drops the compiles held in memory: the edit is built and loaded
        if args.variants is not None:  # a variant must leave every bit of y as the baseline computes it
            for shape, sets in inputs.items():
                y = form.fused(**sets[0])
                if expected.setdefault(shape, y) is y:
                    continue
                if name in TOLERANT:
                    if not torch.allclose(y.float(), expected[shape].float(), rtol=2e-2, atol=2e-2):
                        raise SystemExit(f"variant {name!r} moved the result on {shape}: max difference "
                                         f"{(y.float() - expected[shape].float()).abs().max().item():.3g}")
                elif not torch.equal(y, expected[shape]):
                    raise SystemExit(f"variant {name!r} changed the result on {shape}")
        row = [graph_time_us(form.fused, sets, min_total_s=0.1) for sets in inputs.values()]
        print(f"{name:22s}" + "".join(f"{us:12.1f}" for us in row) + f"   {what}", flush=True)
    cache.render = original


if __name__ == "__main__":
    main()
