"""Weight-side preparation for the projection plan, done once per set of weights and kept current.

The norm folds into the Q projection (DESIGN §3):
    layer:  q = rstd * (x @ Wq'^T - mean * u) + b'     Wq' = Wq * gamma (per column), u = Wq' @ 1, b' = Wq @ beta + bq
    rms:    q = rstd * (x @ Wq'^T) + b'                 Wq' = Wq * gamma,                           b' = bq
and the out-projection bias folds into the out GEMM by one extra K column:
    y = x + [o, 1, 0..] @ [Wo, bo, 0..]^T               (the kernel writes the 1; K stays a multiple of 8)

A cache entry belongs to one set of weight storages (weak references, so that a freed weight's memory reused by a
new tensor is never taken for the old one) and remembers their version counters. An in-place update (an optimizer
step, load_state_dict) bumps a version, and the entry is folded again *into the same buffers*: a CUDA graph that
captured the plan reads them by address. Under a capture the fold cannot run (kernels are only recorded), so
there the entry's buffers are used only when a GraphWeights holds them for the graph (it re-folds changed weights
before each replay); otherwise the fold is recorded into the graph, and every replay folds what it reads.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import cached_property

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..graph_memory import capturing, kept_copies
from ..reference import compute_dtype

K_ALIGN = 8   # GEMM operands' K stays a multiple of 8 elements (16 bytes) for the fast tensor-core path


@dataclass
class FoldedWeights:
    wq: torch.Tensor | None   # [Dq, D] in the activation dtype: Wq * gamma (None without Wq)
    u: torch.Tensor | None    # [Dq] float32 (float64 for float64): Wq' @ 1 (layer norm only: multiplies the row mean)
    b: torch.Tensor | None    # [Dq] float32 (float64 for float64): Wq @ beta + bq (zeros when neither; None without Wq)
    wo: torch.Tensor | None   # [D, Dq + pad] in the activation dtype: [Wo, bo, 0..], None without Wo
    o_cols: int               # columns of the attention output buffer the kernel writes (Dq, or Dq + pad)

    def tensors(self) -> list:
        return [getattr(self, f.name) for f in fields(self) if f.name != "o_cols"]

    # the GEMMs' B operands, made once per set of weights (views: an in-place refold shows through them)
    @cached_property
    def wq_t(self) -> torch.Tensor:
        return self.wq.t()

    @cached_property
    def wo_t(self) -> torch.Tensor:
        return self.wo.t()


class _Entry:
    """One set of weights' folded buffers and the version counters they were folded at."""

    @torch.no_grad()
    def __init__(self, norm, dtype, sources):
        self.norm, self.dtype = norm, dtype
        self.refs = tuple(StorageWeakRef(t.untyped_storage()) for t in sources if t is not None)
        self._weak = tuple(ref.cdata for ref in self.refs)  # what expired() asks about (the refs keep them valid)
        self.versions = _versions(sources)
        folded = _fold(norm, *sources, dtype)
        fresh = folded.tensors()
        # a folded tensor that is a weight itself (Wo without bo, already contiguous) stays that weight: it is current
        self.aliases = [t is not None and any(t is s for s in sources) for t in fresh]
        copies = kept_copies([None if alias else t for t, alias in zip(fresh, self.aliases)])
        self.folded = FoldedWeights(*(t if alias else c for t, c, alias in zip(fresh, copies, self.aliases)),
                                    folded.o_cols)

    def expired(self) -> bool:
        return any(map(_storage_expired, self._weak))

    def refresh(self, sources) -> None:
        """Fold again, in place, if any weight changed since (not while capturing)."""
        versions = _versions(sources)
        if versions != self.versions:
            self._refold(sources, versions)

    @torch.no_grad()
    def _refold(self, sources, versions) -> None:
        new = _fold(self.norm, *sources, self.dtype).tensors()
        for kept, t, alias in zip(self.folded.tensors(), new, self.aliases):
            if kept is not None and not alias:
                kept.copy_(t)
        self.versions = versions


class GraphWeights:
    """The folded weights that CUDA graphs captured by address, with the weights they came from.

        held = GraphWeights()
        with held.capture(), torch.cuda.graph(g):   # fused blocks captured here read folded buffers held
            y = model(x)
        held.refresh()                              # before a replay, if weights may have changed in place
        g.replay()

    Without it a capture records the fold itself (correct for any weight change, a few kernels more per replay).
    The backend does this for you with ``options={"cudagraphs": True}``.
    """

    def __init__(self):
        self._held: dict[int, tuple[_Entry, tuple]] = {}

    def hold(self, entry: _Entry, sources: tuple) -> None:
        self._held.setdefault(id(entry), (entry, sources))

    def refresh(self) -> None:
        with _lock:
            for entry, sources in self._held.values():
                entry.refresh(sources)

    def __len__(self) -> int:
        return len(self._held)

    @contextmanager
    def capture(self):
        previous = getattr(_capture, "held", None)
        _capture.held = self
        try:
            yield self
        finally:
            _capture.held = previous


_capture = threading.local()
_storage_expired = torch.Storage._expired  # StorageWeakRef.expired without its method call
_cache: dict[tuple, _Entry] = {}
_lock = threading.Lock()  # threads serving one model share the entries: one looks up, makes or refolds at a time
_CACHE_LIMIT = 64


def fold_weights(norm, gamma, beta, wq, bq, wo, bo, dtype) -> FoldedWeights:
    """The folded weights: the cached buffers, folded again in place when a weight changed (see the module doc).

    The key is each weight's data pointer, shape and strides: a compiled graph may hand the op a new view object
    of the same parameter on every call (still a hit). Two live storages never share an address, and the entry
    holds weak references to the storages it was made from: once one is freed (its memory may then be reused by
    another tensor at the same address) the entry is dropped and the weights are folded again.
    """
    sources = (gamma, beta, wq, bq, wo, bo)
    present = [t for t in sources if t is not None]
    key = (norm, dtype, tuple(None if t is None else (t.data_ptr(), t.shape, t.stride()) for t in sources))
    with _lock:
        return _cached_fold(key, norm, dtype, sources, present)


def _cached_fold(key, norm, dtype, sources, present) -> FoldedWeights:
    entry = _cache.get(key)
    if entry is not None and entry.expired():
        del _cache[key]
        entry = None
    if entry is None and any(t.is_inference() for t in present):
        # no version counter: a change could not be seen. A hit needs no such check: entries are made from tensors
        # with one, and a tensor on an entry's live storage is a view of it (views made in inference mode too)
        with torch.no_grad():
            return _fold(norm, *sources, dtype)
    if present and capturing(present[0]):
        held = getattr(_capture, "held", None)
        if entry is None or held is None or entry.versions != _versions(sources):
            with torch.no_grad():  # recorded: each replay folds the weights it then reads
                return _fold(norm, *sources, dtype)
        held.hold(entry, sources)
        return entry.folded
    if entry is None:
        entry = _Entry(norm, dtype, sources)
        for dead in [k for k, e in _cache.items() if e.expired()]:  # weights computed per call leave these behind
            del _cache[dead]
        if len(_cache) >= _CACHE_LIMIT:
            _cache.pop(next(iter(_cache)))
        _cache[key] = entry
    else:
        entry.refresh(sources)
    return entry.folded


def _versions(sources) -> tuple:
    return tuple(None if t is None else t._version for t in sources)


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
