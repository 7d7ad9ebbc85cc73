"""The pattern registry: built-in and user patterns through one API.

A pattern is a plain eager *search function* computing ``x + attention(norm(x), ...)`` the way some model writes
it, plus how its parameters bind to the fused op's arguments::

    import fusednorm
    from fusednorm.patterns import Fixed, Derived

    def search(x, w, b, eps, wq, k, v, wo):
        h = F.layer_norm(x, x.shape[-1:], w, b, eps)
        q = F.linear(h, wq).view(x.shape[0], x.shape[1], k.shape[1], k.shape[3]).transpose(1, 2)
        s = torch.einsum("bhqd,bhkd->bhqk", q, k).softmax(dim=-1)
        o = torch.einsum("bhqk,bhkd->bhqd", s, v)
        return x + F.linear(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1), wo)

    fusednorm.register_pattern("einsum_attention", search,
                               bind={"x": "x", "gamma": "w", "beta": "b", "eps": "eps", "wq": "wq", "k": "k",
                                     "v": "v", "wo": "wo", "scale": Fixed(1.0)},
                               norm="layer", example_inputs=make_example_inputs())

Sizes in the search function (``x.shape[0]`` ...) are wildcards when matching: the graph may spell them as
literals or symbolic nodes; the shapes they lead to are checked instead. A parameter bound to an optional op
argument (``b`` above) also matches a ``None`` in the graph (a LayerNorm without bias).
"""
from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx

from .binding import (NORM_KINDS, OP_ARGS, REQUIRED_ARGS, BindingError, Derived, Fixed, PatternError,
                      check_op_args, resolve)
from .matcher import is_cast
from .ops import ATTENTION_TARGETS, LAYER_NORM, NORM_TARGETS, RMS_NORM, read_args, signature_of
from .tracing import meta_expressions, trace_search

BINDABLE = OP_ARGS + ("output",)   # "output": a function bringing the op's [B, Lq, D] result to the graph's layout


@dataclass
class MatchView:
    """What a pattern's ``check`` sees of a candidate match."""
    pattern: str
    values: dict[str, Any]                 # parameter -> fake tensor with this compile's sizes, or a literal
    nodes: dict[str, Any]                  # parameter -> graph node, or a literal
    roles: dict[str, torch.fx.Node]        # "norm" / "attention" / "add" -> graph node

    def args_of(self, role: str) -> dict[str, Any]:
        """The arguments of the graph node in a role, by name (e.g. the norm's normalized_shape)."""
        return read_args(self.roles[role]) or {}


