"""Attention written out: scores = q @ k^T, scaled (or not, like T5), masked, softmax (optionally in float32 and cast
back), then @ v. Heads either split 4-d ([B, H, L, d], torch.matmul) or merged into the batch ([B*H, L, d],
torch.bmm, as diffusers' head_to_batch_dim does). Inert dropout is already gone (canonicalise pass).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .binding import Derived
from .pieces import Piece
from .registry import MatchView
from .sdpa import kv_examples, merge_heads, split_heads
from .tracing import meta_of


@dataclass(frozen=True)
class Step:
    """One step on the scores: fn(scores, **params) -> scores."""
    name: str
    fn: Callable
    params: tuple[str, ...]
    why: str
    scale: tuple[Callable, tuple[str, ...]] | None = None   # its factor in the op's scale
    mask: Any = None                                        # how the op's mask binds, when the step adds one

    def __call__(self, s, kw):
        return self.fn(s, **{p: kw[p] for p in self.params})


SCALES = (
    Step("unscaled", lambda s: s, (), "no scale on the scores (T5; or q was scaled before)", scale=(lambda: 1.0, ())),
    Step("mul", lambda s, score_scale: s * score_scale, ("score_scale",), "scores multiplied by the scale",
         scale=(lambda c: c, ("score_scale",))),
    Step("div", lambda s, score_scale: s / score_scale, ("score_scale",), "scores divided by sqrt(d)",
         scale=(lambda c: 1.0 / c, ("score_scale",))),
)

MASKS = (
    Step("nomask", lambda s: s, (), "no mask"),
    Step("mask", lambda s, mask: s + mask, ("mask",), "an additive mask (HF's extended attention mask)",
         mask="mask"),
    Step("bias_mask", lambda s, bias, mask: s + bias + mask, ("bias", "mask"),
         "a position bias and a mask added in turn (T5): the op adds their sum",
         mask=Derived(lambda b, m: b + m, "bias", "mask")),
)

SOFTMAXES = (
    Step("softmax", lambda s: F.softmax(s, dim=-1), (), "softmax in the scores' dtype"),
    Step("softmax_f32", lambda s, softmax_dtype: F.softmax(s.to(torch.float32), dim=-1).to(softmax_dtype),
         ("softmax_dtype",), "softmax of float32 scores cast back (half-precision models; softmax(dtype=float32) "
         "is canonicalised to this)"),
)


def _additive_only(match: MatchView):
    for name in ("mask", "bias"):
        value = match.values.get(name)
        if value is not None and not (isinstance(value, torch.Tensor) and value.dtype.is_floating_point):
            return f"mask shape/dtype not supported: an added {name} must be a floating tensor, got {value!r}"
    return True


# ---- head layouts -----------------------------------------------------------------------------------------------

def _split_into_batch(q, k):
    """[B, Lq, H*d] -> [B*H, Lq, d], batch-major (diffusers' head_to_batch_dim); H from k [B*H, Lk, d]."""
    b, lq, d = q.shape[0], q.shape[1], k.shape[2]
    h = k.shape[0] // q.shape[0]
    return q.reshape(b, lq, h, d).permute(0, 2, 1, 3).reshape(b * h, lq, d)


def _merge_from_batch(a, batch):
    """[B*H, Lq, d] -> [B, Lq, H*d] (batch_to_head_dim)."""
    h, lq, d = a.shape[0] // batch, a.shape[1], a.shape[2]
    return a.reshape(batch, h, lq, d).permute(0, 2, 1, 3).reshape(batch, lq, h * d)


def _unmerge(t, x):
    """k or v as [B*H, Lk, d] -> [B, H, Lk, d]: exactly the pairing the bmm makes with the batch-major query."""
    return t.unflatten(0, (x.shape[0], -1))


def _unmerge_mask(mask, k, x):
    """A mask for [B*H, Lq, Lk] scores, brought to something broadcastable to [B, H, Lq, Lk]."""
    if mask is None:
        return None
    m, kk = meta_of(mask), meta_of(k)
    if m.dim() == 3 and statically_known_true(m.shape[0] == kk.shape[0]) and not statically_known_true(m.shape[0] == 1):
        return mask.unflatten(0, (x.shape[0], -1))
    if m.dim() == 3:
        return mask.unsqueeze(0)
    return mask


def _heads_split_core(scale: Step, mask: Step, softmax: Step):
    def core(q, k, v, **kw):
        s = torch.matmul(split_heads(q, k), k.transpose(-1, -2))
        p = softmax(mask(scale(s, kw), kw), kw)
        return merge_heads(torch.matmul(p, v))
    return core


def _heads_in_batch_core(scale: Step, mask: Step, softmax: Step):
    def core(q, k, v, **kw):
        s = torch.bmm(_split_into_batch(q, k), k.transpose(1, 2))
        p = softmax(mask(scale(s, kw), kw), kw)
        return _merge_from_batch(torch.bmm(p, v), q.shape[0])
    return core


LAYOUTS = {
    # name: (core builder, k/v binding, mask binding, what it is)
    "matmul": (_heads_split_core, lambda name: name, lambda b: b, "4-d matmul attention"),
    "bmm": (_heads_in_batch_core, lambda name: Derived(_unmerge, name, "x"),
            lambda b: Derived(_unmerge_mask, "mask", "k", "x"), "bmm attention over [B*H, L, d]"),
}


def _examples(layout: str, scale: Step, mask: Step, softmax: Step):
    def make(dims, dtype):
        out = kv_examples(dims, dtype)
        if layout == "bmm":
            out = {n: t.flatten(0, 1) for n, t in out.items()}
        if scale.params:
            out["score_scale"] = 0.4 if scale.name == "mul" else 2.5
        if "mask" in mask.params:
            shape = (dims.B * dims.H, 1, dims.Lk) if layout == "bmm" else (dims.B, 1, 1, dims.Lk)
            out["mask"] = torch.where(torch.rand(shape) > 0.3, 0.0, -1e4).to(dtype)
        if "bias" in mask.params:
            out["bias"] = 0.1 * torch.randn(1, dims.H, dims.Lq, dims.Lk, dtype=dtype)
        if softmax.params:
            out["softmax_dtype"] = dtype
        return out
    return make


def _build() -> tuple[Piece, ...]:
    cores = []
    for layout, (build_core, bind_kv, bind_mask, what) in LAYOUTS.items():
        for scale, mask, softmax in itertools.product(SCALES, MASKS, SOFTMAXES):
            if layout == "bmm" and mask.name == "bias_mask":
                continue  # no merged-heads model adds a separate position bias
            bind = {"k": bind_kv("k"), "v": bind_kv("v")}
            if mask.mask is not None:
                bind["mask"] = bind_mask(mask.mask)
            cores.append(Piece(
                f"{layout}_{scale.name}_{mask.name}_{softmax.name}", build_core(scale, mask, softmax),
                ("k", "v", *scale.params, *mask.params, *softmax.params), bind,
                f"{what}: {scale.why}, {mask.why}, {softmax.why}",
                check=_additive_only if mask.mask is not None else None, scale=scale.scale,
                examples=_examples(layout, scale, mask, softmax)))
    return tuple(cores)


CORES = _build()
