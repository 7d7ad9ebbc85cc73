"""Time the decode plan's two GEMM shapes (few rows, M = batch x Lq <= 64) in the forms torch can run them.

    PYTHONPATH=. python bench/probe_skinny.py [--dims 1280] [--rows 1,16,64]

The plan's Q GEMM (x @ Wq'^T, float32 out) and out GEMM (y += [o, 1] @ [Wo, bo]^T) run as cuBLAS picks them; at
64 rows cuBLAS ran them at a fifth of the copy rate (docs/PERF.md, twenty-eighth run). Printed per row count: µs
by CUDA-graph replay (bench_block.graph_time_us; one input set, so the weights stay in L2), the weights' bytes at
the copy rate beside them, for the plan's forms, the transposed problem (W @ x^T), and K split into S parts
summed after (a batched GEMM and a sum).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_block import copy_bandwidth_gbs, graph_time_us  # noqa: E402


def forms(x, w, w_t, o_aug, wo_aug_t, y):
    """name -> call, each one GEMM of the plan's (or the same product another way)."""
    M, K = x.shape
    out = {
        "q: mm, bf16 out": lambda: torch.mm(x, w_t),
        "q: mm, fp32 out (plan)": lambda: torch.mm(x, w_t, out_dtype=torch.float32),
        "q: W @ x^T, fp32 out": lambda: torch.mm(w, x.t(), out_dtype=torch.float32),
        "o: addmm_ in place, K + 8 (plan)": lambda: y.addmm_(o_aug, wo_aug_t),
    }
    for s in (2, 4, 8):
        if K % s == 0:
            xs, ws = x.view(M, s, K // s).transpose(0, 1), w_t.view(s, K // s, -1)
            out[f"q: K split in {s}, bmm fp32 + sum"] = lambda xs=xs, ws=ws: torch.bmm(
                xs, ws, out_dtype=torch.float32).sum(0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="1280", help="model dims D (the GEMMs are D x D)")
    ap.add_argument("--rows", default="1,16,64")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    gbps = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}; copy {gbps:.0f} GB/s", flush=True)
    for D in (int(d) for d in args.dims.split(",")):
        w = torch.randn(D, D, device=dev, dtype=dt) / D**0.5
        wo_aug = torch.cat([w, torch.randn(D, 1, device=dev, dtype=dt), torch.zeros(D, 7, device=dev, dtype=dt)], 1)
        floor_us = D * D * 2 / gbps / 1e3
        for M in (int(m) for m in args.rows.split(",")):
            x = torch.randn(M, D, device=dev, dtype=dt)
            o_aug = torch.cat([x, torch.ones(M, 1, device=dev, dtype=dt), torch.zeros(M, 7, device=dev, dtype=dt)], 1)
            y = torch.randn(M, D, device=dev, dtype=dt)
            print(f"D {D}, M {M}: weights at the copy rate {floor_us:.1f} us", flush=True)
            for name, fn in forms(x, w, w.t(), o_aug, wo_aug.t(), y).items():
                try:
                    print(f"  {name:36s} {graph_time_us(fn, [{}]):7.1f} us", flush=True)
                except Exception as e:  # noqa: BLE001 - a form this torch lacks is reported, not fatal
                    print(f"  {name:36s} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)


if __name__ == "__main__":
    main()
