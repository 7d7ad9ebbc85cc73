"""Time the pieces a projection plan could be built from, on the projection benchmark shapes (one run).

    PYTHONPATH=. python bench/probe_plan.py

Prints, per shape: the eager and Inductor block, Inductor's kernels with their share of the time (profiler), and
the cuBLAS calls a plan would make: Q GEMM with bf16 and fp32 output, the out GEMM with the residual as C
(K = Dq and K = Dq + 8 for the folded bias).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_block import graph_time_us  # noqa: E402

SHAPES = {"seed": (32, 2048, 1024, 16, 77), "sdxl64": (2, 4096, 640, 10, 77), "sdxl32": (2, 1024, 1280, 20, 77),
          "sd15_64": (8, 4096, 320, 8, 77), "whisper_pre": (16, 448, 1280, 20, 1500),
          "whisper_dec": (64, 1, 1280, 20, 1500), "t5_dec": (32, 128, 1024, 16, 512)}


def block(x, k, v, g, b, wq, bq, wo, bo):
    B, Lq, D = x.shape
    H, d = k.shape[1], k.shape[3]
    h = F.layer_norm(x, (D,), g, b, 1e-5)
    q = F.linear(h, wq, bq).view(B, Lq, H, d).transpose(1, 2)
    a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, Lq, H * d)
    return x + F.linear(a, wo, bo)


def main():
    dt, dev = torch.bfloat16, "cuda"
    comp = torch.compile(block, dynamic=False)
    for name, (B, Lq, D, H, Lk) in SHAPES.items():
        d = D // H
        r = lambda *s: torch.randn(*s, device=dev, dtype=dt)
        t = dict(x=r(B, Lq, D), k=r(B, Lk, H, d).transpose(1, 2), v=r(B, Lk, H, d).transpose(1, 2),
                 g=1 + 0.1 * r(D), b=0.1 * r(D), wq=r(D, D) / D**0.5, bq=0.1 * r(D), wo=r(D, D) / D**0.5,
                 bo=0.1 * r(D))
        x2 = t["x"].view(-1, D)
        wq_t = t["wq"].t()
        wo_aug = torch.cat([t["wo"], t["bo"][:, None], torch.zeros(D, 7, device=dev, dtype=dt)], 1)
        o = r(B * Lq, D)
        o_aug = torch.cat([o, torch.ones(B * Lq, 1, device=dev, dtype=dt), torch.zeros(B * Lq, 7, device=dev,
                                                                                          dtype=dt)], 1)
        res = {}
        res["eager"] = graph_time_us(lambda **kw: block(**kw), [t])
        res["inductor"] = graph_time_us(lambda **kw: comp(**kw), [t])
        res["mm_bf16"] = graph_time_us(lambda: torch.mm(x2, wq_t), [{}])
        try:
            res["mm_f32out"] = graph_time_us(lambda: torch.mm(x2, wq_t, out_dtype=torch.float32), [{}])
        except Exception as e:  # noqa: BLE001
            res["mm_f32out"] = f"{type(e).__name__}: {e}"[:120]
        res["addmm_res_K"] = graph_time_us(lambda: torch.addmm(x2, o, t["wo"].t()), [{}])
        res["addmm_res_K8"] = graph_time_us(lambda: torch.addmm(x2, o_aug, wo_aug.t()), [{}])
        res["sdpa"] = graph_time_us(lambda: F.scaled_dot_product_attention(
            o.view(B, Lq, H, d).transpose(1, 2), t["k"], t["v"]), [{}])
        print(name, (B, Lq, D, H, Lk), {k: (round(v, 1) if isinstance(v, float) else v) for k, v in res.items()},
              flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                comp(**t)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=70))


if __name__ == "__main__":
    main()