class Pattern:
    def __init__(self, name: str, search: Callable, bind: dict[str, Any], *, norm: str = "auto",
                 check: Callable[[MatchView], bool | str] | None = None, priority: int = 0,
                 example_inputs: dict | Callable[[], dict] | None = None, params: list[str] | None = None,
                 builtin: bool = False, why: str = ""):
        if not isinstance(name, str) or not name:
            raise PatternError(f"a pattern needs a non-empty name, got {name!r}")
        self.name, self.search, self.check, self.builtin, self.why = name, search, check, builtin, why
        if not callable(search):
            raise PatternError(f"pattern {name!r}: search must be a function, got {search!r}")
        if check is not None and not callable(check):
            raise PatternError(f"pattern {name!r}: check must be a function or None")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise PatternError(f"pattern {name!r}: priority must be an int, got {priority!r}")
        self.priority = priority
        self.params = list(params) if params is not None else _parameters(name, search)
        self.bind = _check_binding(name, dict(bind), self.params)
        if norm not in NORM_KINDS:
            raise PatternError(f"pattern {name!r}: norm must be one of {NORM_KINDS}, got {norm!r}")
        self._example_inputs = example_inputs
        try:
            self.graph = trace_search(search, self.params)
        except Exception as e:
            raise PatternError(f"pattern {name!r}: the search function could not be traced "
                               f"({type(e).__name__}: {e})") from e
        self.meta_exprs = meta_expressions(self.graph)
        self.roles = _find_roles(name, self.graph)
        self.norm = _norm_kind(name, norm, self.roles["norm"], self.bind)
        _check_residual(name, self.roles["add"], self.bind)
        _check_parameters_used(name, self.graph, self.meta_exprs, self.params)
        self.targets = frozenset((n.op, n.target) for n in self.graph.nodes  # casts may be absent (matcher.py)
                                 if n.op in ("call_function", "call_method") and n not in self.meta_exprs
                                 and not is_cast(n))
        self.depth = _depth(self.graph, self.meta_exprs)

    def __repr__(self):
        return f"Pattern({self.name!r}, norm={self.norm!r}, priority={self.priority})"

    @property
    def example_inputs(self) -> dict | None:
        ex = self._example_inputs
        return ex() if callable(ex) else ex

    def verify(self, example_inputs: dict | None = None) -> float:
        """Run the search function and the fused op on example inputs; raise PatternError unless they agree.

        Returns the relative L2 error. This is what catches a binding that maps pieces to the wrong op arguments.
        """
        inputs = example_inputs if example_inputs is not None else self.example_inputs
        if inputs is None:
            raise PatternError(f"pattern {self.name!r}: no example inputs to verify it with")
        missing = [p for p in self.params if p not in inputs]
        if missing:
            raise PatternError(f"pattern {self.name!r}: example inputs lack {missing}")
        try:
            expected = self.search(**inputs)
        except Exception as e:
            raise PatternError(f"pattern {self.name!r}: the search function fails on the example inputs "
                               f"({type(e).__name__}: {e})") from e
        try:
            args = resolve(self.bind, inputs)
            check_op_args(args, self.norm)
        except BindingError as e:
            raise PatternError(f"pattern {self.name!r}: its binding does not fit the op on the example inputs: "
                               f"{e}") from e
        y = torch.ops.fusednorm.pre_norm_cross_attn(
            args["x"], args["k"], args["v"], args["gamma"], args["beta"], args["wq"], args["bq"], args["wo"],
            args["bo"], args["mask"], self.norm, float(args["eps"]),
            None if args["scale"] is None else float(args["scale"]))
        if self.bind.get("output") is not None:
            y = self.bind["output"](y)
        if not isinstance(expected, torch.Tensor) or expected.shape != y.shape:
            raise PatternError(f"pattern {self.name!r}: the search function returns "
                               f"{getattr(expected, 'shape', expected)} but the op, as bound, returns {tuple(y.shape)}")
        err = float((y.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))
        tol = {torch.float64: 1e-8, torch.float32: 1e-3}.get(expected.dtype, 3e-2)
        if not math.isfinite(err) or err > tol:
            raise PatternError(f"pattern {self.name!r}: its binding does not compute the fused op on the example "
                               f"inputs (relative error {err:.2e} > {tol:.0e}); check which parameters bind to "
                               f"which op arguments, the norm kind and the scale")
        return err


def _parameters(name, search) -> list[str]:
    try:
        params = inspect.signature(search).parameters.values()
    except (TypeError, ValueError) as e:
        raise PatternError(f"pattern {name!r}: cannot read the search function's parameters ({e})") from e
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise PatternError(f"pattern {name!r}: the search function must name its parameters (no *args/**kwargs)")
    return [p.name for p in params]


