"""Weight-side preparation for the projection plan, done once per weight version and cached.

The norm folds into the Q projection (DESIGN §3):
    layer:  q = rstd * (x @ Wq'^T - mean * u) + b'     Wq' = Wq * gamma (per column), u = Wq' @ 1, b' = Wq @ beta + bq
    rms:    q = rstd * (x @ Wq'^T) + b'                 Wq' = Wq * gamma,                           b' = bq
and the out-projection bias folds into the out GEMM by one extra K column:
    y = x + [o, 1, 0..] @ [Wo, bo, 0..]^T               (the kernel writes the 1; K stays a multiple of 8)
Each cache entry is tied to the weights' storages (weak references) and version counters, so an in-place update
(an optimizer step, load_state_dict) or a new tensor in freed memory is seen; nothing goes stale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

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
    """The folded weights, from the cache while the weights' storages live and their contents are unchanged.

    The key is each weight's storage (its StorageImpl, held by a weak reference so that it cannot be freed and
    reused while the entry exists), data pointer, version counter, shape and strides: a compiled graph may hand
    the op a new view object of the same parameter on every call (still a hit), while an in-place update
    (optimizer step, load_state_dict) bumps the shared version counter and a freed weight's memory reused by
    another tensor comes with a new storage (both miss, and the weights are folded again).
    """
    sources = (gamma, beta, wq, bq, wo, bo)
    storages = tuple(None if t is None else t.untyped_storage() for t in sources)
    key = (norm, dtype, tuple(None if t is None else (st._cdata, t.data_ptr(), t._version, tuple(t.shape),
                                                      tuple(t.stride())) for t, st in zip(sources, storages)))
    hit = _cache.get(key)
    if hit is not None and not any(ref is not None and ref.expired() for ref in hit[0]):
        return hit[1]
    with torch.no_grad():
        folded = _fold(norm, gamma, beta, wq, bq, wo, bo, dtype)
    if len(_cache) >= _CACHE_LIMIT:
        _cache.pop(next(iter(_cache)))
    _cache[key] = (tuple(None if st is None else StorageWeakRef(st) for st in storages), folded)
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
