"""Attention written out: scores = q @ k^T, scaled (or not, like T5), masked, softmax (optionally in float32 and cast
back), then @ v. Heads either split 4-d ([B, H, L, d], torch.matmul) or merged into the batch ([B*H, L, d],
torch.bmm). Inert dropout has already been removed by the canonicalise pass.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .binding import Derived
from .pieces import Piece
from .registry import MatchView
from .sdpa import kv_examples, merge_heads, split_heads
from .tracing import meta_of

# scale pieces: (name, fn(scores, **params), params, factor, why)
_SCALES = (
    ("unscaled", lambda s: s, (), (lambda: 1.0, ()), "no scale on the scores (T5; or q was scaled earlier)"),
    ("mul", lambda s, score_scale: s * score_scale, ("score_scale",), (lambda c: c, ("score_scale",)),
     "scores multiplied by the scale"),
    ("div", lambda s, score_scale: s / score_scale, ("score_scale",), (lambda c: 1.0 / c, ("score_scale",)),
     "scores divided by sqrt(d)"),
)

# mask pieces: (name, fn(scores, **params), params, binding of the op's mask, why)
_MASKS = (
    ("nomask", lambda s: s, (), None, "no mask"),
    ("mask", lambda s, mask: s + mask, ("mask",), "mask", "an additive mask (HF's extended attention mask)"),
    ("bias_mask", lambda s, bias, mask: s + bias + mask, ("bias", "mask"), Derived(lambda b, m: b + m, "bias", "mask"),
     "a position bias and a mask added in turn (T5): the op adds their sum"),
)

# softmax pieces: (name, fn(scores, **params), params, why)
_SOFTMAXES = (
    ("softmax", lambda s: F.softmax(s, dim=-1), (), "softmax in the scores' dtype"),
    ("softmax_f32", lambda s, softmax_dtype: F.softmax(s.to(torch.float32), dim=-1).to(softmax_dtype),
     ("softmax_dtype",), "softmax of float32 scores cast back (T5 in half precision; softmax(dtype=float32) is "
     "canonicalised to this)"),
)


def _additive_only(match: MatchView):
    for name in ("mask", "bias"):
        value = match.values.get(name)
        if value is not None and not (isinstance(value, torch.Tensor) and value.dtype.is_floating_point):
            return f"mask shape/dtype not supported: an added {name} must be a floating tensor, got {value!r}"
    return True


def _merge_batch_heads(t, x):
    """[B*H, L, d] -> [B, H, L, d] (batch-major, as head_to_batch_dim lays it out)."""
    return t.unflatten(0, (x.shape[0], -1))


def _merged_mask(mask, k, x):
    """A mask for [B*H, Lq, Lk] scores, brought to something broadcastable to [B, H, Lq, Lk]."""
    if mask is None:
        return None
    m, kk = meta_of(mask), meta_of(k)
    if m.dim() == 3 and statically_known_true(m.shape[0] == kk.shape[0]) and not statically_known_true(m.shape[0] == 1):
        return mask.unflatten(0, (x.shape[0], -1))
    if m.dim() == 3:
        return mask.unsqueeze(0)
    return mask


def _core(split, merge, first, second):
    def make(scale, mask, softmax):
        (_, scale_fn, scale_params, _, _), (_, mask_fn, mask_params, _, _), (_, sm_fn, sm_params, _) = \
            scale, mask, softmax

        def core(q, k, v, **kw):
            s = torch.matmul(split(q, k), first(k))
            s = scale_fn(s, **{p: kw[p] for p in scale_params})
            s = mask_fn(s, **{p: kw[p] for p in mask_params})
            p = sm_fn(s, **{p: kw[p] for p in sm_params})
            return merge(second(p, v))
        return core
    return make


def _split_merged(q, k):
    """[B, Lq, H*d] -> [B*H, Lq, d] (diffusers' head_to_batch_dim)."""
    B, L, d = q.shape[0], q.shape[1], k.shape[2]
    H = k.shape[0] // q.shape[0]
    return q.reshape(B, L, H, d).permute(0, 2, 1, 3).reshape(B * H, L, d)


def _merge_merged(a, x_batch):
    B, H, L, d = x_batch, a.shape[0] // x_batch, a.shape[1], a.shape[2]
    return a.reshape(B, H, L, d).permute(0, 2, 1, 3).reshape(B, L, H * d)


def _examples(layout, scale, mask, softmax):
    def make(dims, dtype):
        kv = kv_examples(dims, dtype)
        if layout == "bmm":
            kv = {n: t.flatten(0, 1) for n, t in kv.items()}
        out = dict(kv)
        if "score_scale" in scale[2]:
            out["score_scale"] = 0.4 if scale[0] == "mul" else 2.5
        if "mask" in mask[2]:
            shape = (dims.B * dims.H, 1, dims.Lk) if layout == "bmm" else (dims.B, 1, 1, dims.Lk)
            out["mask"] = torch.where(torch.rand(shape) > 0.3, 0.0, -1e4).to(dtype)
        if "bias" in mask[2]:
            out["bias"] = 0.1 * torch.randn(1, dims.H, dims.Lq, dims.Lk, dtype=dtype)
        if "softmax_dtype" in softmax[2]:
            out["softmax_dtype"] = dtype
        return out
    return make


def _build():
    cores = []
    for layout in ("matmul", "bmm"):
        for scale, mask, softmax in itertools.product(_SCALES, _MASKS, _SOFTMAXES):
            if layout == "bmm" and mask[0] == "bias_mask":
                continue
            params = ("k", "v", *scale[2], *mask[2], *softmax[2])
            if layout == "matmul":
                fn = _core(split_heads, merge_heads, lambda k: k.transpose(-1, -2), torch.matmul)(scale, mask, softmax)
                bind = {"k": "k", "v": "v"}
                if mask[3] is not None:
                    bind["mask"] = mask[3]
            else:
                def core(q, k, v, _scale=scale, _mask=mask, _softmax=softmax, **kw):
                    s = torch.bmm(_split_merged(q, k), k.transpose(1, 2))
                    s = _scale[1](s, **{p: kw[p] for p in _scale[2]})
                    s = _mask[1](s, **{p: kw[p] for p in _mask[2]})
                    p = _softmax[1](s, **{p: kw[p] for p in _softmax[2]})
                    return _merge_merged(torch.bmm(p, v), q.shape[0])
                fn = core
                bind = {"k": Derived(_merge_batch_heads, "k", "x"), "v": Derived(_merge_batch_heads, "v", "x")}
                if mask[3] is not None:
                    bind["mask"] = Derived(_merged_mask, "mask", "k", "x")
            cores.append(Piece(
                f"{layout}_{scale[0]}_{mask[0]}_{softmax[0]}", fn, params, bind,
                f"{'4-d matmul' if layout == 'matmul' else 'bmm over [B*H, L, d]'} attention: {scale[4]}, {mask[4]}, "
                f"{softmax[3]}",
                check=_additive_only if mask[3] is not None else None, scale=scale[3],
                examples=_examples(layout, scale, mask, softmax)))
    return tuple(cores)


CORES = _build()
