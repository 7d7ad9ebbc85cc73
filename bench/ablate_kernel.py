"""Where the few_keys kernel's GPU time goes: the kernel rebuilt with one phase cut out at a time, timed on the
short-key shapes in one run. The cut kernels compute wrong results on purpose; only their time is read.

    PYTHONPATH=. python bench/ablate_kernel.py [--shapes seed,sdxl64,sd15_64] [--all-roles --shapes t5_dec,...]

Each cut is an exact text replacement in the rendered source of the one-tile kernels (with --all-roles, of every
kernel: for shapes that other roles take);
a replacement that no longer matches the template stops the run, so the cuts cannot silently go stale. The mma cuts
edit both the mma.sync and the warpgroup-mma (sm_90) code, so they cut whichever the GPU runs.

    PYTHONPATH=. python bench/ablate_kernel.py --variants [--shapes ...] [--rounds N]

Variants are edits that keep the result: each kernel's output must equal the baseline's bit for bit (the run
stops otherwise), and they are timed over rotating input sets, as bench_block.py times the block, because they are
about what stays in L2 (the cuts are timed on one set).
"""
from __future__ import annotations

import argparse
import os
import statistics
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
                      [("      if (cur.head_in_item == 0) {  // a new item", "      if (false) {  // a new item")]),
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


_WS_BOUNDARY = ("        block_boundary(p.kv_len);  // the P V's wait stays below the exponentials\n", "")
_WS_MAX_TREE = (  # kernel_ws.cu's softmax_tile's row maximum as a tree of pairs (5 steps deep), and its chain
    "    float part[S_NTILES];\n#pragma unroll\n"
    "    for (int nt = 0; nt < S_NTILES; ++nt) part[nt] = fmaxf(s[nt][2 * half], s[nt][2 * half + 1]);\n"
    "#pragma unroll\n    for (int w = 1; w < S_NTILES; w *= 2)  // (pairs at distance w: a count the unroller sees)\n"
    "#pragma unroll\n      for (int i = 0; i < S_NTILES; i += 2 * w) part[i] = fmaxf(part[i], part[i + w]);\n"
    "    float mx = fmaxf(neg_inf(), part[0]);\n")
_WS_MAX_CHAIN = ("    float mx = neg_inf();\n#pragma unroll\n    for (int nt = 0; nt < S_NTILES; ++nt) "
                 "mx = fmaxf(mx, fmaxf(s[nt][2 * half], s[nt][2 * half + 1]));\n")


VARIANTS = {  # name -> (what it changes, [(old, new), ...]); results must stay bit-identical
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
    # (ws_: the warp-specialised kernel only, templates/pnca/kernel_ws.cu; shapes whisper_pre, seed_lk2048)
    "ws_wait_hoisted": ("no block boundary: ptxas waits for the P V before the exponentials", [_WS_BOUNDARY]),
    "ws_max_tree": ("the row maximum as a tree of pairs, 5 steps deep, not a chain of 16 (the same bits)",
                    [(_WS_MAX_CHAIN, _WS_MAX_TREE)]),
}


def edited_render(original, name, edits, all_roles):
    """``render`` with ``edits`` applied to the one-tile kernels (every kernel with ``all_roles``); a ws_ variant's
    to the warp-specialised kernels only."""
    def render(spec):
        src = original(spec)
        if name.startswith("ws_") != spec.tile.producer:
            return src
        if not (spec.tile.one_tile or all_roles or spec.tile.producer):
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
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every kernel this many times, round robin (each from its own cache directory), and "
                         "print the median: a GPU whose clocks drift under a long load moves one round, not a column")
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
    expected, times = {}, {name: [] for name in names}
    cache_root = os.environ["FUSEDNORM_CACHE_DIR"]
    for rnd in range(args.rounds):
        for name in names:
            what, edits = table[name]
            cache.render = edited_render(original, name, edits, args.all_roles)
            os.environ["FUSEDNORM_CACHE_DIR"] = os.path.join(cache_root, name)  # compiled once, loaded each round
            codegen.forget_loaded_kernels()  # also drops the compiles held in memory: the edit is built and loaded
            if args.variants is not None and rnd == 0:  # a variant must leave every bit of y as the baseline's
                for shape, sets in inputs.items():
                    y = form.fused(**sets[0])
                    if expected.setdefault(shape, y) is y:
                        continue
                    if not torch.equal(y, expected[shape]):
                        raise SystemExit(f"variant {name!r} changed the result on {shape}")
            row = [graph_time_us(form.fused, sets, min_total_s=0.1) for sets in inputs.values()]
            times[name].append(row)
            label = name if args.rounds == 1 else f"{name} ({rnd + 1})"
            print(f"{label:22s}" + "".join(f"{us:12.1f}" for us in row) + f"   {what}", flush=True)
    if args.rounds > 1:
        print(f"median of {args.rounds} rounds:")
        for name in names:
            row = [statistics.median(r[i] for r in times[name]) for i in range(len(inputs))]
            print(f"{name:22s}" + "".join(f"{us:12.1f}" for us in row) + f"   {table[name][0]}", flush=True)
    cache.render = original
    os.environ["FUSEDNORM_CACHE_DIR"] = cache_root


if __name__ == "__main__":
    main()
