"""A graph as readable Python: every value annotated with its dtype, shape and device, source lines as comments."""
from __future__ import annotations

import contextlib

import torch
import torch.fx

_META_KEYS = ("val", "example_value", "tensor_meta")


def readable_graph(gm: torch.fx.GraphModule, title: str = "") -> str:
    with _meta_for_new_nodes(gm):
        try:
            code = gm.graph.python_code("self", verbose=True, include_stride=False, include_device=True).src
        except TypeError:   # an older torch.fx without these keywords
            code = gm.graph.python_code("self").src
    fused = [n.name for n in gm.graph.nodes if _is_fusednorm(n)]
    head = [f"# {title}"] if title else []
    head.append(f"# {len(gm.graph.nodes)} nodes; fusednorm nodes: {', '.join(fused) or 'none'}")
    return "\n".join(head) + "\n" + code.strip("\n") + "\n"


def _is_fusednorm(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith("fusednorm.")


def _has_meta(node: torch.fx.Node) -> bool:
    return any(node.meta.get(k) is not None for k in _META_KEYS)


@contextlib.contextmanager
def _meta_for_new_nodes(gm: torch.fx.GraphModule):
    """Nodes a pass added without metadata get a fake value for the printout only, removed afterwards."""
    missing = [n for n in gm.graph.nodes if n.op not in ("output", "get_attr") and not _has_meta(n)]
    added: list[torch.fx.Node] = []
    if missing:
        with contextlib.suppress(Exception):   # annotations are a courtesy: the code prints without them
            values = _fake_values(gm)
            for n in missing:
                if n in values:
                    n.meta["val"] = values[n]
                    added.append(n)
    try:
        yield
    finally:
        for n in added:
            n.meta.pop("val", None)


def _fake_values(gm: torch.fx.GraphModule) -> dict:
    from torch._guards import detect_fake_mode

    inputs = [_node_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([v for v in inputs if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        return {}
    values: dict = {}

    class _Record(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            values[n] = out
            return out

    with fake_mode:
        _Record(gm).run(*inputs)
    return values


def _node_value(node: torch.fx.Node):
    for key in ("val", "example_value"):
        if node.meta.get(key) is not None:
            return node.meta[key]
    return None
