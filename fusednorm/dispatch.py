"""Where a CUDA call of the fused op goes: the generated kernel, the projection plan, or the reference (warned
once)."""
from __future__ import annotations

from .reference import reference_pre_norm_cross_attn
from .warn import warn_once


def why_not_fast(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm) -> str | None:
    """None when a generated kernel (or the plan) runs these inputs on CUDA, else the reason in words (works on
    fakes)."""
    if wq is None and wo is None:
        from .codegen import why_no_kernel

        return why_no_kernel(x, k, v, gamma, beta, mask, norm)
    from .plans import why_no_plan

    return why_no_plan(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm)


def run_cuda(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count, check_numerics, call_key=None):
    """``call_key``: the eager call's signature (codegen.call_key), under which a generated-kernel launch is cached."""
    reason = why_not_fast(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm)
    if reason is None and wq is None and wo is None:
        from .codegen import run_kernel

        return run_kernel(x, k, v, gamma, beta, mask, norm, eps, scale, sm_count, check_numerics, call_key)
    if reason is None:
        from .plans import run_plan

        return run_plan(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count, check_numerics)
    warn_once(f"fusednorm: no generated CUDA kernel for this call ({reason}); running the reference implementation")
    y = reference_pre_norm_cross_attn(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale)
    if check_numerics:
        from .numerics import raise_if_not_finite

        raise_if_not_finite(y)
    return y
