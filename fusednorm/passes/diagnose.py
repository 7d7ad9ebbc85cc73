"""diagnose: explain, as a NearMiss, every norm -> attention -> residual add chain that the match pass did not fuse.

Runs before rewrite, while the chains are still in the graph. Chains are found from the ops alone (any norm whose
output reaches an attention's query, and a residual add of the norm's input downstream), so a block no pattern
recognised is reported too, with the ops on its path that no pattern knows. Post-norm blocks (attention, add, then
norm) are reported as such.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from ..patterns.ops import (LAYER_NORM, LINEAR, MHA, RMS_NORM, SDPA, SIGNATURES, SOFTMAX, normalize_dims, rank_of,
                            read_args)
from ..report import NearMiss
from .context import PassContext
from .locations import locations
from .match import depends_on

_WINDOW = 400          # graph positions searched between a norm, its attention and its add
_CONTRACTIONS = {torch.matmul, torch.baddbmm, torch.einsum, torch.bmm}
_QUERY_PATH = {LINEAR, torch.reshape, torch.transpose, torch.permute, operator.mul, operator.truediv,
               operator.getitem, torch.unflatten, torch.flatten}
_MHA_UNSUPPORTED = ("attn_mask", "bias_k", "bias_v", "add_zero_attn", "static_k", "static_v")
_DROPOUTS = {torch.nn.functional.dropout, torch.dropout, torch.nn.functional.dropout1d,
             torch.nn.functional.dropout2d, torch.nn.functional.dropout3d}


@dataclass
class NormSite:
    call: torch.fx.Node      # where the norm is (its location)
    out: torch.fx.Node       # the normed value
    x: torch.fx.Node         # the norm's input (the residual of a pre-norm block)
    problem: str | None      # why this norm cannot be fused, e.g. not over the last dim


@dataclass
class AttentionSite:
    node: torch.fx.Node
    query: torch.fx.Node | None
    keys: list[torch.fx.Node]
    causal: bool
    dropout: str | None
    kind: str
    unsupported: str | None = None   # arguments no pattern handles (nn.MultiheadAttention's attn_mask ...)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    try:
        _diagnose(gm.graph, ctx)
    except Exception as e:  # the report is incomplete then, but the chosen matches are still fused
        ctx.report.notes.append(f"fusednorm: explaining the chains not fused failed ({type(e).__name__}: {e}); "
                                f"graph {ctx.graph_id}'s near-misses are incomplete")
    return gm


def _diagnose(graph: torch.fx.Graph, ctx: PassContext) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    fused = {c.anchor for c in ctx.matches}
    failures = ctx.failures
    norms = find_norms(graph)
    attentions = find_attentions(graph)
    explained: set[torch.fx.Node] = set()
    in_chain: set[torch.fx.Node] = set()

    def note(reason, roles, pattern=""):
        ctx.report.near_misses.append(NearMiss(reason=reason, locations=locations(roles), pattern=pattern,
                                               graph=ctx.graph_id))

    for norm in norms:
        for att in attentions:
            if att.query is None or not 0 < order[att.node] - order[norm.out] <= _WINDOW:
                continue
            if not depends_on(att.query, {norm.out}, order):
                continue
            add = _residual_add(att.node, norm.x, order)
            if add is None:
                continue
            in_chain.add(att.node)
            if add in fused or add in explained:
                continue
            explained.add(add)
            reason, pattern = _explain(norm, att, add, failures.get(add, []), order)
            note(reason, {"norm": norm.call, "attention": att.node, "add": add}, pattern or att.kind)

    for att in attentions:
        if att.node in in_chain or att.query is None:
            continue
        origin = _query_origin(att.query)
        add = _residual_add(att.node, origin, order)
        if add is None or add in fused or add in explained:
            continue
        post = next((n for n in find_norms_after(add) if n.x is add), None)
        if post is not None:
            explained.add(add)
            note("post-norm: the residual add comes before the norm (add, then norm); only pre-norm blocks are fused",
                 {"norm": post.call, "attention": att.node, "add": add}, att.kind)

    for add, fails in failures.items():  # matches of registered patterns whose norm or attention we do not know
        if add not in explained and add not in fused and fails:
            note(fails[0].reason, {**fails[0].roles, "add": add}, fails[0].pattern)


def find_norms(graph: torch.fx.Graph) -> list[NormSite]:
    sites = []
    for node in graph.nodes:
        site = _norm_site(node)
        if site is not None:
            sites.append(site)
    return sites


def find_norms_after(add: torch.fx.Node) -> list[NormSite]:
    return [s for s in (_norm_site(u) for u in add.users) if s is not None]


def _norm_site(node: torch.fx.Node) -> NormSite | None:
    if node.op == "call_function" and node.target in (LAYER_NORM, RMS_NORM):
        args = read_args(node) or {}
        x, shape = args.get("input"), args.get("normalized_shape")
        if not isinstance(x, torch.fx.Node):
            return None
        problem = None
        if isinstance(shape, (list, tuple, torch.Size)) and len(shape) != 1:
            problem = (f"the norm is over the last {len(shape)} dims (normalized_shape={tuple(shape)}), "
                       f"not the last dim only")
        return NormSite(node, node, x, problem)
    if node.op == "call_function" and node.target is torch.rsqrt:
        return _rms_site(node)
    return None


def _rms_site(rsqrt: torch.fx.Node) -> NormSite | None:
    """x * rsqrt(mean(x^2, dim) + eps) [* gamma], as T5 and LLaMA write it."""
    inner = rsqrt.args[0]
    if isinstance(inner, torch.fx.Node) and inner.target is operator.add:
        inner = next((a for a in inner.args if isinstance(a, torch.fx.Node) and a.target is torch.mean), None)
    if not (isinstance(inner, torch.fx.Node) and inner.target is torch.mean):
        return None
    square = inner.args[0]
    if not isinstance(square, torch.fx.Node):
        return None
    if square.target is torch.pow and square.args[1] == 2:
        x = square.args[0]
    elif square.target is operator.mul and square.args[0] is square.args[1]:
        x = square.args[0]
    else:
        return None
    while isinstance(x, torch.fx.Node) and x.op == "call_method" and x.target == "to":
        x = x.args[0]
    dim = (read_args(inner) or {}).get("dim")
    rank = rank_of(inner.args[0])
    dims = normalize_dims(dim if isinstance(dim, (list, tuple)) else (dim,), rank)
    problem = None
    if rank is not None and tuple(dims) != (rank - 1,):
        problem = f"the norm is over dim {dim}, not the last dim only"
    out = rsqrt
    for _ in range(3):  # x * rsqrt(...), an optional cast back, * gamma
        users = list(out.users)
        if len(users) != 1 or not (users[0].target in (operator.mul,) or users[0].target == "to"):
            break
        out = users[0]
    return NormSite(rsqrt, out, x, problem)


def find_attentions(graph: torch.fx.Graph) -> list[AttentionSite]:
    sites = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is SDPA:
            a = read_args(node) or {}
            p = a.get("dropout_p", 0.0)
            sites.append(AttentionSite(node, a.get("query"), [a.get("key"), a.get("value")],
                                       a.get("is_causal") is True, _active("scaled_dot_product_attention", p, True),
                                       "sdpa", "scaled_dot_product_attention with enable_gqa=True (K/V with fewer "
                                       "heads than Q) is not supported" if a.get("enable_gqa") is True else None))
        elif node.target is MHA:
            a = read_args(node) or {}
            given = [name for name in _MHA_UNSUPPORTED if a.get(name) not in (None, False)]
            sites.append(AttentionSite(node, a.get("query"), [a.get("key"), a.get("value")],
                                       a.get("is_causal") is True,
                                       _active("nn.MultiheadAttention", a.get("dropout_p"), a.get("training")),
                                       "multihead",
                                       f"nn.MultiheadAttention with {', '.join(given)} is not supported (a "
                                       f"key_padding_mask is)" if given else None))
        elif node.target is SOFTMAX:
            sites.append(_softmax_site(node))
    return [s for s in sites if s is not None]


def _active(where, p, training) -> str | None:
    if isinstance(p, (int, float)) and p > 0 and training is not False:
        return f"dropout is active in training ({where} with p={p})"
    return None


def _softmax_site(softmax: torch.fx.Node) -> AttentionSite:
    n = softmax.args[0]
    for _ in range(8):  # back through scale, mask and casts to the scores' contraction
        if not isinstance(n, torch.fx.Node) or n.target in _CONTRACTIONS:
            break
        n = next((a for a in n.all_input_nodes if isinstance(a.meta.get("example_value"), torch.Tensor)
                  and a.meta["example_value"].dim() >= 3), None)
    if not (isinstance(n, torch.fx.Node) and n.target in _CONTRACTIONS):
        return AttentionSite(softmax, None, [], False, None, "explicit_softmax")
    operands = [a for a in n.args if isinstance(a, torch.fx.Node)]
    if n.target is torch.baddbmm:
        operands = operands[1:]
    query, keys = (operands[0], operands[1:]) if operands else (None, [])
    dropout = None
    p = softmax
    for _ in range(4):  # forward through casts and dropout to the contraction with v
        users = list(p.users)
        if len(users) != 1:
            break
        p = users[0]
        if p.target in _DROPOUTS:
            dropout = f"dropout is active in training (dropout on the attention weights, {p.name})"
        if p.target in _CONTRACTIONS:
            keys = keys + [a for a in p.all_input_nodes if a is not softmax and a is not p.args[0]]
            break
    return AttentionSite(softmax, query, keys, False, dropout, "explicit_softmax")


def _descendants(node, limit, order) -> set[torch.fx.Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen or order[n] > limit:
            continue
        seen.add(n)
        stack.extend(n.users)
    return seen


def _residual_add(att, x, order) -> torch.fx.Node | None:
    """The first add downstream of the attention that adds the block's input x back."""
    if not isinstance(x, torch.fx.Node):
        return None
    reach = _descendants(att, order[att] + _WINDOW, order)
    adds = [n for n in reach if n.target is operator.add and x in n.args
            and any(a in reach for a in n.args if a is not x)]
    return min(adds, key=order.get) if adds else None


