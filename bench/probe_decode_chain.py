"""The projection plan as a chain of programmatic launches, against its parts and against cuBLAS (one run).

    PYTHONPATH=. python bench/probe_decode_chain.py [--shapes whisper_dec,dec16,t5_dec] [--rounds 2]

For a few query rows (B * Lq <= 64) the plan runs skinny Q GEMM -> attention stage -> skinny out GEMM, each a
programmatic launch that lets the next start early: the stage prefetches its first K/V into L2 while the Q GEMM
runs, the out GEMM loads Wo' while the stage ends (fusednorm/plans). Timed per shape, alternating, by CUDA-graph
replay over enough input sets that L2 holds none of the next one's K/V: eager, Inductor, the projection-free kernel
on the same x/K/V (what the stage costs alone), and the plan with skinny or cuBLAS GEMMs, with the stage's
prefetch on or off (codegen.stage_prefetch). Each plan line also gives its relative difference to eager.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_block import NoProjForm, ProjForm, graph_time_us, input_sets_for  # noqa: E402
from fusednorm import codegen  # noqa: E402
from fusednorm.codegen import skinny  # noqa: E402

SHAPES = {**ProjForm.shapes, "dec16": (16, 1, 1280, 20, 1500), "dec4": (4, 1, 1280, 20, 1500)}
PLAN_VARIANTS = {"plan, skinny + prefetch": (True, True), "plan, skinny, no prefetch": (True, False),
                 "plan, cuBLAS + prefetch": (False, True), "plan, cuBLAS, no prefetch": (False, False)}


def set_variant(use_skinny: bool, prefetch: bool) -> None:
    skinny.enabled, codegen.stage_prefetch = use_skinny, prefetch
    codegen.call_plans.clear()  # cached launches carry the prefetch setting


def plan_timer(proj, sets, variant):
    def timed():
        set_variant(*variant)
        return graph_time_us(proj.fused, sets)
    return timed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="whisper_dec,dec16,t5_dec")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    proj, noproj, dt = ProjForm(), NoProjForm(), torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}, L2 {l2 >> 20} MB", flush=True)
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        sets = input_sets_for(proj, shape, dt, gen, l2)
        plain = [{k: t[k] for k in ("x", "k", "v", "gamma", "beta")} for t in sets]
        ref = proj.eager(**sets[0]).double()
        inductor = torch.compile(proj.eager, dynamic=False)
        timers = {"eager": lambda: graph_time_us(proj.eager, sets),
                  "Inductor": lambda: graph_time_us(inductor, sets),
                  "projection-free kernel (the stage alone)": lambda: graph_time_us(noproj.fused, plain)}
        for label, variant in PLAN_VARIANTS.items():
            timers[label] = plan_timer(proj, sets, variant)
        print(f"{name} {shape}, {len(sets)} input sets; µs", flush=True)
        for r in range(args.rounds):
            for label, timer in timers.items():
                us = timer()
                line = f"  {label:42s} {us:8.1f}"
                if label.startswith("plan"):
                    y = proj.fused(**sets[0]).double()
                    line += f"   rel diff to eager {((y - ref).norm() / ref.norm()).item():.1e}"
                print(line, flush=True)
        set_variant(True, True)


if __name__ == "__main__":
    main()
