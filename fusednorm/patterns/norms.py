"""Norm pieces: how models write the pre-norm over the last dim. gamma / beta bind to None when a model has none."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .binding import Derived
from .pieces import Piece
from .registry import MatchView
from .tracing import meta_of


def _last_dim_only(match: MatchView):
    shape = match.args_of("norm").get("normalized_shape")
    if isinstance(shape, (list, tuple, torch.Size)) and len(shape) == 1:
        return True
    return f"the norm is not over the last dim only (normalized_shape={tuple(shape) if shape else shape})"


def _layer_norm(x, gamma, beta, eps):
    return F.layer_norm(x, x.shape[-1:], gamma, beta, eps)


def _rms_norm(x, gamma, eps):
    return F.rms_norm(x, x.shape[-1:], gamma, eps)


def _rms_by_hand(x, gamma, eps):
    return gamma * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rms_by_hand_variance_upcast(x, gamma, eps, norm_dtype):
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return gamma * (x * torch.rsqrt(variance + eps)).to(norm_dtype)


def _rms_by_hand_upcast(x, gamma, eps, norm_dtype):
    xf = x.to(torch.float32)
    return gamma * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(norm_dtype)


def _rms_eps(eps, x):
    # F.rms_norm(eps=None) uses the dtype's machine epsilon
    return torch.finfo(meta_of(x).dtype).eps if eps is None else eps


def _affine(dims, dtype, beta=True):
    out = {"gamma": 1 + 0.1 * torch.randn(dims.D, dtype=dtype), "eps": 1e-5}
    if beta:
        out["beta"] = 0.1 * torch.randn(dims.D, dtype=dtype)
    return out


def _affine_cast(dims, dtype):
    return {**_affine(dims, dtype, beta=False), "norm_dtype": dtype}


_GAMMA = {"gamma": "gamma", "eps": "eps"}

NORMS = (
    Piece("layer_norm", _layer_norm, ("gamma", "beta", "eps"), {**_GAMMA, "beta": "beta"},
          "nn.LayerNorm / F.layer_norm, with or without weight and bias", norm="layer", check=_last_dim_only,
          examples=_affine),
    Piece("rms_norm", _rms_norm, ("gamma", "eps"), {"gamma": "gamma", "eps": Derived(_rms_eps, "eps", "x")},
          "nn.RMSNorm / F.rms_norm (eps=None means the dtype's epsilon)", norm="rms", check=_last_dim_only,
          examples=lambda dims, dtype: _affine(dims, dtype, beta=False)),
    Piece("rms_by_hand", _rms_by_hand, ("gamma", "eps"), _GAMMA,
          "T5 / LLaMA-style RMS norm written out (its float32 casts vanish in a float32 model)", norm="rms",
          examples=lambda dims, dtype: _affine(dims, dtype, beta=False)),
    Piece("rms_by_hand_variance_upcast", _rms_by_hand_variance_upcast, ("gamma", "eps", "norm_dtype"), _GAMMA,
          "T5's RMS norm in half precision: the variance in float32, the result cast back", norm="rms",
          examples=_affine_cast),
    Piece("rms_by_hand_upcast", _rms_by_hand_upcast, ("gamma", "eps", "norm_dtype"), _GAMMA,
          "LLaMA-style RMS norm in half precision: x upcast to float32, the result cast back", norm="rms",
          examples=_affine_cast),
)
