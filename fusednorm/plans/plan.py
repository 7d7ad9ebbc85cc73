"""The projection plan: the whole block in three launches on CUDA.

    1. qraw = x @ Wq'^T              cuBLAS, float32 output (the norm is folded into Wq', see weights.py)
    2. attention stage               one generated kernel: row stats of x, q = rstd*(qraw - mean*u) + b',
                                     softmax(q k^T * scale + mask) v, written as o (or y = x + o without Wo)
    3. y = x + [o, 1] @ [Wo, bo]^T   cuBLAS addmm with the residual as C (beta = 1) and bo as one extra K column

Why float32 qraw: with |mean| >> std the fold subtracts two large numbers; in float32 that costs ~1e-7 * |mean|/std
relative, in bf16 it would cost ~4e-3 * |mean|/std (tests check the large-mean case against float64).
"""
from __future__ import annotations

import torch

from ..reference import attention, compute_dtype
from .weights import fold_weights


def qraw_gemm(x2: torch.Tensor, wq_folded: torch.Tensor) -> torch.Tensor:
    """x2 [M, D] @ Wq'^T -> [M, Dq] in float32 (tensor cores, fp32 accumulate and output)."""
    return torch.mm(x2, wq_folded.t(), out_dtype=torch.float32)


def run_plan(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count, check_numerics):
    from ..codegen import run_attention_stage

    B, Lq, D = x.shape
    x2 = x.reshape(B * Lq, D).contiguous()
    fw = fold_weights(norm, gamma, beta, wq, bq, wo, bo, x.dtype)
    if wq is not None:
        stage_q = dict(qraw=qraw_gemm(x2, fw.wq), u=fw.u, b=fw.b)
    else:
        stage_q = dict(gamma=gamma, beta=beta)
    out = run_attention_stage(
        x2.view(B, Lq, D), k, v, mask, norm, eps, scale, **stage_q,
        o_cols=None if wo is None else fw.o_cols, sm_count=sm_count, check_numerics=check_numerics,
    )
    if wo is None:
        return out
    return torch.addmm(x2, out, fw.wo.t()).view(B, Lq, D)


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
