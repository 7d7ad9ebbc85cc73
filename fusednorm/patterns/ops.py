"""The torch-level vocabulary that patterns are written in and that the canonicalise pass rewrites graphs into.

Dynamo spells one computation several ways (``x.view`` / ``x.reshape`` / ``torch.reshape``; ``x @ y`` /
``torch.matmul`` / ``torch.bmm``; ``x.float()`` / ``x.to(torch.float32)`` / ``x.type_as(y)`` ...). The canonicalise
pass rewrites every spelling into the one kept here, and the matcher reads each canonical node's arguments by name
through ``SIGNATURES``, so positional and keyword spellings compare equal.
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

LINEAR = torch._C._nn.linear
SDPA = torch._C._nn.scaled_dot_product_attention
MHA = F.multi_head_attention_forward
LAYER_NORM = F.layer_norm
RMS_NORM = F.rms_norm
SOFTMAX = F.softmax

# A graph fact families can require besides ops: some tensor is float16 / bfloat16 (casts to float32 and back
# only exist there; patterns for them are not generated for float32 graphs).
HALF_PRECISION = ("dtype", "half")

# Where a norm, an attention and a residual add show up in a canonical graph (for roles and near-miss reports).
NORM_TARGETS = (LAYER_NORM, RMS_NORM, torch.rsqrt)
ATTENTION_TARGETS = (SDPA, MHA, SOFTMAX)


@dataclass(frozen=True)
class Signature:
    names: tuple[str, ...]                                   # argument names in call order
    defaults: dict[str, Any] = field(default_factory=dict)   # filled in when a call leaves them out
    sizes: frozenset[str] = frozenset()      # size arguments: wildcards (shapes are checked from metadata instead)
    dims: frozenset[str] = frozenset()       # dimension arguments: compared after resolving negative dims
    ignored: frozenset[str] = frozenset()    # arguments that do not change the value (softmax's _stacklevel)
    commutative: bool = False                # a op b == b op a exactly (IEEE add and mul are commutative)


def _sig(*names, defaults=None, sizes=(), dims=(), ignored=(), commutative=False) -> Signature:
    return Signature(tuple(names), dict(defaults or {}), frozenset(sizes), frozenset(dims), frozenset(ignored),
                     commutative)


SIGNATURES: dict[tuple[str, Any], Signature] = {
    ("call_function", LAYER_NORM): _sig("input", "normalized_shape", "weight", "bias", "eps",
                                        defaults={"weight": None, "bias": None, "eps": 1e-5},
                                        sizes=("normalized_shape",)),
    ("call_function", RMS_NORM): _sig("input", "normalized_shape", "weight", "eps",
                                      defaults={"weight": None, "eps": None}, sizes=("normalized_shape",)),
    ("call_function", LINEAR): _sig("input", "weight", "bias", defaults={"bias": None}),
    ("call_function", SDPA): _sig("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa",
                                  defaults={"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                                            "enable_gqa": False}),
    ("call_function", SOFTMAX): _sig("input", "dim", "_stacklevel", "dtype",
                                     defaults={"dim": None, "_stacklevel": 3, "dtype": None},
                                     dims=("dim",), ignored=("_stacklevel",)),
    ("call_function", torch.matmul): _sig("input", "other"),
    ("call_function", torch.rsqrt): _sig("input"),
    ("call_function", torch.pow): _sig("input", "exponent"),
    ("call_function", torch.mean): _sig("input", "dim", "keepdim", "dtype",
                                        defaults={"dim": None, "keepdim": False, "dtype": None}, dims=("dim",)),
    ("call_function", torch.reshape): _sig("input", "shape", sizes=("shape",)),
    ("call_function", torch.transpose): _sig("input", "dim0", "dim1", dims=("dim0", "dim1")),
    ("call_function", torch.permute): _sig("input", "dims", dims=("dims",)),
    ("call_function", operator.add): _sig("a", "b", commutative=True),
    ("call_function", operator.mul): _sig("a", "b", commutative=True),
    ("call_function", operator.truediv): _sig("a", "b"),
    ("call_function", operator.sub): _sig("a", "b"),
    ("call_function", operator.getitem): _sig("a", "b"),
    ("call_method", "to"): _sig("input", "dtype"),
}


@lru_cache(maxsize=None)
def _python_signature(target) -> Signature | None:
    """Plain Python functions (F.multi_head_attention_forward, user helpers) read through inspect.signature."""
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return _sig(*(p.name for p in params),
                defaults={p.name: p.default for p in params if p.default is not inspect.Parameter.empty})


def signature_of(node: torch.fx.Node) -> Signature | None:
    sig = SIGNATURES.get((node.op, node.target))
    if sig is None and node.op == "call_function" and inspect.isfunction(node.target):
        sig = _python_signature(node.target)
    return sig


def read_args(node: torch.fx.Node) -> dict[str, Any] | None:
    """The node's arguments by name, defaults filled in; None when they cannot be read by name."""
    sig = signature_of(node)
    if sig is None or len(node.args) > len(sig.names) or not set(node.kwargs) <= set(sig.names):
        return None
    args = dict(zip(sig.names, node.args))
    for name, value in node.kwargs.items():
        if name in args:
            return None
        args[name] = value
    for name, value in sig.defaults.items():
        args.setdefault(name, value)
    if set(args) != set(sig.names):
        return None
    for name in sig.ignored:
        args.pop(name, None)
    return args


def normalize_dims(value, rank: int):
    """Negative dims resolved against the input's rank, so dim=-1 and dim=3 compare equal on a 4-d tensor."""
    if isinstance(value, bool) or rank is None:
        return value
    if isinstance(value, int):
        return value % rank if -rank <= value < rank else value
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(normalize_dims(v, rank) for v in value)
    return value


def graph_facts(graph: torch.fx.Graph) -> set:
    """The (op, target) pairs in a graph, plus HALF_PRECISION when it holds half-precision tensors."""
    facts = set()
    for n in graph.nodes:
        if n.op in ("call_function", "call_method"):
            facts.add((n.op, n.target))
        ev = n.meta.get("example_value")
        if isinstance(ev, torch.Tensor) and ev.dtype in (torch.float16, torch.bfloat16):
            facts.add(HALF_PRECISION)
    return facts


def example_value(node) -> Any:
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def rank_of(node) -> int | None:
    ev = example_value(node)
    return ev.dim() if isinstance(ev, torch.Tensor) else None


def static_int(value) -> int | None:
    """An int when the value is statically known (a plain int, or a SymInt that the shape env has fixed)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        return value.node.maybe_as_int()
    return None


def hint(value):
    """The concrete value a symbolic size or float stands for in this compile (never adds a guard)."""
    if isinstance(value, torch.SymInt):
        n = value.node
        if n.maybe_as_int() is not None:
            return n.maybe_as_int()
        if n.hint is not None:
            return int(n.hint)
        raise ValueError(f"the size {value} has no hint (data-dependent)")
    if isinstance(value, torch.SymFloat):
        return float(value.node.hint)
    if isinstance(value, torch.SymBool):
        return bool(value.node.hint)
    return value
