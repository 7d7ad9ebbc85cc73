"""Structural matching of a pattern graph against a canonical graph, anchored at the residual add.

Both graphs are canonical (fusednorm/patterns/canonical.py), so a pattern node matches a graph node when the targets
are equal and the arguments match by name: pattern placeholders bind to anything (a node, a literal, None) but
consistently; size arguments and pattern size expressions are wildcards; dims compare after resolving negative
values; add and mul match in either operand order. Matching is by backtracking over those choices; the shapes the
wildcards let through are then checked by running the pattern on the match's own inputs (``check_shapes``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx

from .ops import normalize_dims, rank_of, read_args, signature_of

_MAX_STATES = 16   # alternative bindings tried per anchor (commutative orders multiply)
_SIZE_READERS = {"size", "dim", "stride"}


@dataclass
class StructuralMatch:
    anchor: torch.fx.Node                      # the graph node matched by the pattern's output (the residual add)
    values: dict[str, Any]                     # search-function parameter -> graph node or literal
    nodes: dict[torch.fx.Node, torch.fx.Node]  # pattern call node -> graph node

    @property
    def owned(self) -> set[torch.fx.Node]:
        return set(self.nodes.values())


class _State:
    __slots__ = ("binds", "nodes", "taken")

    def __init__(self, binds=None, nodes=None, taken=None):
        self.binds = binds or {}
        self.nodes = nodes or {}
        self.taken = taken or {}

    def bind(self, p, t) -> "_State":
        binds = dict(self.binds)
        binds[p] = t
        return _State(binds, self.nodes, self.taken)

    def visit(self, p, t) -> "_State":
        nodes, taken = dict(self.nodes), dict(self.taken)
        nodes[p], taken[t] = t, p
        return _State(self.binds, nodes, taken)


def match_at(pattern: torch.fx.Graph, meta_exprs: set, anchor: torch.fx.Node) -> Iterator[StructuralMatch]:
    """Every consistent structural match of the pattern whose output lands on ``anchor`` (at most _MAX_STATES)."""
    out = next(n for n in reversed(pattern.nodes) if n.op == "output")
    root = out.args[0]
    matcher = _Matcher(meta_exprs)
    placeholders = [n for n in pattern.nodes if n.op == "placeholder"]
    for i, state in enumerate(matcher.node(root, anchor, _State())):
        if i >= _MAX_STATES:
            return
        values = {p.target: state.binds[p] for p in placeholders if p in state.binds}
        yield StructuralMatch(anchor, values, dict(state.nodes))


class _Matcher:
    def __init__(self, meta_exprs):
        self.meta_exprs = meta_exprs

    def node(self, p: torch.fx.Node, t, st: _State) -> Iterator[_State]:
        if p.op == "placeholder":
            if p in st.binds:
                if _same(st.binds[p], t):
                    yield st
            else:
                yield st.bind(p, t)
            return
        if p in self.meta_exprs:
            yield st
            return
        if is_cast(p):
            # A cast in the pattern may be absent from the graph: canonicalisation drops casts to the dtype a
            # tensor already has (a float32 model's .float()), and the fused op computes in float32 regardless.
            yield from self.node(p.args[0], t, st)
        if not isinstance(t, torch.fx.Node) or t.op != p.op or t.target != p.target:
            return
        if p in st.nodes:
            if st.nodes[p] is t:
                yield st
            return
        if t in st.taken:
            return
        st = st.visit(p, t)
        sig = signature_of(p)
        pa, ta = read_args(p), read_args(t)
        if sig is None or pa is None or ta is None:
            yield from self.seq(list(p.args) + [p.kwargs.get(k) for k in sorted(p.kwargs)],
                                list(t.args) + [t.kwargs.get(k) for k in sorted(t.kwargs)], st,
                                same_keys=sorted(p.kwargs) == sorted(t.kwargs) and len(p.args) == len(t.args))
            return
        if set(pa) != set(ta):
            return
        rank = rank_of(_first_tensor_input(t))
        if sig.commutative:
            yield from self.seq([pa["a"], pa["b"]], [ta["a"], ta["b"]], st)
            yield from self.seq([pa["b"], pa["a"]], [ta["a"], ta["b"]], st)
            return
        ps, ts = [], []
        for name in sig.names:
            if name not in pa or name in sig.sizes:
                continue
            pv, tv = pa[name], ta[name]
            if name in sig.dims:
                pv, tv = normalize_dims(pv, rank), normalize_dims(tv, rank)
            ps.append(pv)
            ts.append(tv)
        if p.target is torch.transpose:  # transpose(a, b) == transpose(b, a)
            if sorted(ps[1:], key=repr) != sorted(ts[1:], key=repr):
                return
            ps, ts = ps[:1], ts[:1]
        yield from self.seq(ps, ts, st)

    def seq(self, ps, ts, st, same_keys=True) -> Iterator[_State]:
        if not same_keys or len(ps) != len(ts):
            return
        if not ps:
            yield st
            return
        for st1 in self.value(ps[0], ts[0], st):
            yield from self.seq(ps[1:], ts[1:], st1)

    def value(self, pv, tv, st) -> Iterator[_State]:
        if isinstance(pv, torch.fx.Node):
            yield from self.node(pv, tv, st)
        elif isinstance(pv, (list, tuple)):
            if isinstance(tv, (list, tuple)) and len(pv) == len(tv):
                yield from self.seq(list(pv), list(tv), st)
        elif _literal_equal(pv, tv):
            yield st


def is_cast(node: torch.fx.Node) -> bool:
    """The canonical dtype cast ``x.to(dtype)`` (canonical.py spells every cast this way)."""
    return node.op == "call_method" and node.target == "to" and len(node.args) == 2 and not node.kwargs


def _first_tensor_input(node: torch.fx.Node):
    for a in node.all_input_nodes:
        if isinstance(a.meta.get("example_value"), torch.Tensor):
            return a
    return None


def _same(a, b) -> bool:
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        return a is b
    return _literal_equal(a, b)


def _literal_equal(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        return False
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_literal_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:
        return False


def foreign_users(match: StructuralMatch) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Matched intermediates whose values are used outside the match (reading only a size is fine)."""
    owned = match.owned
    out = {}
    for node in owned:
        if node is match.anchor:
            continue
        others = [u for u in node.users if u not in owned and not _reads_size_only(u, node)]
        if others:
            out[node] = others
    return out


