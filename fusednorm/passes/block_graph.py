"""A matched block's own nodes as a graph of their own: what the compiler would run for the block in this model.

The measured choice (plans/choose.py) times the fused op against the compiler on this graph rather than on a
canonical block: a model's block is often slower than the canonical one (T5's attention is matmul, float32 softmax,
matmul, where the canonical block has SDPA's fused kernel), and timing the canonical form would leave such a block
to the compiler where the fused op is faster in the model (docs/PERF.md §3).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx


@dataclass(frozen=True)
class BlockGraph:
    gm: torch.fx.GraphModule   # placeholders: the block's inputs from outside it; output: the residual add
    inputs: tuple              # per placeholder: (the op argument it is, or "", its example value: a fake tensor)
    sources: tuple             # per placeholder: the name of the model's graph node it stands for
    output: str                # the name of the model's residual add
    signature: tuple           # the nodes' targets in order: blocks of one shape but other code are timed apart


def block_graph(owned: set[torch.fx.Node], anchor: torch.fx.Node, roles: dict[torch.fx.Node, str]) -> BlockGraph | str:
    """The ``owned`` nodes (the block; ``anchor`` its output) copied into a graph of their own, or why they cannot be.

    Inputs from outside the block become placeholders, named by ``roles`` (graph node -> op argument) where one is
    an op argument; an input that is a plain number is inlined. Only static-shape tensor inputs are allowed, so that
    random inputs of the same shapes, strides and dtypes can run it."""
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
    gm = torch.fx.GraphModule(anchor.graph.owning_module or torch.nn.Module(), graph)
    signature = tuple((n.op, _target_name(n.target)) for n in body)
    return BlockGraph(gm, tuple(inputs), tuple(sources), anchor.name, signature)


def _target_name(target) -> str:
    return target if isinstance(target, str) else getattr(target, "__qualname__", None) or repr(target)
