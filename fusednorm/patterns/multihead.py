"""nn.MultiheadAttention: Dynamo keeps F.multi_head_attention_forward as one call, query/key/value in [L, B, E].

The pattern covers batch_first (transposes around the call) and sequence-first layouts, packed or separate
in-projection weights, and a key_padding_mask (nn.MultiheadAttention turns a bool one into an additive float mask
before the call; both kinds are handled). The packed in_proj weight is sliced into Wq / Wk / Wv; the K and V
projections run outside the fused op. Refused (left to the compiler): attn_mask, bias_k / bias_v, add_zero_attn,
static_k / static_v, is_causal, active dropout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .binding import Derived
from .pieces import Dims, Piece
from .registry import MatchView, Pattern
from .tracing import meta_of

_MHA_PARAMS = ("key", "value", "embed_dim", "num_heads", "in_proj_weight", "in_proj_bias", "dropout_p",
               "out_proj_weight", "out_proj_bias", "training", "key_padding_mask", "need_weights",
               "use_separate_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "average_attn_weights")


def _mha(h, key, value, embed_dim, num_heads, in_proj_weight, in_proj_bias, dropout_p, out_proj_weight,
         out_proj_bias, training, key_padding_mask, need_weights, use_separate_proj_weight, q_proj_weight,
         k_proj_weight, v_proj_weight, average_attn_weights):
    return F.multi_head_attention_forward(
        h, key, value, embed_dim, num_heads, in_proj_weight, in_proj_bias, None, None, False, dropout_p,
        out_proj_weight, out_proj_bias, training=training, key_padding_mask=key_padding_mask,
        need_weights=need_weights, attn_mask=None, use_separate_proj_weight=use_separate_proj_weight,
        q_proj_weight=q_proj_weight, k_proj_weight=k_proj_weight, v_proj_weight=v_proj_weight, static_k=None,
        static_v=None, average_attn_weights=average_attn_weights, is_causal=False)[0]


def _batch_first(h, **kw):
    return _mha(h.transpose(1, 0), **kw).transpose(1, 0)


def _seq_first(h, **kw):
    return _mha(h, **kw)


def _projection(which):
    def weight(in_w, in_b, separate_w):
        w = separate_w if in_w is None else in_w.chunk(3)[which]
        b = None if in_b is None else in_b.chunk(3)[which]
        return w, b
    return weight


def _wq(in_w, q_w):
    return q_w if in_w is None else in_w.chunk(3)[0]


def _bq(in_b):
    return None if in_b is None else in_b.chunk(3)[0]


def _kv(which):
    def project(key, in_w, in_b, separate_w, num_heads):
        w, b = _projection(which)(in_w, in_b, separate_w)
        # [Lk, B, H*d] -> [B, H, Lk, d]: the head split nn.MultiheadAttention does with view(Lk, B*H, d)
        return F.linear(key, w, b).unflatten(-1, (num_heads, -1)).permute(1, 2, 0, 3)
    return project


def _mask(kpm):
    """key_padding_mask [B, Lk]: bool True = ignore (so keep = not kpm), or additive float."""
    if kpm is None:
        return None
    keep = kpm.logical_not() if meta_of(kpm).dtype == torch.bool else kpm
    return keep.unsqueeze(1).unsqueeze(1)


def _inactive_dropout(match: MatchView):
    p, training = match.values.get("dropout_p"), match.values.get("training")
    if isinstance(p, (int, float)) and (p == 0 or training is False):
        return True
    return f"dropout is active (nn.MultiheadAttention dropout={p!r} while training={training!r})"


def _key_padding_mask_shape(match: MatchView):
    kpm = match.values.get("key_padding_mask")
    if kpm is None or (isinstance(kpm, torch.Tensor) and kpm.dim() == 2):
        return True
    return f"mask shape not supported: key_padding_mask of shape {tuple(getattr(kpm, 'shape', ()))} (expected [B, Lk])"


def _check(match: MatchView):
    for c in (_inactive_dropout, _key_padding_mask_shape):
        verdict = c(match)
        if verdict is not True:
            return verdict
    return True


def _examples(batch_first):
    def make(dims: Dims, dtype):
        E, H = dims.H * dims.d, dims.H
        key = torch.randn(dims.Lk, dims.B, E, dtype=dtype)
        kpm = torch.zeros(dims.B, dims.Lk, dtype=torch.bool)
        kpm[:, -1] = True
        return {"key": key, "value": key, "embed_dim": E, "num_heads": H,
                "in_proj_weight": torch.randn(3 * E, E, dtype=dtype) / E ** 0.5,
                "in_proj_bias": 0.1 * torch.randn(3 * E, dtype=dtype), "dropout_p": 0.0,
                "out_proj_weight": torch.randn(E, E, dtype=dtype) / E ** 0.5,
                "out_proj_bias": 0.1 * torch.randn(E, dtype=dtype), "training": False, "key_padding_mask": kpm,
                "need_weights": False, "use_separate_proj_weight": False, "q_proj_weight": None,
                "k_proj_weight": None, "v_proj_weight": None, "average_attn_weights": True}
    return make


def _transposed(t):
    return t.transpose(0, 1)


_BIND = {
    "wq": Derived(_wq, "in_proj_weight", "q_proj_weight"),
    "bq": Derived(_bq, "in_proj_bias"),
    "k": Derived(_kv(1), "key", "in_proj_weight", "in_proj_bias", "k_proj_weight", "num_heads"),
    "v": Derived(_kv(2), "value", "in_proj_weight", "in_proj_bias", "v_proj_weight", "num_heads"),
    "wo": "out_proj_weight",
    "bo": "out_proj_bias",
    "mask": Derived(_mask, "key_padding_mask"),
}

LAYOUTS = (
    Piece("multihead_batch_first", _batch_first, _MHA_PARAMS, dict(_BIND),
          "nn.MultiheadAttention(batch_first=True): transposes around the call", check=_check,
          examples=_examples(True)),
    Piece("multihead_seq_first", _seq_first, _MHA_PARAMS,
          {**_BIND, "x": Derived(_transposed, "x"), "output": _transposed},
          "nn.MultiheadAttention with [L, B, E] inputs: x is transposed into the op and the result back",
          check=_check, examples=_examples(False)),
)


def compose_multihead(norm: Piece, layout: Piece) -> Pattern:
    params = list(dict.fromkeys(["x", *norm.params, *layout.params]))

    def search(**kw):
        h = norm.fn(kw["x"], **{p: kw[p] for p in norm.params})
        return kw["x"] + layout.fn(h, **{p: kw[p] for p in layout.params})

    bind = {"x": "x", **norm.bind, **layout.bind}
    seq_first = layout.name == "multihead_seq_first"

    def example_inputs(dtype=torch.float32):
        dims = Dims()
        D = dims.H * dims.d
        x = torch.randn(dims.Lq, dims.B, D, dtype=dtype) if seq_first else torch.randn(dims.B, dims.Lq, D, dtype=dtype)
        inputs = {"x": x, **layout.examples(dims, dtype)}
        if norm.examples is not None:
            inputs.update(norm.examples(Dims(D=D), dtype))
        return inputs

    checks = [c for c in (norm.check, layout.check) if c is not None]

    def check(match):
        for c in checks:
            verdict = c(match)
            if verdict is not True:
                return verdict
        return True

    return Pattern(f"{norm.name}/{layout.name}", search, bind, norm=norm.norm, check=check,
                   example_inputs=example_inputs, params=params, builtin=True,
                   why=f"nn.MultiheadAttention: {norm.why}; {layout.why}")