def _reads_size_only(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    if user.op == "call_method" and user.target in _SIZE_READERS:
        return True
    if user.op == "call_function" and user.target is getattr and user.args[1] in ("shape", "dtype", "device"):
        return True
    return user.op == "call_function" and user.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_size)


def check_shapes(pattern: torch.fx.Graph, match: StructuralMatch, space) -> str | None:
    """Run the pattern on the match's inputs (static stand-ins) and compare every node's shape and dtype.

    A reshape's meaning follows from its input and output shapes alone, so equal shapes at every matched node mean
    the graph computes exactly what the pattern computes. Returns None, or what does not fit, in words.
    """
    placeholders = [n for n in pattern.nodes if n.op == "placeholder"]
    try:
        args = [space.of(match.values[p.target]) for p in placeholders]
    except KeyError as e:
        return f"the pattern's parameter {e} was not bound by the match"
    env: dict[torch.fx.Node, Any] = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            env[n] = result
            return result

    try:
        with space.mode:
            _Recorder(torch.nn.Module(), graph=pattern).run(*args)
    except Exception as e:  # the pattern cannot even run on these inputs: it does not describe this graph
        return f"the pattern does not run on the matched shapes ({type(e).__name__}: {e})"
    for p, t in match.nodes.items():
        reason = _compare(p, env.get(p), space.of(t))
        if reason:
            return reason
    return None


def _compare(p, expected, actual) -> str | None:
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        for e, a in zip(expected, actual):
            reason = _compare(p, e, a)
            if reason:
                return reason
        return None
    if isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor):
        if tuple(expected.shape) != tuple(actual.shape) or expected.dtype != actual.dtype:
            return (f"at {p.name} the pattern expects {tuple(expected.shape)} {expected.dtype} but the graph has "
                    f"{tuple(actual.shape)} {actual.dtype}")
    return None
