"""Weight-side preparation for the projection plan, done once per weight version and cached.

The norm folds into the Q projection (DESIGN §3):
    layer:  q = rstd * (x @ Wq'^T - mean * u) + b'     Wq' = Wq * gamma (per column), u = Wq' @ 1, b' = Wq @ beta + bq
    rms:    q = rstd * (x @ Wq'^T) + b'                 Wq' = Wq * gamma,                           b' = bq
and the out-projection bias folds into the out GEMM by one extra K column:
    y = x + [o, 1, 0..] @ [Wo, bo, 0..]^T               (the kernel writes the 1; K stays a multiple of 8)
The cache key holds each weight's storage pointer and version counter, so an in-place update (an optimizer
step, load_state_dict) is seen and the folded copies are rebuilt; nothing goes stale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference import compute_dtype

K_ALIGN = 8   # GEMM operands' K stays a multiple of 8 elements (16 bytes) for the fast tensor-core path


@dataclass
class FoldedWeights:
    wq: torch.Tensor          # [Dq, D] in the activation dtype: Wq * gamma
    u: torch.Tensor | None    # [Dq] float32 (float64 for float64): Wq' @ 1 (layer norm only: multiplies the row mean)
    b: torch.Tensor           # [Dq] float32 (float64 for float64): Wq @ beta + bq (zeros when neither)
    wo: torch.Tensor | None   # [D, Dq + pad] in the activation dtype: [Wo, bo, 0..], None without Wo
    o_cols: int               # columns of the attention output buffer the kernel writes (Dq, or Dq + pad)


def _version_key(*tensors):
    return tuple(None if t is None else (t.data_ptr(), t._version, tuple(t.shape), t.dtype) for t in tensors)


_cache: dict[tuple, FoldedWeights] = {}
_CACHE_LIMIT = 64


def fold_weights(norm, gamma, beta, wq, bq, wo, bo, dtype) -> FoldedWeights:
    key = (norm, dtype, _version_key(gamma, beta, wq, bq, wo, bo))
    hit = _cache.get(key)
    if hit is not None:
        return hit
    with torch.no_grad():
        folded = _fold(norm, gamma, beta, wq, bq, wo, bo, dtype)
    if len(_cache) >= _CACHE_LIMIT:
        _cache.pop(next(iter(_cache)))
    _cache[key] = folded
    return folded


def _fold(norm, gamma, beta, wq, bq, wo, bo, dtype) -> FoldedWeights:
    ct = compute_dtype(dtype)
    wq_c = wq.to(ct)
    wq_folded = ((wq_c * gamma.to(ct)) if gamma is not None else wq_c).to(dtype)
    b = torch.zeros(wq.shape[0], device=wq.device, dtype=ct)
    if beta is not None:
        b += wq_c @ beta.to(ct)
    if bq is not None:
        b += bq.to(ct)
    # u from the rounded Wq' that the GEMM really multiplies, so x @ Wq'^T - mean * u cancels exactly in fp32
    u = wq_folded.to(ct).sum(1) if norm == "layer" else None
    Dq = wq.shape[0]
    if wo is None:
        return FoldedWeights(wq_folded, u, b, None, Dq)
    if bo is None:
        return FoldedWeights(wq_folded, u, b, wo.to(dtype).contiguous(), Dq)
    cols = Dq + K_ALIGN
    wo_aug = torch.zeros(wo.shape[0], cols, device=wo.device, dtype=dtype)
    wo_aug[:, :Dq] = wo
    wo_aug[:, Dq] = bo
    return FoldedWeights(wq_folded, u, b, wo_aug, cols)
