"""Host time of one call of the fused op, projection-free and with projections (the plan), and where it goes.

    PYTHONPATH=. python bench/host_profile_plan.py

Each line: host µs per call (enqueueing back to back) and wall µs per call (the GPU included), for the op
through the dispatcher (as a compiled graph calls it) and for the pieces underneath; then the plan's call taken
apart (each piece alone, on the same tensors: what its host time is made of); then cProfile of the plan's op
call and of the eager projection-free call, hottest first.
"""
from __future__ import annotations

import cProfile
import pstats
import time

import torch

import fusednorm
from fusednorm import codegen, dispatch
from fusednorm.plans import gemm_f32_out, run_plan
from fusednorm.plans.weights import fold_weights

B, Lq, D, H, Lk = 2, 4096, 320, 8, 77  # an SD-1.5 UNet cross-attention block at 64x64
d = D // H
dev, dt = "cuda", torch.bfloat16
r = lambda *s: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
x, k, v = r(B, Lq, D), r(B, Lk, H, d).transpose(1, 2), r(B, Lk, H, d).transpose(1, 2)
gamma, beta = 1 + 0.1 * r(D), 0.1 * r(D)
plan_args = (x, k, v, gamma, beta, r(D, D) / D**0.5, None, r(D, D) / D**0.5, r(D), None, "layer", 1e-5)
noproj_args = (x, k, v, gamma, beta, None, None, None, None, None, "layer", 1e-5)
op = torch.ops.fusednorm.pre_norm_cross_attn


def per_call_us(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e6
    return host, wall


def uncached_plan():  # the full path every call: checks aside, what a call with a new signature pays
    codegen.call_plans.clear()
    return run_plan(*plan_args, None, None, False)


print(f"fusednorm from {fusednorm.__file__}", flush=True)
with torch.no_grad():
    for name, fn in (("plan: op through the dispatcher (cached signature)", lambda: op(*plan_args)),
                     ("plan: run_plan, nothing cached but the weights and kernels", uncached_plan),
                     ("projection-free: op through the dispatcher", lambda: op(*noproj_args)),
                     ("projection-free: fused_pre_norm_cross_attn (eager)",
                      lambda: fusednorm.fused_pre_norm_cross_attn(x, k, v, gamma, beta)),
                     ("for scale: torch.mm of the Q GEMM's shape", lambda: torch.mm(x.view(-1, D), plan_args[5]))):
        host, wall = per_call_us(fn)
        print(f"{name}: host {host:.1f} us/call (enqueue), wall {wall:.1f} us/call", flush=True)
    print("\nthe plan's call, piece by piece:", flush=True)
    op(*plan_args)  # leaves the stage's launch in codegen.call_plans
    keyed = (*plan_args, None, None, False)  # mask, norm, eps, scale, sm_count, check_numerics
    stage_call = codegen.call_plans[dispatch.call_key(*keyed)]
    x2, wq, wo, bo = x.view(-1, D), plan_args[5], plan_args[7], plan_args[8]
    folded = fold_weights("layer", gamma, beta, wq, None, wo, bo, x.dtype)
    qraw = gemm_f32_out(x2, folded.wq.t())
    o2 = torch.randn(B * Lq, folded.o_cols, device=dev, dtype=dt)
    y2 = torch.empty_like(x2)

    def stage_launch():
        stage = codegen.StageIO(qraw=qraw, q_u=folded.u, q_b=folded.b, o_cols=folded.o_cols, x_copy=y2)
        return codegen.launch_call(stage_call, x, k, v, None, None, None, stage)

    for name, fn in (("dispatch.call_key", lambda: dispatch.call_key(*keyed)),
                     ("fold_weights (a hit)", lambda: fold_weights("layer", gamma, beta, wq, None, wo, bo, x.dtype)),
                     ("Q GEMM, torch.mm(out_dtype=torch.float32)", lambda: gemm_f32_out(x2, folded.wq.t())),
                     ("Q GEMM as plain torch.mm (16-bit out), for scale", lambda: torch.mm(x2, folded.wq.t())),
                     ("torch.empty_like(x2)", lambda: torch.empty_like(x2)),
                     ("the stage's launch_call (o allocated, tensor maps, cuLaunchKernel)", stage_launch),
                     ("out GEMM, y2.addmm_(o, wo^T)", lambda: y2.addmm_(o2, folded.wo.t())),
                     ("run_plan with the cached stage launch", lambda: run_plan(*keyed, stage_call=stage_call)),
                     ("dispatch.run_cuda_cached (the op's device implementation)",
                      lambda: dispatch.run_cuda_cached(*keyed))):
        host, wall = per_call_us(fn)
        print(f"  {name}: host {host:.1f} us/call", flush=True)
    for name, fn in (("plan: op through the dispatcher", lambda: op(*plan_args)),
                     ("projection-free: fused_pre_norm_cross_attn (eager)",
                      lambda: fusednorm.fused_pre_norm_cross_attn(x, k, v, gamma, beta))):
        print(f"\ncProfile, {name}, 100 calls:", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