def _check_binding(name, bind, params) -> dict:
    unknown = sorted(set(bind) - set(BINDABLE))
    if unknown:
        raise PatternError(f"pattern {name!r}: unknown op argument(s) {unknown} in bind; the fused op takes "
                           f"{list(OP_ARGS)} (and 'output' for a layout adapter)")
    missing = [a for a in REQUIRED_ARGS if bind.get(a) is None]
    if missing:
        raise PatternError(f"pattern {name!r}: bind must give {list(REQUIRED_ARGS)}; missing {missing}")
    for arg, b in bind.items():
        if arg == "output":
            if b is not None and not callable(b):
                raise PatternError(f"pattern {name!r}: bind['output'] must be a function of the op's result")
            continue
        if b is None or isinstance(b, Fixed):
            continue
        if isinstance(b, str):
            if b not in params:
                raise PatternError(f"pattern {name!r}: binds {arg!r} to {b!r}, but the search function has no "
                                   f"parameter {b!r} (it has {params})")
        elif isinstance(b, Derived):
            bad = [p for p in b.params if p not in params]
            if bad:
                raise PatternError(f"pattern {name!r}: {arg!r} is derived from {bad}, which are not parameters of "
                                   f"the search function (it has {params})")
        else:
            raise PatternError(f"pattern {name!r}: bind[{arg!r}] must be a parameter name, Fixed(value) or "
                               f"Derived(fn, *params); got {b!r}")
    for a, b in (("bq", "wq"), ("bo", "wo")):
        if bind.get(a) is not None and bind.get(b) is None:
            raise PatternError(f"pattern {name!r}: binds {a} without {b}; the op adds {a} only after the {b} "
                               f"projection")
    for arg in ("x", "k", "v", "gamma", "beta", "wq", "bq", "wo", "bo", "mask"):
        if isinstance(bind.get(arg), Fixed) and bind[arg].value is not None:
            raise PatternError(f"pattern {name!r}: {arg} is a tensor argument and cannot be Fixed")
    return bind


