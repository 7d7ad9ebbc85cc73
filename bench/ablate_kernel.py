"""Where the few_keys kernel's GPU time goes: the kernel rebuilt with one phase cut out at a time, timed on the
short-key shapes in one run. The cut kernels compute wrong results on purpose; only their time is read.

    PYTHONPATH=. python bench/ablate_kernel.py [--shapes seed,sdxl64,sd15_64] [--all-roles --shapes t5_dec,...]

Each cut is an exact text replacement in the rendered source of the one-tile kernels (with --all-roles, of every
kernel: for shapes that other roles take);
a replacement that no longer matches the template stops the run, so the cuts cannot silently go stale. The mma cuts
edit both the mma.sync and the warpgroup-mma (sm_90) code, so they cut whichever the GPU runs.
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
from bench_block import SHAPES, NoProjForm, graph_time_us  # noqa: E402
from fusednorm.codegen import cache, render as render_mod  # noqa: E402

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="seed,sdxl64,sd15_64")
    ap.add_argument("--cuts", default=",".join(CUTS), help="which cuts, baseline first")
    ap.add_argument("--all-roles", action="store_true", help="cut every role's kernel, not only the one-tile ones")
    args = ap.parse_args()
    form = NoProjForm()
    gen = torch.Generator(device="cuda").manual_seed(0)
    original = render_mod.render
    inputs = {name: form.make_inputs(SHAPES[name], torch.bfloat16, gen) for name in args.shapes.split(",")}
    print("cut".ljust(16) + "".join(f"{n:>12s}" for n in inputs) + "   (us, CUDA-graph replay median)")
    for cut in args.cuts.split(","):
        what, edits = CUTS[cut]
        def render(spec, _edits=edits):
            src = original(spec)
            if not (spec.tile.one_tile or args.all_roles):
                return src
            if cut == "no_refill" and spec.tile.tma:  # its stages' barriers would never complete again
                raise SystemExit("cut 'no_refill' would hang a tile whose stages are bulk copies; time its twin "
                                 "without tma (spec.tile_for) instead")
            for old, new in _edits:
                if src.count(old) != 1:
                    raise SystemExit(f"cut {cut!r}: {old!r} is not found exactly once in the template")
                src = src.replace(old, new)
            return src
        cache.render = render
        codegen.forget_loaded_kernels()  # also drops the compiles held in memory: the cut is built and loaded
        row = [graph_time_us(form.fused, [t], min_total_s=0.1) for t in inputs.values()]
        print(f"{cut:16s}" + "".join(f"{us:12.1f}" for us in row) + f"   {what}", flush=True)
    cache.render = original


if __name__ == "__main__":
    main()
