"""Attention through F.scaled_dot_product_attention: heads split with view + transpose, merged back with reshape.

Non-causal, no dropout; the mask (bool keep/drop or additive) and the scale pass through unchanged, as the op
defines them exactly as SDPA does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .pieces import Piece


def split_heads(q, k):
    """[B, Lq, H*d] -> [B, H, Lq, d], the heads read from k [B, H, Lk, d]."""
    return q.view(q.shape[0], q.shape[1], k.shape[1], k.shape[3]).transpose(1, 2)


def merge_heads(a):
    """[B, H, Lq, d] -> [B, Lq, H*d]."""
    return a.transpose(1, 2).reshape(a.shape[0], a.shape[2], a.shape[1] * a.shape[3])


def _sdpa(q, k, v, mask, sdpa_scale):
    a = F.scaled_dot_product_attention(split_heads(q, k), k, v, attn_mask=mask, dropout_p=0.0, is_causal=False,
                                       scale=sdpa_scale)
    return merge_heads(a)


def kv_examples(dims, dtype):
    return {"k": torch.randn(dims.B, dims.H, dims.Lk, dims.d, dtype=dtype),
            "v": torch.randn(dims.B, dims.H, dims.Lk, dims.d, dtype=dtype)}


def _examples(dims, dtype):
    return {**kv_examples(dims, dtype), "mask": torch.rand(dims.B, 1, 1, dims.Lk) > 0.3, "sdpa_scale": 0.4}


CORES = (
    Piece("sdpa", _sdpa, ("k", "v", "mask", "sdpa_scale"), {"k": "k", "v": "v", "mask": "mask"},
          "F.scaled_dot_product_attention with a given or default scale and an optional mask",
          scale=(lambda s: s, ("sdpa_scale",)), examples=_examples),
)
