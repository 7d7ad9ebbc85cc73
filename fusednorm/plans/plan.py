"""The projection plan's stage 2 in torch ops: the oracle of the stage kernel and of the fold algebra.

    1. qraw = x @ Wq'^T              cuBLAS, float32 output (the norm is folded into Wq', see weights.py)
    2. attention stage               one generated kernel: row stats of x, q = rstd*(qraw - mean*u) + b',
                                     softmax(q k^T * scale + mask) v, written as o (or y = x + o without Wo)
    3. y = x + [o, 1] @ [Wo, bo]^T   cuBLAS addmm in place on y, which stage 2 filled with x; bo is one extra K column

Why float32 qraw: with |mean| >> std the fold subtracts two large numbers; in float32 that costs ~1e-7 * |mean|/std
relative, in bf16 it would cost ~4e-3 * |mean|/std (tests check the large-mean case against float64).
"""
from __future__ import annotations

import torch

from ..reference import attention, compute_dtype


def attention_stage_reference(x, k, v, mask, norm, eps, scale, qraw, u, b):
    """What stage 2 computes, in float32 torch ops (the oracle for the stage kernel and for the fold algebra)."""
    B, Lq, D = x.shape
    _, H, Lk, d = k.shape
    ct = compute_dtype(x.dtype)
    xf = x.to(ct)
    if norm == "layer":
        mean = xf.mean(-1, keepdim=True)
        rstd = torch.rsqrt((xf - mean).square().mean(-1, keepdim=True) + eps)
        q = rstd * (qraw.view(B, Lq, -1) - mean * u) + b
    else:
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        q = rstd * qraw.view(B, Lq, -1) + b
    q = q.view(B, Lq, H, d).transpose(1, 2)
    return attention(q, k.to(ct), v.to(ct), mask, scale).transpose(1, 2).reshape(B, Lq, H * d)
