"""A matched block's own nodes as a graph of their own (what the compiler would run for the block in this model),
and beside it what the rewrite puts in their place (the fused call and the nodes that make its arguments).

The measured choice (plans/choose.py) times the two against each other rather than the op against a canonical
block: a model's block is often slower than the canonical one (T5's attention is matmul, float32 softmax, matmul,
where the canonical block has SDPA's fused kernel), and timing the canonical form would leave such a block to the
compiler where the fused op is faster in the model (docs/PERF.md §3). The replacement holds what the block's nodes
did that the op does not: nn.MultiheadAttention's block is one node that also projects K and V, which the rewrite
emits again beside the op, so the op alone against that node would flatter the op.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..patterns.tracing import EmitTracer
from .rewrite import emit_fused, find_fake_mode


@dataclass(frozen=True)
class BlockGraph:
    gm: torch.fx.GraphModule   # placeholders: the block's inputs from outside it; output: the residual add
    inputs: tuple              # per placeholder: (the op argument it is, or "", its example value: a fake tensor)
    sources: tuple             # per placeholder: the name of the model's graph node it stands for
    output: str                # the name of the model's residual add
    signature: tuple           # the nodes' targets in order: blocks of one shape but other code are timed apart
    replacement: torch.fx.GraphModule | str | None = None  # the same placeholders and what the rewrite emits; a
                                                            # str: why there is none (the op alone is timed)


def block_graph(owned: set[torch.fx.Node], anchor: torch.fx.Node, roles: dict[torch.fx.Node, str],
                fused=None) -> BlockGraph | str:
    """The ``owned`` nodes (the block; ``anchor`` its output) copied into a graph of their own, or why they cannot be.

    Inputs from outside the block become placeholders, named by ``roles`` (graph node -> op argument) where one is
    an op argument; an input that is a plain number is inlined. Only static-shape tensor inputs are allowed, so that
    random inputs of the same shapes, strides and dtypes can run it. ``fused``: (pattern, matched values, options)
    to build the replacement from."""
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    body = sorted(owned, key=order.__getitem__)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, object] = {}
    inputs, sources = [], []
    for node in body:
        for arg in node.all_input_nodes:
            if arg in owned or arg in env:
                continue
            value = arg.meta.get("example_value", arg.meta.get("val"))
            if isinstance(value, (int, float, bool)):
                env[arg] = value
                continue
            if not isinstance(value, torch.Tensor):
                return f"the block's input {arg.name} is not a tensor ({type(value).__name__})"
            if not all(isinstance(s, int) for s in (*value.shape, *value.stride())):
                return f"the block's input {arg.name} has a dynamic shape"
            if not (value.dtype.is_floating_point or value.dtype == torch.bool):
                return f"the block's input {arg.name} is {value.dtype} (random values could index out of range)"
            env[arg] = graph.placeholder(f"in{len(inputs)}_{arg.name}")
            inputs.append((roles.get(arg, ""), value))
            sources.append(arg.name)
    for node in body:
        env[node] = graph.node_copy(node, lambda n: env[n])
        env[node].meta = {}  # the outer compile's fakes stay out of the nested one
    graph.output(env[anchor])
    root = anchor.graph.owning_module or torch.nn.Module()
    gm = torch.fx.GraphModule(root, graph)
    signature = tuple((n.op, _target_name(n.target)) for n in body)
    try:
        replacement = None if fused is None else _replacement(root, env, anchor, *fused)
    except Exception as e:  # noqa: BLE001 - the block's nodes are still timed, against the op alone
        replacement = f"emitting it raised {type(e).__name__}: {str(e)[:120]}"
    return BlockGraph(gm, tuple(inputs), tuple(sources), anchor.name, signature, replacement)


def _replacement(root, env: dict, anchor: torch.fx.Node, pattern, values: dict, options):
    """The block graph's placeholders and, after them, what the rewrite emits for the match (rewrite.emit_fused),
    or why there is none."""
    graph = torch.fx.Graph()
    outer = {}
    for node, copied in env.items():
        if isinstance(copied, torch.fx.Node) and copied.op == "placeholder":
            outer[node] = graph.placeholder(copied.name)
            outer[node].meta["example_value"] = node.meta.get("example_value", node.meta.get("val"))
        elif not isinstance(copied, torch.fx.Node):
            outer[node] = copied  # a number the block graph inlined
    inside = [p for p, v in values.items() if isinstance(v, torch.fx.Node) and v not in outer]
    if inside:
        return f"the matched {', '.join(inside)} is made inside the block"
    out = emit_fused(EmitTracer(graph, find_fake_mode(anchor.graph)), pattern,
                     {p: outer[v] if isinstance(v, torch.fx.Node) else v for p, v in values.items()}, options)
    graph.output(out.node)
    for node in graph.nodes:
        node.meta = {}  # as in the block graph: the outer compile's fakes stay out of the nested one
    return torch.fx.GraphModule(root, graph)


def _target_name(target) -> str:
    return target if isinstance(target, str) else getattr(target, "__qualname__", None) or repr(target)
