"""How a pattern's pieces become the fused op's arguments.

A binding maps each op argument to a search-function parameter (by name), to a ``Fixed`` value, or to a
``Derived`` plain function of parameters. The same binding runs twice: on static stand-ins to check a candidate
(``resolve`` + ``check_op_args``), and on proxies to emit the argument nodes into the user's graph at rewrite time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..op import FusedNormInputError, check_inputs

TENSOR_ARGS = ("x", "k", "v", "gamma", "beta", "wq", "bq", "wo", "bo", "mask")
SCALAR_ARGS = ("eps", "scale")
OP_ARGS = TENSOR_ARGS + SCALAR_ARGS
REQUIRED_ARGS = ("x", "k", "v")
NORM_KINDS = ("layer", "rms", "auto")   # "auto": the kind follows the norm op the pattern matched
DEFAULT_EPS = 1e-5


class PatternError(ValueError):
    """A pattern whose search function or binding contradicts the fused op."""


class BindingError(ValueError):
    """A match whose values cannot become the op's arguments (a near-miss, with this message as its reason)."""


@dataclass(frozen=True)
class Fixed:
    """A constant op argument, e.g. ``scale=Fixed(1.0)`` for attention that does not scale its scores (T5)."""
    value: Any


class Derived:
    """An op argument computed by a plain function of search-function parameters.

    ``fn`` receives the matched values in the order of ``params`` (tensors, or None / numbers for literals) and
    returns the argument. It runs on fake tensors to check a match and on proxies to emit nodes: use tensor methods
    and torch functions, and read static facts (dtype, dim()) from ``fusednorm.patterns.meta_of(t)``.
    """

    def __init__(self, fn: Callable, *params: str):
        if not callable(fn):
            raise PatternError(f"Derived needs a function, got {fn!r}")
        self.fn = fn
        self.params = tuple(params)

    def __call__(self, values: dict[str, Any]):
        return self.fn(*(values[p] for p in self.params))

    def __repr__(self):
        return f"Derived({getattr(self.fn, '__name__', 'fn')}, {', '.join(map(repr, self.params))})"


def resolve(bind: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments (tensor ones and eps/scale) from the matched values; absent ones are None."""
    args: dict[str, Any] = {}
    for name in OP_ARGS:
        b = bind.get(name)
        try:
            if b is None:
                args[name] = None
            elif isinstance(b, str):
                args[name] = values[b]
            elif isinstance(b, Fixed):
                args[name] = b.value
            else:
                args[name] = b(values)
        except BindingError:
            raise
        except Exception as e:
            raise BindingError(f"binding {name}={b!r} failed on the matched values ({type(e).__name__}: {e})") from e
    if args["eps"] is None:
        args["eps"] = DEFAULT_EPS
    return args


def check_op_args(args: dict[str, Any], norm: str) -> None:
    """Raise BindingError (the reason in words) unless the arguments satisfy the op (on static stand-ins)."""
    for name in TENSOR_ARGS:
        value = args[name]
        if name in REQUIRED_ARGS and not isinstance(value, torch.Tensor):
            raise BindingError(f"{name} must be a tensor, got {_describe(value)}")
        if value is not None and not isinstance(value, torch.Tensor):
            raise BindingError(f"{name} must be a tensor or absent, got {_describe(value)}")
    for name in SCALAR_ARGS:
        value = args[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise BindingError(f"{name} must be a number known at compile time, got {_describe(value)}")
    mask = args["mask"]
    if mask is not None and not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
        raise BindingError(f"mask shape/dtype not supported: {mask.dtype} (bool or floating masks only)")
    try:
        check_inputs(args["x"], args["k"], args["v"], args["gamma"], args["beta"], args["wq"], args["bq"],
                     args["wo"], args["bo"], mask, norm, float(args["eps"]),
                     None if args["scale"] is None else float(args["scale"]))
    except FusedNormInputError as e:
        reason = str(e).replace("fusednorm.pre_norm_cross_attn: ", "")
        if reason.startswith("mask"):
            reason = f"mask shape not supported: {reason}"
        elif "dtype" in reason and torch.is_autocast_enabled(args["x"].device.type):
            reason += (" (under torch.autocast the block mixes float32 and 16-bit activations, which the fused op "
                       "does not take; a model cast to one dtype, e.g. model.to(torch.bfloat16), is fused)")
        raise BindingError(reason) from e


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"