def _find_roles(name, graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    calls = [n for n in graph.nodes if n.op in ("call_function", "call_method")]
    out = next(n for n in graph.nodes if n.op == "output")
    root = out.args[0]
    norm = next((n for n in calls if n.target in NORM_TARGETS), None)
    attention = next((n for n in calls if n.target in ATTENTION_TARGETS), None)
    if not (isinstance(root, torch.fx.Node) and root.target is operator.add):
        raise PatternError(f"pattern {name!r}: the search function must return the residual add x + ...")
    if norm is None:
        raise PatternError(f"pattern {name!r}: no norm found in the search function (F.layer_norm, F.rms_norm, or "
                           f"torch.rsqrt in a hand-written RMS norm)")
    if attention is None:
        raise PatternError(f"pattern {name!r}: no attention found in the search function "
                           f"(F.scaled_dot_product_attention, F.multi_head_attention_forward or a softmax)")
    return {"norm": norm, "attention": attention, "add": root}


def _norm_kind(name, declared, norm_node, bind) -> str:
    found = {LAYER_NORM: "layer", RMS_NORM: "rms"}.get(norm_node.target)
    if declared == "auto":
        if found is None:
            raise PatternError(f"pattern {name!r}: norm='auto' needs F.layer_norm or F.rms_norm in the search "
                               f"function; say norm='rms' or norm='layer' for a hand-written norm")
        declared = found
    elif found is not None and found != declared:
        raise PatternError(f"pattern {name!r}: norm={declared!r} but the search function calls "
                           f"{norm_node.target.__name__}")
    if declared == "rms" and bind.get("beta") is not None:
        raise PatternError(f"pattern {name!r}: an RMS norm has no beta (the op computes x * rsqrt(mean(x^2) + eps) "
                           f"* gamma); do not bind beta")
    return declared


def _check_residual(name, add: torch.fx.Node, bind):
    x = bind["x"]
    x_params = {x} if isinstance(x, str) else set(getattr(x, "params", ()))
    operands = [a for a in add.args if isinstance(a, torch.fx.Node) and a.op == "placeholder"]
    if not any(a.target in x_params for a in operands):
        raise PatternError(f"pattern {name!r}: the residual add must take the parameter bound to x "
                           f"({sorted(x_params)}) as one operand: the op computes y = x + attention(norm(x))")


def _check_parameters_used(name, graph, meta_exprs, params):
    """Every parameter must be matched against the graph somewhere (not only feed sizes): else it binds nothing."""
    reached, stack = set(), [next(n for n in graph.nodes if n.op == "output").args[0]]
    while stack:
        n = stack.pop()
        if not isinstance(n, torch.fx.Node) or n in reached:
            continue
        reached.add(n)
        stack.extend(_matched_inputs(n, meta_exprs))
    unused = [p for p in params if p not in {n.target for n in reached if n.op == "placeholder"}]
    if unused:
        raise PatternError(f"pattern {name!r}: parameter(s) {unused} are not used by the search function's "
                           f"computation (only in sizes, or not at all), so a match could not bind them")


def _matched_inputs(n: torch.fx.Node, meta_exprs) -> list[torch.fx.Node]:
    """The inputs the matcher compares (not sizes, not size expressions)."""
    sig = signature_of(n)
    args = read_args(n) if sig is not None else None
    found: list[torch.fx.Node] = []
    if args is None:
        found = list(n.all_input_nodes)
    else:
        for arg_name, value in args.items():
            if arg_name not in sig.sizes:
                torch.fx.node.map_arg(value, found.append)
    return [a for a in found if a not in meta_exprs]


def _depth(graph, meta_exprs) -> int:
    """Edges on the longest path from the output back to a parameter: how far back from the add a match reaches."""
    depth: dict[torch.fx.Node, int] = {}
    for n in graph.nodes:
        if n.op in ("call_function", "call_method") and n not in meta_exprs:
            depth[n] = 1 + max((depth.get(a, 0) for a in _matched_inputs(n, meta_exprs)), default=0)
    root = next(n for n in graph.nodes if n.op == "output").args[0]
    return depth.get(root, 0)


# ---- the registry -----------------------------------------------------------------------------------------------

@dataclass
class Family:
    """Built-in patterns generated on demand: only when a graph holds every target in ``required``."""
    name: str
    required: frozenset
    expand: Callable[[], list[Pattern]]
    _patterns: list[Pattern] | None = field(default=None, repr=False)

    def patterns(self) -> list[Pattern]:
        if self._patterns is None:
            self._patterns = self.expand()
        return self._patterns


_USER: dict[str, Pattern] = {}
_FAMILIES: list[Family] = []


def register_pattern(name: str, search: Callable, bind: dict[str, Any], *, norm: str = "auto",
                     check: Callable[[MatchView], bool | str] | None = None, priority: int = 0,
                     example_inputs: dict | None = None) -> Pattern:
    """Teach fusednorm a block: see the module docstring. Raises PatternError for a contradictory pattern.

    ``bind`` maps op arguments (x, k, v, gamma, beta, wq, bq, wo, bo, mask, eps, scale; and ``output``) to search
    parameters, ``Fixed`` values or ``Derived`` functions. ``norm`` is "layer", "rms" or "auto" (from the norm op the
    search function calls). ``check(match)`` returns True, or False / a reason string to refuse a match. Among
    overlapping matches the higher ``priority`` wins. With ``example_inputs`` (a dict of the search function's
    parameters) the pattern is verified against the op at once.
    """
    if name in _USER:
        raise PatternError(f"a pattern named {name!r} is already registered; unregister_pattern({name!r}) first")
    pattern = Pattern(name, search, bind, norm=norm, check=check, priority=priority, example_inputs=example_inputs)
    if example_inputs is not None:
        pattern.verify()
    _USER[name] = pattern
    return pattern


def unregister_pattern(name: str) -> None:
    if name not in _USER:
        raise KeyError(f"no registered pattern named {name!r} (registered: {sorted(_USER)})")
    del _USER[name]


def register_family(family: Family) -> None:
    _FAMILIES.append(family)


def user_patterns() -> list[Pattern]:
    return list(_USER.values())


def patterns_for(targets: set) -> list[Pattern]:
    """Every pattern whose ops all occur in a graph with these (op, target) pairs: user ones, then built-ins."""
    from . import builtin  # noqa: F401  (registers the built-in families on first use)

    found = [p for p in _USER.values() if p.targets <= targets]
    for family in _FAMILIES:
        if family.required <= targets:
            found += [p for p in family.patterns() if p.targets <= targets]
    return found


def builtin_families() -> list[Family]:
    from . import builtin  # noqa: F401

    return list(_FAMILIES)
