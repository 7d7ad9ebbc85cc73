"""Q- and out-projection pieces: with or without bias (a None bias binds to None), scaled or not, or absent."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .binding import Derived
from .pieces import Piece


def _q_linear(h, wq, bq):
    return F.linear(h, wq, bq)


def _q_linear_scaled(h, wq, bq, q_scale):
    return F.linear(h, wq, bq) * q_scale


def _identity(t):
    return t


def _out_linear(o, wo, bo):
    return F.linear(o, wo, bo)


def _out_linear_rescaled(o, wo, bo, rescale):
    return F.linear(o, wo, bo) / rescale


def _q_examples(dims, dtype):
    Dq = dims.H * dims.d
    return {"wq": torch.randn(Dq, dims.D, dtype=dtype) / dims.D ** 0.5, "bq": 0.1 * torch.randn(Dq, dtype=dtype)}


def _out_examples(dims, dtype):
    Dq = dims.H * dims.d
    return {"wo": torch.randn(dims.D, Dq, dtype=dtype) / Dq ** 0.5, "bo": 0.1 * torch.randn(dims.D, dtype=dtype)}


def _divided(w, r):
    return w / r


def _divided_bias(b, r):
    return None if b is None else b / r


Q_PROJECTIONS = (
    Piece("q_linear", _q_linear, ("wq", "bq"), {"wq": "wq", "bq": "bq"}, "a Q projection, biased or not",
          examples=_q_examples, projects_q=True),
    Piece("q_linear_scaled", _q_linear_scaled, ("wq", "bq", "q_scale"), {"wq": "wq", "bq": "bq"},
          "a Q projection scaled before the head split (Whisper, BART)", scale=(lambda s: s, ("q_scale",)),
          examples=lambda dims, dtype: {**_q_examples(dims, dtype), "q_scale": 0.7}, projects_q=True),
    Piece("q_none", _identity, (), {}, "no Q projection: the normed x is the query (D == H*d)"),
)

OUT_PROJECTIONS = (
    Piece("out_linear", _out_linear, ("wo", "bo"), {"wo": "wo", "bo": "bo"}, "an out projection, biased or not",
          examples=_out_examples, projects_out=True),
    Piece("out_linear_rescaled", _out_linear_rescaled, ("wo", "bo", "rescale"),
          {"wo": Derived(_divided, "wo", "rescale"), "bo": Derived(_divided_bias, "bo", "rescale")},
          "an out projection divided by a factor (diffusers' rescale_output_factor when it is not a constant 1), "
          "folded into wo and bo", examples=lambda dims, dtype: {**_out_examples(dims, dtype), "rescale": 1.5},
          projects_out=True),
    Piece("out_none", _identity, (), {}, "no out projection (D == H*d)"),
)
