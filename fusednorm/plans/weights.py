"""Weight-side preparation for the projection plan, done once per weight version and cached.

The norm folds into the Q projection (DESIGN §3):
    layer:  q = rstd * (x @ Wq'^T - mean * u) + b'     Wq' = Wq * gamma (per column), u = Wq' @ 1, b' = Wq @ beta + bq
    rms:    q = rstd * (x @ Wq'^T) + b'                 Wq' = Wq * gamma,                           b' = bq
and the out-projection bias folds into the out GEMM by one extra K column:
    y = x + [o, 1, 0..] @ [Wo, bo, 0..]^T               (the kernel writes the 1; K stays a multiple of 8)
Each cache entry is tied to the weight tensors themselves (weak references) and their version counters, so an
in-place update (an optimizer step, load_state_dict) or a new tensor in freed memory is seen; nothing goes stale.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..reference import compute_dtype

K_ALIGN = 8   # GEMM operands' K stays a multiple of 8 elements (16 bytes) for the fast tensor-core path


@dataclass
class FoldedWeights:
    wq: torch.Tensor | None   # [Dq, D] in the activation dtype: Wq * gamma (None without Wq)
    u: torch.Tensor | None    # [Dq] float32 (float64 for float64): Wq' @ 1 (layer norm only: multiplies the row mean)
    b: torch.Tensor | None    # [Dq] float32 (float64 for float64): Wq @ beta + bq (zeros when neither; None without Wq)
    wo: torch.Tensor | None   # [D, Dq + pad] in the activation dtype: [Wo, bo, 0..], None without Wo
    o_cols: int               # columns of the attention output buffer the kernel writes (Dq, or Dq + pad)


_cache: dict[tuple, tuple] = {}
_CACHE_LIMIT = 64


def fold_weights(norm, gamma, beta, wq, bq, wo, bo, dtype) -> FoldedWeights:
    """The folded weights, from the cache when these same tensor objects are unchanged since they were folded.

    A tensor's storage pointer alone is not an identity: a freed weight's memory is handed to the next tensor of
    that size. So an entry holds weak references to the very tensors it was folded from, and their pointer and
    version counter then: a new object, an in-place update (optimizer step, load_state_dict) or a swapped storage
    each rebuild it.
    """
    sources = (gamma, beta, wq, bq, wo, bo)
    key = (norm, dtype, tuple(None if t is None else id(t) for t in sources))
    state = tuple(None if t is None else (t.data_ptr(), t._version) for t in sources)
    hit = _cache.get(key)
    if hit is not None:
        refs, seen, folded = hit
        if seen == state and all((r is None) == (t is None) and (r is None or r() is t) for r, t in zip(refs, sources)):
            return folded
    with torch.no_grad():
        folded = _fold(norm, gamma, beta, wq, bq, wo, bo, dtype)
    if len(_cache) >= _CACHE_LIMIT:
        _cache.pop(next(iter(_cache)))
    _cache[key] = (tuple(None if t is None else weakref.ref(t) for t in sources), state, folded)
    return folded


def _fold(norm, gamma, beta, wq, bq, wo, bo, dtype) -> FoldedWeights:
    ct = compute_dtype(dtype)
    wq_folded = u = b = None
    if wq is not None:
        wq_c = wq.to(ct)
        wq_folded = ((wq_c * gamma.to(ct)) if gamma is not None else wq_c).to(dtype)
        b = torch.zeros(wq.shape[0], device=wq.device, dtype=ct)
        if beta is not None:
            b += wq_c @ beta.to(ct)
        if bq is not None:
            b += bq.to(ct)
        # u from the rounded Wq' that the GEMM really multiplies, so x @ Wq'^T - mean * u cancels exactly in fp32
        u = wq_folded.to(ct).sum(1) if norm == "layer" else None
    if wo is None:
        return FoldedWeights(wq_folded, u, b, None, wq.shape[0] if wq is not None else 0)
    Dq = wo.shape[1]
    if bo is None:
        return FoldedWeights(wq_folded, u, b, wo.to(dtype).contiguous(), Dq)
    cols = Dq + K_ALIGN
    wo_aug = torch.zeros(wo.shape[0], cols, device=wo.device, dtype=dtype)
    wo_aug[:, :Dq] = wo
    wo_aug[:, Dq] = bo
    return FoldedWeights(wq_folded, u, b, wo_aug, cols)
