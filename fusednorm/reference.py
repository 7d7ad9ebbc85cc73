"""The fused op's math, stated once. Every other implementation (kernels, plans) is checked against this.

For query-side hidden states ``x`` of shape [B, Lq, D] and a context whose keys and values ``k``, ``v`` have
shape [B, H, Lk, d] (any strides; Lk independent of Lq)::

    h = norm(x)                       # over the last dim D
        layer: (x - mean) * rsqrt(var + eps) * gamma + beta      (gamma, beta each optional; var is biased)
        rms:    x * rsqrt(mean(x^2) + eps) * gamma                (gamma optional)
    q = h @ Wq^T + bq                 # optional: absent means q = h, and then D == H*d
    q = q viewed as [B, H, Lq, d]
    a = softmax(q @ k^T * scale + mask) @ v
                                      # scale defaults to d^-0.5; mask optional: bool (True = attend) or
                                      # additive, broadcastable to [B, H, Lq, Lk]; fully masked rows give 0
                                      # (so do all rows when Lk = 0)
    o = a viewed as [B, Lq, H*d]
    y = x + (o @ Wo^T + bo)           # optional out-projection; the residual is the norm's input x

Everything accumulates in float32 (float64 stays float64); y is returned in x's dtype.
"""
from __future__ import annotations

import math

import torch

NORM_KINDS = ("layer", "rms")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (the oracle); every other dtype accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference_pre_norm_cross_attn(
    x: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    wq: torch.Tensor | None,
    bq: torch.Tensor | None,
    wo: torch.Tensor | None,
    bo: torch.Tensor | None,
    mask: torch.Tensor | None,
    norm: str,
    eps: float,
    scale: float | None,
) -> torch.Tensor:
    ct = compute_dtype(x.dtype)

    def up(t):
        return None if t is None else t.to(ct)

    xf, kf, vf = up(x), up(k), up(v)
    B, Lq, D = x.shape
    _, H, Lk, d = k.shape

    # h = norm(x)
    if norm == "layer":
        mean = xf.mean(-1, keepdim=True)
        var = (xf - mean).square().mean(-1, keepdim=True)
        h = (xf - mean) * torch.rsqrt(var + eps)
    elif norm == "rms":
        h = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    else:
        raise ValueError(f"fusednorm: unknown norm kind {norm!r}; expected one of {NORM_KINDS}")
    if gamma is not None:
        h = h * up(gamma)
    if beta is not None:
        h = h + up(beta)

    # q = h @ Wq^T + bq, viewed as [B, H, Lq, d]
    q = h if wq is None else h @ up(wq).T
    if bq is not None:
        q = q + up(bq)
    q = q.view(B, Lq, H, d).transpose(1, 2)

    # a = softmax(q @ k^T * scale + mask) @ v; fully masked rows give 0
    a = attention(q, kf, vf, mask, scale)

    # o = a viewed as [B, Lq, H*d]; y = x + (o @ Wo^T + bo)
    o = a.transpose(1, 2).reshape(B, Lq, H * d)
    if wo is not None:
        o = o @ up(wo).T
    if bo is not None:
        o = o + up(bo)
    return (xf + o).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float | None) -> torch.Tensor:
    """softmax(q @ k^T * scale + mask) @ v over [B, H, L, d] in q's dtype; fully masked rows give 0, not NaN."""
    if k.shape[-2] == 0:  # no keys: every row is fully masked (and a max over no keys is not defined)
        return q.new_zeros(torch.broadcast_shapes(q.shape[:-2], v.shape[:-2]) + (q.shape[-2], v.shape[-1]))
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, -math.inf)
        else:
            s = s + mask.to(q.dtype)
    row_max = s.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(s - row_max)
    row_sum = p.sum(-1, keepdim=True)
    p = torch.where(row_sum > 0, p / row_sum, torch.zeros_like(p))
    return p @ v
