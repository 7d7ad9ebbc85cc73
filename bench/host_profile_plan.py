"""Host time of one call of the fused op with projections (the plan), and where it goes (cProfile).

    PYTHONPATH=. python bench/host_profile_plan.py
"""
from __future__ import annotations

import cProfile
import pstats
import time

import torch

import fusednorm  # noqa: F401  (registers the op)
from fusednorm.plans import run_plan

B, Lq, D, H, Lk = 2, 4096, 320, 8, 77  # an SD-1.5 UNet cross-attention block at 64x64
d = D // H
dev, dt = "cuda", torch.bfloat16
r = lambda *s: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
args = (r(B, Lq, D), r(B, Lk, H, d).transpose(1, 2), r(B, Lk, H, d).transpose(1, 2), 1 + 0.1 * r(D), 0.1 * r(D),
        r(D, D) / D**0.5, None, r(D, D) / D**0.5, r(D), None, "layer", 1e-5)
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


with torch.no_grad():
    for name, fn in (("op (dispatcher)", lambda: op(*args)),
                     ("run_plan", lambda: run_plan(*args, None, None, False))):
        host, wall = per_call_us(fn)
        print(f"{name}: host {host:.1f} us/call (enqueue), wall {wall:.1f} us/call", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        op(*args)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
