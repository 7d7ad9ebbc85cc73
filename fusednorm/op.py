"""The fused op ``torch.ops.fusednorm.pre_norm_cross_attn``: schema, checks, fake impl, CPU/CUDA impls, autograd.

The math is in ``fusednorm/reference.py`` (stated once); this module only registers it with ``torch.library``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import dispatch
from .reference import NORM_KINDS, reference_pre_norm_cross_attn

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class FusedNormInputError(ValueError):
    """Raised when the fused op is called with inputs that contradict its math."""


def check_inputs(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count=None) -> None:
    """Validate shapes, dtypes and devices; every message names the argument at fault."""

    def fail(msg):
        raise FusedNormInputError(f"fusednorm.pre_norm_cross_attn: {msg}")

    if norm not in NORM_KINDS:
        fail(f"norm must be one of {NORM_KINDS}, got {norm!r}")
    if x.dim() != 3:
        fail(f"x must be [B, Lq, D], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        fail(f"x must be a floating tensor, got {x.dtype}")
    B, Lq, D = x.shape
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4:
            fail(f"{name} must be [B, H, Lk, d], got shape {tuple(t.shape)}")
        if t.dtype != x.dtype:
            fail(f"{name} has dtype {t.dtype} but x has {x.dtype}")
        if t.device != x.device:
            fail(f"{name} is on {t.device} but x is on {x.device}")
    if k.shape != v.shape:
        fail(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[0] != B:
        fail(f"k/v batch {k.shape[0]} != x batch {B}")
    H, d = k.shape[1], k.shape[3]
    Dq = H * d
    if wq is None and D != Dq:
        fail(f"without a Q projection the model dim D={D} must equal heads*head_dim={H}*{d}")
    if wq is not None and tuple(wq.shape) != (Dq, D):
        fail(f"wq must be [H*d, D] = [{Dq}, {D}], got {tuple(wq.shape)}")
    if wo is not None and tuple(wo.shape) != (D, Dq):
        fail(f"wo must be [D, H*d] = [{D}, {Dq}], got {tuple(wo.shape)}")
    if wo is None and D != Dq:
        fail(f"without an out projection the model dim D={D} must equal heads*head_dim={H}*{d}")
    for name, t, n in (("gamma", gamma, D), ("beta", beta, D), ("bq", bq, Dq), ("bo", bo, D)):
        if t is not None and tuple(t.shape) != (n,):
            fail(f"{name} must have shape [{n}], got {tuple(t.shape)}")
    for name, t in (("gamma", gamma), ("beta", beta), ("wq", wq), ("bq", bq), ("wo", wo), ("bo", bo)):
        if t is not None and t.device != x.device:
            fail(f"{name} is on {t.device} but x is on {x.device}")
        if t is not None and not t.dtype.is_floating_point:
            fail(f"{name} must be floating point, got {t.dtype}")
    if norm == "rms" and beta is not None:
        fail("an RMS norm has no beta")
    if bq is not None and wq is None:
        fail("bq given without wq")
    if bo is not None and wo is None:
        fail("bo given without wo")
    if mask is not None:
        if mask.device != x.device:
            fail(f"mask is on {mask.device} but x is on {x.device}")
        if mask.dim() > 4:
            fail(f"mask must be broadcastable to [B, H, Lq, Lk], got shape {tuple(mask.shape)}")
        try:
            torch.broadcast_shapes(tuple(mask.shape), (B, H, Lq, k.shape[2]))
        except RuntimeError:
            fail(f"mask of shape {tuple(mask.shape)} does not broadcast to [B, H, Lq, Lk] = "
                 f"{[B, H, Lq, k.shape[2]]}")
        if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
            fail(f"mask must be bool (True = attend) or floating (additive), got {mask.dtype}")
    if not eps > 0:
        fail(f"eps must be > 0, got {eps}")
    if scale is not None and not (scale == scale and abs(scale) != float("inf")):
        fail(f"scale must be finite, got {scale}")
    if sm_count is not None and sm_count < 1:
        fail(f"sm_count must be >= 1, got {sm_count}")


@torch.library.custom_op("fusednorm::pre_norm_cross_attn", mutates_args=())
def pre_norm_cross_attn(
    x: Tensor,
    k: Tensor,
    v: Tensor,
    gamma: Optional[Tensor],
    beta: Optional[Tensor],
    wq: Optional[Tensor],
    bq: Optional[Tensor],
    wo: Optional[Tensor],
    bo: Optional[Tensor],
    mask: Optional[Tensor],
    norm: str,
    eps: float,
    scale: Optional[float] = None,
    sm_count: Optional[int] = None,
    check_numerics: bool = False,
) -> Tensor:
    """y = x + out_proj(MHA(q_proj(norm(x)), k, v)) as fusednorm/reference.py states it. Default: the reference."""
    return _pre_norm_cross_attn_reference(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count,
                                          check_numerics)


def _pre_norm_cross_attn_reference(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale=None, sm_count=None,
                                   check_numerics=False):
    check_inputs(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count)
    y = reference_pre_norm_cross_attn(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale)
    if check_numerics:
        from .numerics import raise_if_not_finite

        raise_if_not_finite(y)
    return y


def _pre_norm_cross_attn_cuda(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale=None, sm_count=None,
                              check_numerics=False):
    # checks the inputs unless this signature passed them before
    return dispatch.run_cuda_cached(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count,
                                    check_numerics)


def inlined_for_inductor(device_type: str, check_numerics: bool) -> bool:
    """Whether Inductor compiles the op's reference math inline (``inline_on_cpu``) rather than calling the op:
    on CPU tensors, where fusednorm has no kernel, unless check_numerics asks for the error only the op raises."""
    return device_type == "cpu" and not check_numerics


def inline_on_cpu(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale=None, sm_count=None,
                  check_numerics=False):
    """The op as its reference math, for Inductor to compile inline where fusednorm has no kernel (CPU tensors):
    run as an opaque op the reference is slower than Inductor's own code for the block (README). NotImplemented
    keeps the op everywhere else (see ``inlined_for_inductor``)."""
    if not inlined_for_inductor(x.device.type, check_numerics):
        return NotImplemented
    return reference_pre_norm_cross_attn(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale)


# Registered on the op's CUDA key directly rather than through ``register_kernel("cuda")``: that wraps the kernel
# in a Python layer of custom_op's (aliasing checks, a dynamo-disable guard) that cost ~36 µs per call on the H200
# host (docs/PERF.md) and checks nothing the fake impl does not already promise: a fresh, contiguous output.
_impl_lib = torch.library.Library("fusednorm", "IMPL")
_impl_lib.impl("pre_norm_cross_attn", _pre_norm_cross_attn_cuda, "CUDA")


@pre_norm_cross_attn.register_fake
def _pre_norm_cross_attn_fake(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale=None, sm_count=None,
                              check_numerics=False):
    check_inputs(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale, sm_count)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ---- autograd: the backward recomputes the reference and differentiates it (an opaque op of its own, so that
# ---- AOT autograd traces it as one node instead of tracing torch.autograd.grad).

_GRAD_NAMES = ("x", "k", "v", "gamma", "beta", "wq", "bq", "wo", "bo")


@torch.library.custom_op("fusednorm::pre_norm_cross_attn_backward", mutates_args=())
def pre_norm_cross_attn_backward(
    grad_y: Tensor,
    x: Tensor,
    k: Tensor,
    v: Tensor,
    gamma: Optional[Tensor],
    beta: Optional[Tensor],
    wq: Optional[Tensor],
    bq: Optional[Tensor],
    wo: Optional[Tensor],
    bo: Optional[Tensor],
    mask: Optional[Tensor],
    norm: str,
    eps: float,
    scale: Optional[float],
) -> list[Tensor]:
    """Gradients of the reference for those of (x, k, v, gamma, beta, wq, bq, wo, bo) that are present, in order."""
    inputs = [x, k, v, gamma, beta, wq, bq, wo, bo]
    present = [t for t in inputs if t is not None]

    def forward(*tensors):
        it = iter(tensors)
        return reference_pre_norm_cross_attn(*(None if t is None else next(it) for t in inputs), mask, norm, eps, scale)

    # torch.func.vjp, not torch.autograd.grad: an op's impl runs below the autograd dispatch key
    _, vjp = torch.func.vjp(forward, *present)
    return [g.contiguous() for g in vjp(grad_y)]  # contiguous, as the fake impl says (k/v may be strided views)


@pre_norm_cross_attn_backward.register_fake
def _backward_fake(grad_y, x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale):
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device)
            for t in (x, k, v, gamma, beta, wq, bq, wo, bo) if t is not None]


def _setup_context(ctx, inputs, output):
    x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale = inputs[:13]
    ctx.save_for_backward(x, k, v, gamma, beta, wq, bq, wo, bo, mask)
    ctx.norm, ctx.eps, ctx.scale = norm, eps, scale


def _backward(ctx, grad_y):
    x, k, v, gamma, beta, wq, bq, wo, bo, mask = ctx.saved_tensors
    present = iter(torch.ops.fusednorm.pre_norm_cross_attn_backward(
        grad_y, x, k, v, gamma, beta, wq, bq, wo, bo, mask, ctx.norm, ctx.eps, ctx.scale
    ))
    grads = [None if t is None else next(present) for t in (x, k, v, gamma, beta, wq, bq, wo, bo)]
    # one grad per forward input: the 9 tensors, then mask, norm, eps, scale, sm_count, check_numerics
    return (*grads, None, None, None, None, None, None)


pre_norm_cross_attn.register_autograd(_backward, setup_context=_setup_context)


# ---- the autograd key without its Python layer when nothing needs a gradient.
# custom_op puts a Python kernel on the Autograd key that, when no input needs a gradient, only redispatches below
# autograd: 6 µs per call on a 2-core CPU, ~12 on the H200 host (docs/PERF.md), paid by every call a compiled graph
# makes (its forward runs with grad disabled). The kernel below, on the CPU and CUDA autograd keys, calls the
# device's implementation itself when the call is a plain one (no gradient needed, nothing between autograd and the
# device: no fake tensors, functionalization or tensor subclass), and custom_op's autograd kernel otherwise.

DEVICE_IMPLS = {torch._C.DispatchKey.CPU: _pre_norm_cross_attn_reference,
                torch._C.DispatchKey.CUDA: _pre_norm_cross_attn_cuda}


def _register_direct_autograd() -> bool:
    try:
        from torch._library.autograd import make_autograd_impl

        with_autograd = make_autograd_impl(torch.ops.fusednorm.pre_norm_cross_attn.default, pre_norm_cross_attn)
        any_requires_grad, grad_enabled = torch._C._any_requires_grad, torch._C.is_grad_enabled
        below_autograd = torch._C._after_autograd_keyset
    except (ImportError, AttributeError, TypeError):  # another torch's layout: custom_op's layer stays (correct)
        return False

    def autograd_kernel(keyset, *args):
        if not (grad_enabled() and any_requires_grad(*args)):
            device_impl = DEVICE_IMPLS.get((keyset & below_autograd).highestPriorityTypeId())
            if device_impl is not None:
                return device_impl(*args)
        return with_autograd(keyset, *args)

    for key in ("AutogradCPU", "AutogradCUDA"):
        _impl_lib.impl("pre_norm_cross_attn", autograd_kernel, key, with_keyset=True)
    return True


DIRECT_AUTOGRAD = _register_direct_autograd()


def fused_pre_norm_cross_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gamma: Optional[Tensor],
    beta: Optional[Tensor],
    eps: float = 1e-5,
    sm_count: Optional[int] = None,
    *,
    mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    norm: str = "layer",
    check_numerics: bool = False,
) -> Tensor:
    """The projection-free fused block with the seed's parameters: ``q + MHA(norm(q) split into heads, k, v)``.

    q: query-side hidden states [B, Lq, D]; k, v: [B, H, Lk, d] with D == H*d (any strides);
    gamma, beta: the norm's affine parameters [D] or None; sm_count: at most that many SMs' worth of CTAs.
    """
    eps = float(eps)
    if q.is_cuda and not torch.compiler.is_compiling() and not _needs_grad(q, k, v, gamma, beta, mask):
        # Straight to the kernel: the dispatcher (boxing 15 arguments, the autograd key) costs ~5 µs per call on
        # a CPU (bench/host_dispatch.py), more on the H200 host, and adds nothing without autograd
        return dispatch.run_cuda_cached(q, k, v, gamma, beta, None, None, None, None, mask, norm, eps, scale,
                                        sm_count, check_numerics)
    return torch.ops.fusednorm.pre_norm_cross_attn(q, k, v, gamma, beta, None, None, None, None, mask, norm, eps,
                                                   scale, sm_count, check_numerics)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
