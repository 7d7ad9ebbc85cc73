"""The built-in patterns: the cross product of pieces, generated per family when a graph could hold one.

A family is one norm piece with one group of attention pieces; it is expanded (traced) the first time a graph
holds every op it needs (and, for the float32-upcast variants, a half-precision tensor), then cached. Within a
family every Q projection x attention variant x out projection is a pattern; the residual add matches in either
operand order, as add is commutative.
"""
from __future__ import annotations

import itertools

import torch

from . import explicit_softmax, multihead, sdpa
from .norms import NORMS
from .ops import HALF_PRECISION, LAYER_NORM, MHA, RMS_NORM, SDPA, SOFTMAX
from .pieces import Piece, compose
from .projections import OUT_PROJECTIONS, Q_PROJECTIONS
from .registry import Family, Pattern, register_family

_SDPA = ("call_function", SDPA)
_SOFTMAX = ("call_function", SOFTMAX)
_MATMUL = ("call_function", torch.matmul)
_UPCAST = "f32"  # pieces whose name says so cast to float32 and back: only in half-precision graphs

# attention groups: name -> (required facts, pieces)
_GROUPS = {
    "sdpa": ((_SDPA,), sdpa.CORES),
    "explicit_softmax": ((_SOFTMAX, _MATMUL), tuple(c for c in explicit_softmax.CORES if _UPCAST not in c.name)),
    "explicit_softmax_f32": ((_SOFTMAX, _MATMUL, HALF_PRECISION),
                             tuple(c for c in explicit_softmax.CORES if _UPCAST in c.name)),
}


def _norm_requirement(norm: Piece) -> tuple:
    op = {"layer_norm": LAYER_NORM, "rms_norm": RMS_NORM}.get(norm.name, torch.rsqrt)
    return (("call_function", op),) + ((HALF_PRECISION,) if "upcast" in norm.name else ())


def _expand(norm: Piece, cores) -> list[Pattern]:
    return [compose(norm, q, core, out, family=f"{norm.name} + {core.name}")
            for q, core, out in itertools.product(Q_PROJECTIONS, cores, OUT_PROJECTIONS)]


def _register():
    for norm in NORMS:
        for group, (required, cores) in _GROUPS.items():
            register_family(Family(f"{norm.name}+{group}", frozenset(_norm_requirement(norm) + required),
                                   lambda norm=norm, cores=cores: _expand(norm, cores)))
        register_family(Family(f"{norm.name}+multihead",
                               frozenset(_norm_requirement(norm) + (("call_function", MHA),)),
                               lambda norm=norm: [multihead.compose_multihead(norm, layout)
                                                  for layout in multihead.LAYOUTS]))


_register()
