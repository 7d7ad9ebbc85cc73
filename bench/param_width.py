"""The projection-free kernel with the norm's gamma/beta as x's type against the same values as float32.

    PYTHONPATH=. python bench/param_width.py [--shapes seed,sdxl64,sd15_64,t5_dec] [--rounds 2]

A bf16/fp16 parameter is unpacked to fp32 by every lane of every warp for every head it builds Q for; an fp32 one
is read as it is (the template's AFFINE_WIDE). Both give the same bits (bf16 -> fp32 is exact), which the run
checks before it times anything. Same input sets for both, timed alternately (A B A B), µs per call by CUDA-graph
replay as bench/bench_block.py times the block.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_block import NoProjForm, graph_time_us, input_sets_for  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="seed,sdxl64,sd15_64,t5_dec")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    form, dtype = NoProjForm(), torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(7)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; µs per call, rounds alternate")
    for name in args.shapes.split(","):
        shape = NoProjForm.shapes[name]
        narrow = input_sets_for(form, shape, dtype, gen, l2)
        wide = [dict(s, gamma=s["gamma"].float(), beta=s["beta"].float()) for s in narrow]
        y_narrow, y_wide = form.fused(**narrow[0]), form.fused(**wide[0])
        if not torch.equal(y_narrow, y_wide):
            sys.exit(f"{name}: fp32 parameters changed the result ({(y_narrow - y_wide).abs().max().item():.3g})")
        times = {"x's type": [], "float32": []}
        for _ in range(args.rounds):
            times["x's type"].append(graph_time_us(form.fused, narrow))
            times["float32"].append(graph_time_us(form.fused, wide))
        cols = "  ".join(f"{k} {', '.join(f'{t:.1f}' for t in v)}" for k, v in times.items())
        change = (min(times["float32"]) / min(times["x's type"]) - 1) * 100
        print(f"{name:8s} {str(shape):26s} {cols}   float32 {change:+.1f} %", flush=True)


if __name__ == "__main__":
    main()
