"""The projection plan: norm -> Wq -> attention -> Wo + residual on CUDA in at most three launches.

    1. qraw = x @ Wq'^T                cuBLAS (torch.mm, float32 out); the norm is folded into Wq' (weights.py)
    2. attention stage                 the generated kernel in its stage mode: row statistics of x,
                                       q = rstd * (qraw - mean * u) + b', softmax(q k^T * scale + mask) v -> o,
                                       a ones column after o that carries bo through the out GEMM, and
                                       (its statistics pass reads all of x) a copy of x into y
    3. y += [o, 1] @ [Wo, bo]^T        cuBLAS addmm in place: the residual is C (beta = 1) with no copy kernel
Without Wq, stage 2 normalises x itself (as the projection-free kernel does) and stage 1 is skipped; without Wo,
stage 2 adds the residual and stage 3 is skipped. Why float32 qraw: plan.py.
A block of at most codegen.spec.PROJ_ROWS rows with both projections (decode: B * Lq <= 64, Lq <= 16), where each
GEMM launch costs ~5 us whatever its rows, runs as ONE launch instead: the stage's kernel computes the two GEMMs
itself as work items of its persistent grid, each cut into tasks of 32 columns by 128 of K
(templates/pnca/projections.cu; ``one_launch`` turns it off).

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


one_launch = True  # blocks of <= PROJ_ROWS rows with both projections in one launch (False: three, to compare)


def takes_one_launch(B: int, Lq: int, wq, wo) -> bool:
    """Whether run_plan runs this block as one launch (see the module doc)."""
    from ..codegen.spec import PROJ_ROWS

    return one_launch and wq is not None and wo is not None and Lq <= 16 and B * Lq <= PROJ_ROWS


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
    one = stage_call.proj_flags_at >= 0 if stage_call is not None else takes_one_launch(B, Lq, wq, wo)
    if one:  # (a cached launch keeps the form it was cached in)
        return _run_one_launch(x, k, v, mask, norm, eps, scale, sm_count, check_numerics, call_key, stage_call,
                               folded, stage)
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


def _run_one_launch(x, k, v, mask, norm, eps, scale, sm_count, check_numerics, call_key, stage_call, folded, stage):
    """The whole block as one launch of the stage's kernel with both GEMMs as its work items: qraw and o are its
    scratch, y_out the block's output."""
    from .. import codegen

    B, Lq, D = x.shape
    stage.qraw = codegen.one_launch_scratch(B * Lq, folded.wq.shape[0], D, folded.o_cols, x.device)
    stage.q_u, stage.q_b, stage.o_cols = folded.u, folded.b, folded.o_cols
    stage.wq, stage.wo = folded.wq.contiguous(), folded.wo.contiguous()  # contiguous as folded: no copy
    stage.y_out = torch.empty_like(x)
    if codegen.poison_outputs:
        stage.qraw.untyped_storage().fill_(255)  # every scratch float a NaN
        stage.y_out.fill_(float("nan"))
    if stage_call is not None:
        codegen.launch_call(stage_call, x, k, v, None, None, mask, stage)
    else:
        codegen.run_kernel(x, k, v, None, None, mask, norm, eps, scale, sm_count, check_numerics, call_key,
                           stage=stage)
    return stage.y_out  # the launch's numerics check (if asked) covered it
