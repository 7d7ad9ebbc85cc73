"""Where a CUDA call of the fused op goes: the generated kernel, the projection plan, or the reference (warned
once).

Every CUDA call, eager or from a compiled graph, enters through ``run_cuda_cached``: a call whose signature
(``call_key``) already ran the kernel or the plan goes straight to its launches, skipping the checks and the
planning, which depend on nothing else; any other call takes the full path, so bad input raises its error every
time and fallbacks warn as before."""
from __future__ import annotations

from .reference import reference_pre_norm_cross_attn
from .warn import warn_once

_codegen = None  # fusednorm.codegen, imported on the first CUDA call (it takes ~20 ms to import)


def why_not_fast(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm) -> str | None:
    """None when a generated kernel (or the plan) runs these inputs on CUDA, else the reason in words (works on
    fakes)."""
    if wq is None and wo is None:
        from .codegen import why_no_kernel

        return why_no_kernel(x, k, v, gamma, beta, mask, norm)
    from .plans import why_no_plan

    return why_no_plan(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm)


def _signature(t) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def call_key(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count, check_numerics) -> tuple:
    """The kernel's call key (codegen.call_key), plus the projections' shapes, strides, dtypes and devices: all
    that the plan's checks, its stage kernel and grid and its GEMMs' shapes depend on. The weights' values are not
    in it: the plan folds them through its own cache (plans/weights.py), which sees every change."""
    key = _codegen.call_key(x, k, v, gamma, beta, mask, norm, eps, scale, sm_count, check_numerics)
    if wq is None and wo is None:
        return key
    return key + ("plan", _signature(wq), _signature(bq), _signature(wo), _signature(bo))


def run_cuda_cached(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count, check_numerics):
    """The op on CUDA: a cached launch for a signature seen before, else the checks and ``run_cuda``."""
    global _codegen
    if _codegen is None:
        from . import codegen as _codegen
    try:
        key = call_key(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count, check_numerics)
        call = _codegen.call_plans.get(key)
    except Exception:  # an argument that cannot be keyed (not a tensor, no storage...): the full path reports it
        key = call = None
    if call is not None:
        if wq is None and wo is None:
            return _codegen.launch_call(call, x, k, v, gamma, beta, mask)
        from .plans import run_plan

        return run_plan(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count, check_numerics,
                        stage_call=call)
    from .op import check_inputs

    check_inputs(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count)
    return run_cuda(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count, check_numerics,
                    call_key=key)


def run_cuda(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count, check_numerics, call_key=None):
    """The full path (inputs already checked). ``call_key``: the call's signature (see above), under which a
    launch of the generated kernel, or of the plan's stage, is cached when nothing had to be copied."""
    reason = why_not_fast(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm)
    if reason is None and wq is None and wo is None:
        from .codegen import run_kernel

        return run_kernel(x, k, v, gamma, beta, mask, norm, eps, scale, sm_count, check_numerics, call_key)
    if reason is None:
        from .plans import run_plan

        return run_plan(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count, check_numerics,
                        call_key=call_key)
    warn_once(f"fusednorm: no generated CUDA kernel for this call ({reason}); running the reference implementation")
    y = reference_pre_norm_cross_attn(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale)
    if check_numerics:
        from .numerics import raise_if_not_finite

        raise_if_not_finite(y)
    return y