def _query_origin(query: torch.fx.Node) -> torch.fx.Node:
    """Back through projections, head splits and scaling to the hidden states a query is computed from."""
    n = query
    for _ in range(8):
        if n.op == "call_function" and n.target in _QUERY_PATH or n.op == "call_method" and n.target == "to":
            n = n.args[0] if isinstance(n.args[0], torch.fx.Node) else n.args[1]
            if not isinstance(n, torch.fx.Node):
                break
        else:
            break
    return n


def _explain(norm: NormSite, att: AttentionSite, add, fails, order) -> tuple[str, str]:
    reasons = []
    if norm.problem:
        reasons.append(norm.problem)
    if any(depends_on(k, {norm.out}, order) for k in att.keys if isinstance(k, torch.fx.Node)):
        reasons.append("self-attention: the normed x also feeds K/V")
    if att.causal:
        reasons.append("causal attention (is_causal=True) is not cross-attention")
    path = _path(norm.out, add, order)
    dropout = att.dropout or next((f"dropout is active in training ({n.name})" for n in path
                                   if n.target in _DROPOUTS), None)
    if dropout:
        reasons.append(dropout)
    if att.unsupported:
        reasons.append(att.unsupported)
    if not reasons:
        others = [u for u in norm.out.users if u not in path]
        if others:
            reasons.append("the normed x has other users outside the block: " + ", ".join(u.name for u in others[:3]))
    if reasons:
        return "; ".join(reasons), ""
    if fails:
        return fails[0].reason, fails[0].pattern
    unknown = sorted({_op_name(n) for n in path if _unknown(n)})
    hint = f" (ops no pattern knows on its path: {', '.join(unknown)})" if unknown else ""
    return f"no built-in or registered pattern matches this block's form{hint}", ""


def _path(start, end, order) -> set[torch.fx.Node]:
    """Nodes on some path from start to end."""
    forward = _descendants(start, order[end], order)
    backward, stack = set(), [end]
    while stack:
        n = stack.pop()
        if n in backward or n not in forward:
            continue
        backward.add(n)
        stack.extend(n.all_input_nodes)
    return backward


def _unknown(node: torch.fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    return (node.op, node.target) not in SIGNATURES and node.target is not MHA


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    module = getattr(node.target, "__module__", None) or ""
    name = getattr(node.target, "__name__", str(node.target))
    return f"torch.{name}" if module.startswith("torch") else f"{module}.{name}".strip(".")
