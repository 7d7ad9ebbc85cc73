"""rewrite: replace each chosen match with one call of torch.ops.fusednorm.pre_norm_cross_attn.

The op's arguments are emitted right before the residual add from the pattern's binding: k / v brought to
[B, H, Lk, d] and the mask to a shape broadcastable to [B, H, Lq, Lk] with inserted view nodes, packed projection
weights sliced, and so on. Every inserted node carries fake metadata. Matches are rewritten last-first, so a block
whose input is an earlier block's output picks up that block's fused node when it is replaced.
"""
from __future__ import annotations

import torch
import torch.fx

from ..patterns.binding import resolve
from ..patterns.tracing import EmitTracer
from .context import PassContext

FUSED_OP = torch.ops.fusednorm.pre_norm_cross_attn.default
_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node")


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    if not ctx.matches:
        return gm
    graph = gm.graph
    fake_mode = find_fake_mode(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for match in sorted(ctx.matches, key=lambda m: order[m.anchor], reverse=True):
        _rewrite(graph, match, fake_mode, ctx)
    return gm


def find_fake_mode(graph: torch.fx.Graph):
    for node in graph.nodes:
        fake_mode = getattr(node.meta.get("example_value"), "fake_mode", None)
        if fake_mode is not None:
            return fake_mode
    return None


def _rewrite(graph: torch.fx.Graph, match, fake_mode, ctx: PassContext) -> None:
    anchor = match.anchor
    pattern = match.pattern
    meta = {k: anchor.meta[k] for k in _KEPT_META if k in anchor.meta}
    with graph.inserting_before(anchor):
        out = emit_fused(EmitTracer(graph, fake_mode, meta), pattern, match.values, ctx.options)
    anchor.replace_all_uses_with(out.node)


def emit_fused(tracer: EmitTracer, pattern, values: dict, options):
    """Emit, at the tracer's insertion point, what replaces a match: the op's arguments from the pattern's binding
    on the matched ``values`` (pattern parameter -> node or number), the fused call, the output adapter; returns
    the proxy of the block's new output."""
    a = resolve(pattern.bind, {p: tracer.wrap(v) for p, v in values.items()})
    eps, scale = (float(v) if isinstance(v, (int, float)) else v for v in (a["eps"], a["scale"]))
    fused = tracer.create_proxy(
        "call_function", FUSED_OP,
        (a["x"], a["k"], a["v"], a["gamma"], a["beta"], a["wq"], a["bq"], a["wo"], a["bo"], a["mask"],
         pattern.norm, eps, scale, options.sm_count, bool(options.check_numerics)), {})
    return pattern.bind["output"](fused) if pattern.bind.get("output") is not None else fused
