"""The plan's residual: the stage kernel copying x into y (the out GEMM then adds in place) against
``torch.addmm(x, ...)``, which copies x into a new y with a kernel of its own before the GEMM. One run, per
projection benchmark shape, GPU µs by CUDA-graph replay (median of windows), the two interleaved A B B A.

    PYTHONPATH=. python bench/plan_residual.py [--shapes seed,whisper_dec]

"A": the plan as committed (the op, as a compiled graph calls it); "B": the same pieces with addmm's copy (the
plan before the stage copied x). Also the host µs per call of each (enqueued back to back) and their largest
difference (both compute the same sums: expect 0).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_block import ProjForm, graph_time_us  # noqa: E402

from fusednorm import codegen  # noqa: E402
from fusednorm.plans import gemm_f32_out  # noqa: E402
from fusednorm.plans.weights import fold_weights  # noqa: E402


def plan_with_addmm_copy(x, k, v, gamma, beta, wq, bq, wo, bo):
    """run_plan as it was: the stage writes o only, torch.addmm copies x into y, then the GEMM adds to it."""
    B, Lq, D = x.shape
    x2 = x.view(B * Lq, D)
    folded = fold_weights("layer", gamma, beta, wq, bq, wo, bo, x.dtype)
    stage = codegen.StageIO(qraw=gemm_f32_out(x2, folded.wq.t()), q_u=folded.u, q_b=folded.b, o_cols=folded.o_cols)
    o = codegen.run_kernel(x, k, v, None, None, None, "layer", 1e-5, None, None, False, stage=stage)
    return torch.addmm(x2, o.view(B * Lq, folded.o_cols), folded.wo.t()).view(B, Lq, D)


def host_us(fn, inputs, calls=200):
    for _ in range(3):
        fn(**inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(**inputs)
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(ProjForm.shapes))
    opts = ap.parse_args(argv)
    form, dtype = ProjForm(), torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(int(time.time()))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; µs per block call")
    print("| shape | A: stage copies x | B: addmm copies x | A/B | host A | host B | max |A-B| |")
    print("|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for name in opts.shapes.split(","):
            shape = form.shapes[name]
            t = form.make_inputs(shape, dtype, gen)
            a, b = [], []
            for fn, out in ((form.fused, a), (plan_with_addmm_copy, b), (plan_with_addmm_copy, b), (form.fused, a)):
                out.append(graph_time_us(fn, [t]))
            diff = (form.fused(**t).float() - plan_with_addmm_copy(**t).float()).abs().max().item()
            ha, hb = host_us(form.fused, t), host_us(plan_with_addmm_copy, t)
            ma, mb = statistics.mean(a), statistics.mean(b)
            print(f"| {name} {shape} | {a[0]:.1f}, {a[1]:.1f} | {b[0]:.1f}, {b[1]:.1f} | {ma / mb:.3f} | {ha:.1f} | "
                  f"{hb:.1f} | {diff:.2e} |", flush=True)


if __name__ == "__main__":
    main()
