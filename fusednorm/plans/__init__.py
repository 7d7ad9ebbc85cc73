"""The projection plan: norm -> Wq -> attention -> Wo + residual on CUDA in at most three launches.

    1. qraw = x @ Wq'^T                cuBLAS (torch.mm, float32 out); the norm is folded into Wq' (weights.py)
    2. attention stage                 the generated kernel in its stage mode: row statistics of x,
                                       q = rstd * (qraw - mean * u) + b', softmax(q k^T * scale + mask) v -> o,
                                       a ones column after o that carries bo through the out GEMM, and
                                       (its statistics pass reads all of x) a copy of x into y
    3. y += [o, 1] @ [Wo, bo]^T        cuBLAS addmm in place: the residual is C (beta = 1) with no copy kernel
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
    if x.shape[-1] % 8 != 0:  # without Wq, D = H * d: a multiple of 8 already
        return f"model dim {x.shape[-1]} is not a multiple of 8 (the stage reads rows of x in 16-byte chunks)"
    for name, t in (("wq", wq), ("bq", bq), ("wo", wo), ("bo", bo)):
        if t is not None and t.device != x.device:
            return f"{name} is on {t.device}, not with x on {x.device}"
    if wq is not None and "dtype" not in torch.ops.aten.mm.overloads():
        return "this torch has no float32-output matmul (torch.mm(..., out_dtype=torch.float32))"
    return None


def gemm_f32_out(a, b):
    """a @ b in float32 from 16-bit operands (cuBLAS accumulates in float32 and skips the rounding to 16 bits)."""
    return torch.mm(a, b, out_dtype=torch.float32)


def run_plan(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count, check_numerics, call_key=None,
             stage_call=None):
    """y = x + (attention(norm(x) @ Wq^T + bq, k, v) @ Wo^T + bo) as the plan above (inputs already validated).

    ``stage_call``: the stage's cached launch for this call's signature (dispatch.run_cuda_cached), else None and
    ``call_key`` is the signature to cache it under. Either way the weights go through their fold cache, which
    sees any change to them.
    """
    from .. import codegen

    B, Lq, D = x.shape
    x = x.contiguous()
    x2 = x.view(B * Lq, D)
    folded = fold_weights(norm, gamma, beta, wq, bq, wo, bo, x.dtype)
    stage = codegen.StageIO()
    if wq is not None:
        stage.qraw = gemm_f32_out(x2, folded.wq_t)
        stage.q_u, stage.q_b = folded.u, folded.b
        gamma = beta = None  # folded into Wq'
    if wo is not None:
        stage.o_cols = folded.o_cols
        stage.x_copy = y2 = torch.empty_like(x2)  # addmm(x, ..) would copy x here with a kernel of its own
        if codegen.poison_outputs:
            y2.fill_(float("nan"))
    if stage_call is not None:
        o = codegen.launch_call(stage_call, x, k, v, gamma, beta, mask, stage)
    else:
        o = codegen.run_kernel(x, k, v, gamma, beta, mask, norm, eps, scale, sm_count, check_numerics, call_key,
                               stage=stage)
    if wo is None:
        return o  # the stage added the residual
    y = y2.addmm_(o.view(B * Lq, folded.o_cols), folded.wo_t).view(B, Lq, D)
    if check_numerics:
        from ..numerics import raise_if_not_finite

        raise_if_not_finite(y)
    return y
