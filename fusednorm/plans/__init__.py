"""The projection plan: norm -> Wq -> attention -> Wo + residual on CUDA in at most three launches.

    1. qraw = x @ Wq'^T                cuBLAS (torch.mm, float32 out); the norm is folded into Wq' (weights.py)
    2. attention stage                 the generated kernel in its stage mode: row statistics of x,
                                       q = rstd * (qraw - mean * u) + b', softmax(q k^T * scale + mask) v -> o,
                                       and a ones column after o that carries bo through the out GEMM
    3. y = x + [o, 1] @ [Wo, bo]^T     cuBLAS addmm with the residual as C (beta = 1)
Without Wq, stage 2 normalises x itself (as the projection-free kernel does) and stage 1 is skipped; without Wo,
stage 2 adds the residual and stage 3 is skipped. Why float32 qraw: plan.py.

Whether a matched block takes the plan is measured per shape against the compiler (choose.py).
"""
from __future__ import annotations

import torch

from .weights import fold_weights

__all__ = ["why_no_plan", "run_plan"]


def why_no_plan(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm) -> str | None:
    """None when the plan runs these inputs on CUDA, else the reason in words (works on FakeTensors)."""
    from ..codegen import why_no_kernel

    reason = why_no_kernel(x, k, v, gamma, beta, mask, norm)
    if reason is not None:
        return reason
    for name, t in (("wq", wq), ("bq", bq), ("wo", wo), ("bo", bo)):
        if t is not None and t.device != x.device:
            return f"{name} is on {t.device}, not with x on {x.device}"
    if wq is not None and "dtype" not in torch.ops.aten.mm.overloads():
        return "this torch has no float32-output matmul (torch.mm(..., out_dtype=torch.float32))"
    return None


def run_plan(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count, check_numerics):
    """y = x + (attention(norm(x) @ Wq^T + bq, k, v) @ Wo^T + bo) as the plan above (inputs already validated)."""
    from ..codegen import StageIO, run_kernel

    B, Lq, D = x.shape
    x = x.contiguous()
    x2 = x.view(B * Lq, D)
    folded = fold_weights(norm, gamma, beta, wq, bq, wo, bo, x.dtype)
    stage = StageIO()
    if wq is not None:
        stage.qraw = torch.mm(x2, folded.wq.t(), out_dtype=torch.float32)
        stage.q_u, stage.q_b = folded.u, folded.b
        gamma = beta = None  # folded into Wq'
    if wo is None:
        return run_kernel(x, k, v, gamma, beta, mask, norm, eps, scale, sm_count, check_numerics, stage=stage)
    stage.o_cols = folded.o_cols
    o = run_kernel(x, k, v, gamma, beta, mask, norm, eps, scale, sm_count, check_numerics, stage=stage)
    y = torch.addmm(x2, o.view(B * Lq, folded.o_cols), folded.wo.t()).view(B, Lq, D)
    if check_numerics:
        from ..numerics import raise_if_not_finite

        raise_if_not_finite(y)
    return y
