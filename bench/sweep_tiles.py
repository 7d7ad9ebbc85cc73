"""Time candidate tile configurations of the generated kernel on the benchmark shapes (one run, one GPU).

    PYTHONPATH=. python bench/sweep_tiles.py [--shapes seed,t5_dec] [--form proj]

For each shape: the role the run-time choice picks, then each candidate TileConfig swapped in for that role
(compiled on the spot), with its GPU time (CUDA-graph replay median) and its difference from eager. Use it to
choose `spec.tile_for`; the chosen table is what CI compiles. With ``--form proj`` the block is the projection plan
and the tiles are its attention stage's: the planned stage first, then the other tiles of the long and many_keys
roles forced (over FEW_KEYS keys), or up to FEW_KEYS keys the few_keys role's candidates forced (the stage takes
that role only where its items fill the GPU 4 times over).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fusednorm.codegen as codegen  # noqa: E402
from bench_block import FORMS, SHAPES, graph_time_us, rel_diff  # noqa: E402
from fusednorm.codegen import select, spec as spec_mod  # noqa: E402
from fusednorm.codegen.spec import TileConfig  # noqa: E402

T = TileConfig
WG = dict(wgmma=True)  # sm_90 only: the warpgroup mma (head dims 64 and 128)
WGT = dict(wgmma=True, tma=True)  # and stages filled by bulk tensor copies
CANDIDATES = {  # role -> candidate tiles, each with the __launch_bounds__ minimum CTAs per SM it is built with
    "long": [(T(4, 2, 64, 1, 2), 1), (T(4, 2, 64, 1, 3), 1), (T(4, 1, 64, 1, 2), 3), (T(4, 1, 64, 1, 3), 2),
             (T(8, 1, 64, 1, 2), 2), (T(8, 1, 64, 1, 3), 1), (T(4, 1, 128, 1, 2), 1),
             (T(8, 1, 64, 1, 2, **WG), 1), (T(8, 1, 64, 1, 3, **WG), 1), (T(8, 1, 128, 1, 2, **WG), 1),
             (T(4, 1, 64, 1, 2, **WG), 3), (T(4, 1, 64, 1, 3, **WG), 2), (T(4, 1, 128, 1, 2, **WG), 2),
             (T(4, 1, 128, 1, 3, **WG), 1),
             (T(4, 1, 96, 1, 2, **WG), 3), (T(4, 1, 112, 1, 2, **WG), 3),  # 3 CTAs per SM: 67 / 75 KB, <= 168 regs
             (T(4, 1, 128, 1, 2, **WGT), 2), (T(4, 1, 128, 1, 3, **WGT), 1), (T(4, 1, 112, 1, 2, **WGT), 3),
             (T(4, 1, 112, 1, 3, **WGT), 2), (T(4, 1, 64, 1, 3, **WGT), 3),
             # 128-row items (two warpgroups share each K/V stage: half the K/V traffic of 64-row items)
             (T(8, 1, 64, 1, 2, **WGT), 2), (T(8, 1, 128, 1, 2, **WGT), 1), (T(8, 1, 128, 1, 3, **WGT), 1),
             (T(8, 1, 112, 1, 2, **WGT), 1), (T(8, 1, 64, 1, 3, **WGT), 1), (T(8, 1, 64, 1, 4, **WGT), 1),
             (T(8, 1, 64, 1, 3, **WGT), 2)],  # a third stage at 2 CTAs per SM (110 KB): lost, PERF.md twelfth run
    "base": [(T(4, 1, 64, 1, 2), 3), (T(4, 1, 128, 1, 2), 1), (T(4, 1, 64, 1, 3), 3),
             (T(4, 1, 64, 1, 2, **WG), 3), (T(8, 1, 64, 1, 2, **WG), 1), (T(4, 1, 64, 1, 2, **WGT), 3)],
    "few_keys": [(T(8, 1, 80, 1, 2, True), 2), (T(16, 1, 80, 1, 2, True), 1), (T(4, 1, 80, 1, 2, True), 3),
                 (T(4, 2, 80, 1, 2, True), 1), (T(6, 2, 80, 1, 2, True), 2), (T(8, 2, 80, 1, 2, True), 1),
                 (T(4, 2, 64, 1, 2), 1), (T(4, 1, 64, 1, 2), 3),
                 (T(10, 1, 80, 1, 2, True), 2), (T(6, 1, 80, 1, 2, True), 3),  # 20 / 18 warps per SM, 96 registers
                 (T(8, 1, 80, 1, 2, True, **WG), 2), (T(16, 1, 80, 1, 2, True, **WG), 1),
                 (T(4, 1, 80, 1, 2, True, **WG), 3), (T(8, 1, 80, 1, 3, True, **WG), 1),
                 (T(12, 1, 80, 1, 2, True), 2), (T(12, 1, 80, 1, 2, True, **WG), 2),  # 24 warps per SM, 80 registers
                 (T(8, 1, 80, 1, 2, True), 3),  # 24 warps per SM where 3 CTAs' shared memory fits (d <= 40)
                 (T(8, 1, 80, 1, 2, True, **WGT), 2), (T(8, 1, 80, 1, 3, True, **WGT), 2),
                 (T(4, 1, 80, 1, 2, True, **WGT), 3), (T(4, 1, 80, 1, 3, True, **WGT), 2),
                 (T(16, 1, 80, 1, 2, True, **WGT), 1),
                 # sm_90, d = 40: stages of unpadded rows filled by bulk copies, mma.sync (spec.dense_rows_fit)
                 (T(8, 1, 80, 1, 2, True, tma=True), 2), (T(8, 1, 80, 1, 3, True, tma=True), 2),
                 # the same with 64-row items at 4 CTAs per SM (SD 1.5: 512 items for 528 slots; as the default it
                 # lost 18 %, PERF.md twenty-first run), or 4 warps of two m-tiles each (twice the independent mma
                 # work per warp, 162 registers; not yet timed)
                 (T(4, 1, 80, 1, 2, True, tma=True), 4), (T(4, 2, 80, 1, 2, True, tma=True), 2)],
    "short": [(T(4, 1, 16, 4, 4), 1), (T(4, 1, 32, 4, 4), 1), (T(4, 1, 16, 4, 6), 1), (T(8, 1, 16, 8, 4), 1),
              (T(4, 1, 32, 4, 3), 1), (T(8, 1, 16, 8, 3), 1),
              # swizzled stages, merged in a stage (no buffer of its own): 77 KB at 4 x 64 keys, 108 KB at 3 x 128
              (T(4, 1, 16, 4, 4), 2), (T(4, 1, 16, 4, 3), 3), (T(4, 1, 16, 4, 6), 2), (T(4, 1, 32, 4, 2), 2),
              (T(4, 1, 32, 4, 2), 3), (T(4, 1, 32, 4, 3), 2), (T(8, 1, 16, 8, 2), 2), (T(8, 1, 16, 8, 3), 2),
              (T(4, 1, 48, 4, 2), 2)],
}
WS = dict(wgmma=True, tma=True, producer=True)  # warp-specialised (templates/pnca/kernel_ws.cu): one CTA per SM
CANDIDATES["many_keys"] = CANDIDATES["long"] + [  # the same tiles, chosen from MANY_KEYS keys on, and the
    # warp-specialised ones (kernel_ws.cu takes two consumer warpgroups: three, with 192-row items, lost on Whisper
    # prefill by 8-14 % and were level on Lk 2048 with spills at 160 registers; PERF.md thirty-eighth run)
    (T(8, 1, 128, 1, 3, **WS), 1), (T(8, 1, 128, 1, 4, **WS), 1), (T(8, 1, 96, 1, 3, **WS), 1),
    (T(8, 1, 96, 1, 4, **WS), 1), (T(8, 1, 80, 1, 4, **WS), 1)]
CANDIDATES["many_keys_fine"] = CANDIDATES["many_keys"]
# below MANY_KEYS keys too (T5's 512), the warp-specialised kernel in 128- and 64-key stages
CANDIDATES["long"] = CANDIDATES["long"] + [(T(8, 1, 128, 1, 3, **WS), 1), (T(8, 1, 64, 1, 4, **WS), 1)]
# and for few keys (d = 64: the seed, SDXL): one key tile per head, so its QK^T, softmax and P V run in turn and the
# two consumer warpgroups overlap only each other, at one CTA of 8 computing warps per SM (the one-tile kernels run
# 2 x 8); the producer copies the next heads' x slices and K/V ahead. H100, forty-second run: the seed 185.5 us
# against the one-tile kernel's 158.2, SDXL 64x64 level (docs/PERF.md)
CANDIDATES["few_keys"] = CANDIDATES["few_keys"] + [(T(8, 1, 80, 1, 4, **WS), 1), (T(8, 1, 80, 1, 3, **WS), 1)]
DEFAULT_SHAPES = "seed,sdxl64,sd15_64,t5_dec,whisper_dec,whisper_pre"
SHAPES = {**SHAPES, "base_mid": (16, 96, 1024, 16, 300),  # sweep only: a shape the "base" role takes
          "pre_many": (16, 1792, 1280, 20, 1500),  # many_keys or long: Whisper prefill's keys, 4x its rows,
          "lk2048_few": (4, 448, 1024, 16, 2048),  # and Lk 2048 with few rows
          "dec16": (16, 1, 1280, 20, 1500),  # Whisper decode at batch 16: items fill about half the GPU
          "dec4": (4, 1, 1280, 20, 1500), "dec1": (1, 1, 1280, 20, 1500),  # and at batch 4 and 1
          "dec1_base": (1, 1, 512, 8, 1500)}  # Whisper-base decode at batch 1: 8 (batch, head) pairs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--only", default="", help="candidate tokens to time (default: all of the role's)")
    ap.add_argument("--groups", default="", help="heads per item G to time the chosen tile with, e.g. 16,8,4 "
                    "('--only none' skips the tile candidates)")
    ap.add_argument("--chunks", default="", help="key-split tiles: runs of keys per head to time the chosen tile "
                    "with, e.g. 1,2,4,8 (1: no split between CTAs)")
    ap.add_argument("--stat-groups", default="", help="column groups of the row statistics to time the chosen "
                    "tile with, e.g. 1 (each item sums its rows whole, sharing nothing)")
    ap.add_argument("--form", default="noproj", choices=sorted(FORMS))
    args = ap.parse_args()
    form = FORMS[args.form]()
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    major, minor = torch.cuda.get_device_capability(0)
    arch = major * 10 + minor
    original = spec_mod.tile_for
    original_min_ctas = spec_mod.KernelSpec.min_ctas_per_sm
    for name in args.shapes.split(","):
        shape = {**SHAPES, **form.shapes}[name]
        B, Lq, D, H, Lk = shape
        d = D // H
        t = form.make_inputs(shape, torch.bfloat16, gen)
        ref = form.eager(**t)
        stage = args.form == "proj"
        ws = original("many_keys", d, arch, stage, warp_specialised=True).producer
        role = select.tile_role(Lq, Lk, B, H, sms, stage=stage, many_keys_ws=ws)
        print(f"{name} {shape} role={role} default={original(role, d, arch, stage, ws).token}", flush=True)
        if stage:
            print(f"  planned stage    {graph_time_us(form.fused, [t], min_total_s=0.1):8.1f} us  rel diff "
                  f"{rel_diff(form.fused(**t), ref):.1e}", flush=True)
            seen = {original(role, d, arch, stage, ws)}
            for other in ("long", "many_keys", "many_keys_fine") if Lk > spec_mod.FEW_KEYS and Lq > 16 else ():
                tile = original(other, d, arch, stage, ws)  # the stage's other tiles for many keys, forced
                if tile in seen:
                    continue
                seen.add(tile)
                select.force_role = other
                codegen.forget_loaded_kernels()
                print(f"  forced {other:14s} {tile.token:20s} {graph_time_us(form.fused, [t], min_total_s=0.1):8.1f} "
                      f"us  rel diff {rel_diff(form.fused(**t), ref):.1e}", flush=True)
                select.force_role = None
                codegen.forget_loaded_kernels()
            if Lk > spec_mod.FEW_KEYS:
                continue
            role = select.force_role = "few_keys"
        for tile, min_ctas in CANDIDATES[role]:
            if args.only and tile.token not in args.only.split(","):
                continue
            if d > 128 and tile.m_tiles * tile.block_n > 64 or tile.one_tile and Lk > tile.block_n:
                continue
            if tile.wgmma and (arch != 90 or d not in spec_mod.WGMMA_HEAD_DIMS):
                continue
            if tile.tma and not tile.wgmma and (arch != 90 or not spec_mod.dense_rows_fit(d)):
                continue
            spec_mod.KernelSpec.min_ctas_per_sm = property(lambda s, _t=tile, _m=min_ctas: _m if s.tile == _t
                                                           else original_min_ctas.fget(s))
            codegen.tile_for = (lambda r, hd, arch=80, stage=False, warp_specialised=False, _t=tile:
                                _t if r == role else original(r, hd, arch, stage, warp_specialised))
            codegen.forget_loaded_kernels()  # cached launches hold the previous kernel
            try:
                diff = rel_diff(form.fused(**t), ref)
                us = graph_time_us(form.fused, [t], min_total_s=0.1)
                kern = codegen._families[next(iter(codegen._families))][role] if codegen._families else None
                occ = f"{kern.ctas_per_sm} CTAs/SM, {kern.registers} regs" if kern is not None else ""
                print(f"  {tile.token:16s} min{min_ctas} {us:8.1f} us  rel diff {diff:.1e}  {occ}", flush=True)
            except Exception as e:  # noqa: BLE001 - a candidate that does not fit is reported, not fatal
                print(f"  {tile.token:14s} failed: {type(e).__name__}: {str(e)[:150]}", flush=True)
        codegen.tile_for = original
        spec_mod.KernelSpec.min_ctas_per_sm = original_min_ctas
        select.force_role = None
        codegen.forget_loaded_kernels()
        if args.groups:
            time_forced(form, t, ref, "force_heads_per_item", [int(g) for g in args.groups.split(",")])
        if args.chunks:
            time_forced(form, t, ref, "force_kv_chunks", [int(c) for c in args.chunks.split(",")])
        if args.stat_groups:
            time_forced(form, t, ref, "force_stat_col_groups", [int(c) for c in args.stat_groups.split(",")])
        del t, ref
        torch.cuda.empty_cache()


def time_forced(form, t, ref, knob, values):
    """The chosen tile as planned, then with ``select.<knob>`` (force_heads_per_item: G heads per item;
    force_kv_chunks: runs of keys per head; force_stat_col_groups: the statistics' column groups) pinned to each
    value."""
    for value in [None] + values:
        setattr(select, knob, value)
        codegen.forget_loaded_kernels()
        diff = rel_diff(form.fused(**t), ref)
        us = graph_time_us(form.fused, [t], min_total_s=0.1)
        p = next(iter(codegen._plans.values()))
        print(f"  {'planned' if value is None else 'forced'}: G {p.heads_per_item:2d} groups {p.head_groups:2d} runs "
              f"{p.kv_chunks:2d} of {p.chunk_tiles:2d} key tiles, items {p.items:5d} grid {p.grid:4d} stat groups "
              f"{p.stat_col_groups}{' shared' if p.share_stats else ''} {us:8.1f} us  rel diff {diff:.1e}", flush=True)
    setattr(select, knob, None)
    codegen.forget_loaded_kernels()


if __name__ == "__main__":
    main()
