"""Turning plain functions into graphs: patterns (traced once, no shapes) and the nodes a rewrite inserts.

A search function is traced with FX proxies into a canonical pattern graph. Binding functions (``Derived``) are
emitted straight into the user's graph through ``EmitTracer``, whose proxies carry the fake value of every node they
create, so a binding can branch on static facts (``meta_of(t).dtype``, ``meta_of(t).dim()``) and every inserted
node gets the ``example_value`` metadata that later compiler stages expect.
"""
from __future__ import annotations

import builtins
import contextlib
import operator

import torch
import torch.fx
from torch.fx.proxy import GraphAppendingTracer, Proxy

from .canonical import canonicalize_graph

_META_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda"}
_SIZE_OPS = {operator.getitem, operator.mul, operator.floordiv, operator.add, operator.sub, operator.neg,
             operator.truediv, builtins.len}


def trace_search(fn, params: list[str]) -> torch.fx.Graph:
    """The canonical graph of ``fn(**{p: placeholder})``; the output must be a single traced value."""
    graph = torch.fx.Graph()
    tracer = GraphAppendingTracer(graph)
    proxies = {p: Proxy(graph.placeholder(p), tracer) for p in params}
    out = fn(**proxies)
    if not isinstance(out, Proxy):
        raise TypeError(f"the search function returned {type(out).__name__}, not a traced tensor")
    graph.output(out.node)
    canonicalize_graph(graph, use_meta=False)
    graph.eliminate_dead_code()
    return graph


def meta_expressions(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Pattern nodes that compute sizes or dtypes from tensor metadata (x.shape[0] * k.shape[1], y.dtype ...).

    The matcher treats them as wildcards: the graph spells the same sizes as literals or symbolic nodes, and the
    shapes they lead to are checked from metadata instead.
    """
    found: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "call_function" and node.target is builtins.getattr and node.args[1] in _META_ATTRS:
            found.add(node)
        elif node.op == "call_method" and node.target in ("size", "dim"):
            found.add(node)
        elif node.op == "call_function" and node.target in _SIZE_OPS and node.all_input_nodes \
                and all(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


class MetaProxy(Proxy):
    """A proxy for a node whose fake value is known: static facts come from it, everything else is traced."""

    @property
    def meta(self):
        return self.node.meta.get("example_value")

    @property
    def dtype(self):
        return self.meta.dtype

    @property
    def device(self):
        return self.meta.device

    @property
    def ndim(self):
        return self.meta.dim()

    def dim(self):
        return self.meta.dim()

    def is_floating_point(self):
        return self.meta.is_floating_point()


def meta_of(value):
    """The fake value behind a MetaProxy, or the value itself (a real or fake tensor, a number, None)."""
    return value.meta if isinstance(value, MetaProxy) else value


class EmitTracer(GraphAppendingTracer):
    """Appends nodes at the graph's insertion point and gives each one its fake ``example_value``."""

    def __init__(self, graph: torch.fx.Graph, fake_mode, meta: dict | None = None):
        super().__init__(graph)
        self.fake_mode = fake_mode
        self.extra_meta = dict(meta or {})

    def proxy(self, node: torch.fx.Node) -> MetaProxy:
        return MetaProxy(node, self)

    def wrap(self, value):
        """Nodes become MetaProxies; other values (numbers, None, dtypes) pass through."""
        return self.proxy(value) if isinstance(value, torch.fx.Node) else value

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta.update(self.extra_meta)
        node.meta["example_value"] = run_on_fakes(node, self.fake_mode)
        return node


def run_on_fakes(node: torch.fx.Node, fake_mode):
    """Evaluate one node on its inputs' fake values (the values Dynamo recorded, or those of inserted nodes)."""
    def value(a):
        return a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a

    args = torch.fx.node.map_aggregate(node.args, value)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
    raise ValueError(f"cannot evaluate a {node.op} node on fakes")

