"""Host time of one call of the fused op, projection-free and with projections (the plan), and where it goes.

    PYTHONPATH=. python bench/host_profile_plan.py

Each line: host µs per call (enqueueing back to back) and wall µs per call (the GPU included), for the op
through the dispatcher (as a compiled graph calls it) and for the pieces underneath; then cProfile of the plan's
op call and of the eager projection-free call, hottest first.
"""
from __future__ import annotations

import cProfile
import pstats
import time

import torch

import fusednorm
from fusednorm import codegen
from fusednorm.plans import run_plan

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


with torch.no_grad():
    for name, fn in (("plan: op through the dispatcher (cached signature)", lambda: op(*plan_args)),
                     ("plan: run_plan, nothing cached but the weights and kernels", uncached_plan),
                     ("projection-free: op through the dispatcher", lambda: op(*noproj_args)),
                     ("projection-free: fused_pre_norm_cross_attn (eager)",
                      lambda: fusednorm.fused_pre_norm_cross_attn(x, k, v, gamma, beta)),
                     ("for scale: torch.mm of the Q GEMM's shape", lambda: torch.mm(x.view(-1, D), plan_args[5]))):
        host, wall = per_call_us(fn)
        print(f"{name}: host {host:.1f} us/call (enqueue), wall {wall:.1f} us/call", flush=True)
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
