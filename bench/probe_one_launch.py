"""Decode blocks with both projections, one launch against three (plans.takes_one_launch), with eager and Inductor
in the same process: GPU µs by CUDA-graph replay (bench_block.graph_time_us), bf16.

    PYTHONPATH=. python bench/probe_one_launch.py [--shapes 64x1,16x1,1x1,8x4] [--no-inductor]

Shapes are B x Lq of Whisper's decoder block (D 1280, 20 heads, Lk 1500); the issue's decode shape is 64x1. Also
printed: the one-launch result's relative difference from eager and from the three-launch plan.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_block import ProjForm, graph_time_us, input_sets_for, rel_diff  # noqa: E402

from fusednorm import codegen, plans  # noqa: E402
from fusednorm.codegen import launch  # noqa: E402


def timed(form, sets, one: bool) -> tuple[float, torch.Tensor, str]:
    plans.one_launch = one
    codegen.call_plans.clear()  # a cached launch keeps the form it was cached in
    try:
        y = form.fused(**sets[0])
        key = launch.last_launched
        return graph_time_us(form.fused, sets), y, key
    finally:
        plans.one_launch = True
        codegen.call_plans.clear()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64x1,16x1,1x1,8x4")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--lk", type=int, default=1500, help="keys (16: the projections' share of the launch)")
    args = ap.parse_args()
    form, gen = ProjForm(), torch.Generator(device="cuda").manual_seed(0)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    inductor = None if args.no_inductor else torch.compile(form.eager, dynamic=False)
    print(f"device {torch.cuda.get_device_name()}")
    print(f"Lk {args.lk}")
    print("| B x Lq | eager | Inductor | three launches | one launch | one vs eager | one vs three |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.shapes.split(","):
        B, Lq = map(int, spec.split("x"))
        shape = (B, Lq, 1280, 20, args.lk)
        sets = input_sets_for(form, shape, torch.bfloat16, gen, l2)
        eager_us = graph_time_us(form.eager, sets)
        inductor_us = graph_time_us(inductor, sets) if inductor else float("nan")
        three_us, y3, key3 = timed(form, sets, one=False)
        one_us, y1, key1 = timed(form, sets, one=True)
        assert "_pi_" in key1 and "_pi_" not in key3, (key1, key3)
        ref = form.eager(**sets[0])
        print(f"| {B} x {Lq} | {eager_us:.1f} | {inductor_us:.1f} | {three_us:.1f} | {one_us:.1f} | "
              f"{rel_diff(y1, ref):.2e} | {rel_diff(y1, y3):.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
