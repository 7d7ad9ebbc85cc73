"""Pieces of a pre-norm cross-attention block, and their composition into whole patterns.

A block is ``x + out(core(q(norm(x))))``. Each piece is a plain function of the value flowing through the block and
of its own parameters, with how those parameters bind to the op and a one-line reason it exists. ``compose`` turns
one choice per slot into a registered ``Pattern`` (the same class user patterns use).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .binding import BindingError, Derived
from .ops import static_int
from .registry import MatchView, Pattern
from .tracing import meta_of


@dataclass(frozen=True)
class Dims:
    """Sizes for example inputs: small, all different, so a wrong binding cannot pass by symmetry."""
    B: int = 2
    Lq: int = 3
    Lk: int = 5
    H: int = 2
    d: int = 4
    D: int = 8


@dataclass(frozen=True)
class Piece:
    name: str
    fn: Callable                                        # fn(flow, **own params) -> flow
    params: tuple[str, ...] = ()
    bind: dict[str, Any] = field(default_factory=dict)  # op argument -> parameter / Fixed / Derived
    why: str = ""
    norm: str | None = None                             # norm pieces: "layer" or "rms"
    check: Callable[[MatchView], bool | str] | None = None
    scale: tuple[Callable, tuple[str, ...]] | None = None   # (factor function, its parameters); factor None = d^-0.5
    examples: Callable[[Dims, torch.dtype], dict] | None = None
    projects_q: bool = False                            # does this piece apply a Q projection (so D may differ)
    projects_out: bool = False


def default_scale(k) -> float:
    """d^-0.5 as a constant, d being k's last (head) dim; refused when the head dim is symbolic."""
    d = static_int(meta_of(k).shape[-1])
    if d is None:
        raise BindingError("the head dim is symbolic, so the combined attention scale is not a constant")
    return d ** -0.5


def _combine_scales(contributions):
    """The op's scale: the product of every piece's factor (None when only an SDPA default applies)."""
    params = tuple(dict.fromkeys(p for _, ps in contributions for p in ps))
    if "k" not in params:
        params += ("k",)

    def scale(*values):
        env = dict(zip(params, values))
        factors = [fn(*(env[p] for p in ps)) for fn, ps in contributions]
        if all(f is None for f in factors):
            return None
        out = 1.0
        for f in factors:
            out = out * (default_scale(env["k"]) if f is None else f)
        return out

    return Derived(scale, *params)


def _all_checks(checks):
    def check(match: MatchView):
        for c in checks:
            verdict = c(match)
            if verdict is not True:
                return verdict
        return True

    return check


def compose(norm: Piece, q: Piece, core: Piece, out: Piece, *, family: str) -> Pattern:
    pieces = (norm, q, core, out)
    params = list(dict.fromkeys(["x", *(p for piece in pieces for p in piece.params)]))

    def search(**kw):
        flow = kw["x"]
        for piece in pieces:
            flow = piece.fn(flow, **{p: kw[p] for p in piece.params})
        return kw["x"] + flow

    bind: dict[str, Any] = {"x": "x"}
    for piece in pieces:
        bind.update(piece.bind)
    contributions = [piece.scale for piece in pieces if piece.scale is not None]
    if contributions:
        bind["scale"] = _combine_scales(contributions)
    checks = [piece.check for piece in pieces if piece.check is not None]
    name = "/".join(piece.name for piece in pieces)

    def example_inputs(dtype=torch.float32):
        dims = Dims(D=6) if (q.projects_q and out.projects_out) else Dims()
        inputs = {"x": torch.randn(dims.B, dims.Lq, dims.D, dtype=dtype)}
        for piece in pieces:
            if piece.examples is not None:
                inputs.update(piece.examples(dims, dtype))
        return inputs

    return Pattern(name, search, bind, norm=norm.norm, check=_all_checks(checks) if checks else None,
                   example_inputs=example_inputs, params=params, builtin=True,
                   why=f"{family}: " + "; ".join(piece.why for piece in pieces if piece.why))
