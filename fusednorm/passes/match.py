"""match: find every pattern's matches at every residual add, check them, and choose non-overlapping ones.

Each structural match is then checked in turn: it must own its intermediates; its shapes must be the pattern's;
its values must bind to valid op arguments; the pattern's own check must accept it; and on CUDA a generated
kernel or plan must exist for it. The first check that fails is remembered, per residual add, for the diagnose pass.
Among the surviving candidates, higher priority wins, then the larger match; overlapping ones are dropped.
"""
from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from ..options import Options
from ..patterns.binding import OP_ARGS, BindingError, Derived, check_op_args, resolve
from ..patterns.hints import HintSpace
from ..patterns.matcher import StructuralMatch, check_shapes, foreign_users, match_at
from ..patterns.ops import graph_facts
from ..patterns.registry import MatchView, Pattern, patterns_for
from ..report import MatchRecord
from .block_graph import block_graph
from .context import PassContext
from .locations import locations, source_location


@dataclass
class Candidate:
    pattern: Pattern
    anchor: torch.fx.Node
    values: dict[str, Any]                # search parameter -> graph node or literal
    owned: set[torch.fx.Node]             # the graph nodes the fused op replaces
    roles: dict[str, torch.fx.Node]       # norm / attention / add -> graph node
    args: dict[str, Any]                  # the op's arguments on static stand-ins
    runs: str


@dataclass
class Failure:
    """Why a structural match was not fused. ``stage`` says how far it got (ownership 1, shapes 2, binding 3,
    check 4, CUDA 5, overlap 6): the failure that got furthest explains the block best."""
    pattern: str
    reason: str
    roles: dict[str, torch.fx.Node] = field(default_factory=dict)
    stage: int = 0


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    space = HintSpace()
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchors = [n for n in graph.nodes if _is_residual_add(n)]
    patterns = patterns_for(graph_facts(graph)) if anchors else []
    depth = max((p.depth for p in patterns), default=0)
    candidates: list[Candidate] = []
    failures: dict[torch.fx.Node, list[Failure]] = defaultdict(list)
    for anchor in anchors:
        near = _ops_within(anchor, depth)
        for pattern in patterns:
            if not pattern.targets <= near:  # an op the pattern needs is not within its reach of this add
                continue
            result = attempt(pattern, anchor, space, order, ctx.options)
            if isinstance(result, Candidate):
                candidates.append(result)
            elif isinstance(result, Failure):
                failures[anchor].append(result)
    ctx.matches = choose(candidates, graph)
    chosen = {c.anchor for c in ctx.matches}
    for c in candidates:
        if c.anchor not in chosen:
            winner = next(m for m in ctx.matches if m.owned & c.owned)
            failures[c.anchor].append(Failure(c.pattern.name, f"it overlaps the block fused by pattern "
                                              f"{winner.pattern.name!r}", c.roles, 6))
    ctx.failures = {a: sorted(f, key=lambda f: -f.stage) for a, f in failures.items() if a not in chosen}
    for c in ctx.matches:
        ctx.report.matches.append(MatchRecord(pattern=c.pattern.name, locations=locations(c.roles),
                                              summary=summarize(c), runs=c.runs, graph=ctx.graph_id))
    return gm


def _ops_within(anchor: torch.fx.Node, depth: int) -> set:
    """The (op, target) pairs of nodes at most ``depth`` edges upstream of the anchor."""
    found, frontier, seen = set(), [anchor], {anchor}
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n.op in ("call_function", "call_method"):
                found.add((n.op, n.target))
            for a in n.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    nxt.append(a)
        frontier = nxt
    for n in frontier:
        if n.op in ("call_function", "call_method"):
            found.add((n.op, n.target))
    return found


def _is_residual_add(node: torch.fx.Node) -> bool:
    ev = node.meta.get("example_value")
    return (node.op == "call_function" and node.target is operator.add and isinstance(ev, torch.Tensor)
            and ev.dim() == 3 and ev.dtype.is_floating_point)


def attempt(pattern: Pattern, anchor: torch.fx.Node, space: HintSpace,
            order: dict[torch.fx.Node, int], options: Options | None = None) -> Candidate | Failure | None:
    """A checked candidate, the first reason the pattern's structural match failed, or None (no structure).

    ``order`` is each graph node's position (ancestor searches stop at the earliest node that matters); of the
    backend's ``options``, grad decides whether a block needing a gradient is fused, and plan, kernel and
    cudagraphs whether a block on CUDA is (plans/choose.py).
    """
    first_failure = None
    try:
        for sm in match_at(pattern.graph, pattern.meta_exprs, anchor):
            result = _check(pattern, sm, space, order, options or Options())
            if isinstance(result, Candidate):
                return result
            first_failure = first_failure or result
    except Exception as e:  # a pattern must never break the compile: say what happened instead
        return Failure(pattern.name, f"matching raised {type(e).__name__}: {e}")
    return first_failure


NEEDS_GRAD = ("left to the compiler: the block's output needs a gradient (grad enabled, an input requires grad) and "
              "the fused op's backward recomputes the block unfused in float32, slower than the compiler's; run "
              "inference under torch.no_grad() or torch.inference_mode(), or options={'grad': 'fuse'} to fuse it "
              "anyway")


def _check(pattern: Pattern, sm: StructuralMatch, space: HintSpace, order, options: Options) -> Candidate | Failure:
    roles = {role: sm.nodes.get(node) for role, node in pattern.roles.items()}
    inside = _inputs_from_inside(pattern, sm, order)
    if inside:
        return Failure(pattern.name, inside, roles, 1)
    foreign = foreign_users(sm)
    if foreign:
        return Failure(pattern.name, _ownership_reason(pattern, sm, foreign, roles, order), roles, 1)
    reason = check_shapes(pattern.graph, sm, space)
    if reason:
        return Failure(pattern.name, f"the shapes do not fit the pattern: {reason}", roles, 2)
    try:
        hinted = {p: space.of(v) for p, v in sm.values.items()}
        args = resolve(pattern.bind, hinted)
        check_op_args(args, pattern.norm)
        _check_output(pattern, args, sm.anchor, space)
    except BindingError as e:
        return Failure(pattern.name, str(e), roles, 3)
    if pattern.check is not None:
        try:
            verdict = pattern.check(MatchView(pattern.name, hinted, dict(sm.values), roles))
        except Exception as e:
            verdict = f"the pattern's check raised {type(e).__name__}: {e}"
        if verdict is not True:
            return Failure(pattern.name, verdict if isinstance(verdict, str) and verdict
                           else "the pattern's check refused the match", roles, 4)
    if options.grad == "compiler" and _needs_grad(sm.anchor):
        return Failure(pattern.name, NEEDS_GRAD, roles, 5)
    named = {sm.values[p]: a for a, p in pattern.bind.items() if isinstance(p, str) and isinstance(sm.values.get(p),
                                                                                               torch.fx.Node)}
    runs, no_kernel = _what_runs(args, pattern.norm, options.plan, options.kernel, options.cudagraphs,
                                 options.compiler, options.check_numerics,
                                 block=lambda: block_graph(sm.owned, sm.anchor, named, (pattern, sm.values, options)))
    if no_kernel:
        return Failure(pattern.name, no_kernel, roles, 5)
    return Candidate(pattern, sm.anchor, dict(sm.values), sm.owned, roles, args, runs)


def _needs_grad(node: torch.fx.Node) -> bool:
    """Whether the block's output needs a gradient, as Dynamo traced it (grad mode and inputs included)."""
    ev = node.meta.get("example_value")
    return isinstance(ev, torch.Tensor) and ev.requires_grad


def _check_output(pattern: Pattern, args, anchor, space: HintSpace) -> None:
    """The op returns x's shape and dtype (then the pattern's output adapter): the add must have produced the same."""
    with space.mode:
        y = torch.empty_like(args["x"])
        if pattern.bind.get("output") is not None:
            y = pattern.bind["output"](y)
    expected = space.of(anchor)
    if tuple(y.shape) != tuple(expected.shape) or y.dtype != expected.dtype:
        raise BindingError(f"the block returns {tuple(expected.shape)} {expected.dtype} but the op would return "
                           f"{tuple(y.shape)} {y.dtype} (its result has x's shape and dtype)")


def _what_runs(args, norm, plan: str = "never", kernel: str = "auto", cudagraphs: bool = False,
               compiler: str = "inductor", check_numerics: bool = False, block=None) -> tuple[str, str | None]:
    """('reference' | 'generated CUDA kernel' | 'CUDA projection plan ...', why it is left to the compiler or None);
    ``block`` gives the matched nodes as a graph of their own, to time the compiler on (plans/choose.py)."""
    x = args["x"]
    if x.device.type != "cuda":
        from ..op import inlined_for_inductor

        inline = compiler == "inductor" and inlined_for_inductor(x.device.type, check_numerics)  # backend's table
        return ("reference, compiled inline by Inductor" if inline else "reference"), None
    try:
        from ..dispatch import why_not_fast

        reason = why_not_fast(args["x"], args["k"], args["v"], args["gamma"], args["beta"], args["wq"], args["bq"],
                              args["wo"], args["bo"], args["mask"], norm)
    except ImportError as e:
        reason = f"fusednorm.codegen is not available ({e})"
    except Exception as e:  # a broken kernel check must not fuse a block it cannot vouch for
        reason = f"the kernel check failed ({type(e).__name__}: {e})"
    if reason:
        return "left to the compiler", f"no fused CUDA kernel/plan for this block: {reason}"
    projection_free = args["wq"] is None and args["wo"] is None
    if projection_free and kernel == "always":
        return "generated CUDA kernel", None
    from ..plans.choose import decide

    choice = decide(args, norm, kernel if projection_free else plan, host_time_counts=not cudagraphs, block=block)
    if not choice.fused:
        return "left to the compiler", choice.reason
    if projection_free:
        return f"generated CUDA kernel: {choice.reason}", None
    return f"CUDA projection plan: {choice.reason}", None


def _kv_params(pattern: Pattern) -> set[str]:
    params = set()
    for arg in ("k", "v"):
        b = pattern.bind.get(arg)
        params |= {b} if isinstance(b, str) else set(b.params) if isinstance(b, Derived) else set()
    return params


def _inputs_from_inside(pattern: Pattern, sm: StructuralMatch, order) -> str | None:
    """A block's inputs must come from outside it: K/V computed from the normed x is self-attention."""
    kv = _kv_params(pattern)
    owned = sm.owned - {sm.anchor}
    for param, value in sm.values.items():
        if isinstance(value, torch.fx.Node) and (value in owned or depends_on(value, owned, order)):
            if param in kv:
                return "self-attention: the normed x also feeds K/V"
            return f"the block's input {param!r} ({value.name}) is computed inside the block"
    return None


def _ownership_reason(pattern, sm, foreign, roles, order) -> str:
    kv_nodes = [sm.values[p] for p in _kv_params(pattern) if isinstance(sm.values.get(p), torch.fx.Node)]
    if any(depends_on(n, sm.owned, order) for n in kv_nodes):
        return "self-attention: the normed x also feeds K/V"
    attention = roles.get("attention")
    node, users = next(iter(sorted(foreign.items(), key=lambda kv: order.get(kv[0], 0))))
    where = ", ".join(f"{u.name} ({source_location(u)})" if source_location(u) else u.name for u in users[:3])
    if attention is not None and order.get(node, 0) < order.get(attention, 0):
        return f"the normed x has other users outside the block: {where}"
    return f"an intermediate of the block ({node.name}) has other users outside it: {where}"


def depends_on(node: torch.fx.Node, targets: set[torch.fx.Node], order) -> bool:
    """Is some node of ``targets`` an ancestor of ``node``? (searches only nodes after the earliest target)"""
    if not targets:
        return False
    lowest = min(order[t] for t in targets)
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if n in seen or order[n] < lowest:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def choose(candidates: list[Candidate], graph: torch.fx.Graph) -> list[Candidate]:
    """Higher priority first, then larger matches, user patterns before built-ins; no node fused twice."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    ranked = sorted(candidates, key=lambda c: (-c.pattern.priority, -len(c.owned), c.pattern.builtin,
                                               order[c.anchor]))
    taken: set[torch.fx.Node] = set()
    chosen = []
    for c in ranked:
        if c.owned & taken:
            continue
        chosen.append(c)
        taken |= c.owned
    return sorted(chosen, key=lambda c: order[c.anchor])


def summarize(c: Candidate) -> dict[str, Any]:
    """The fused op's arguments in brief (sizes as this compile saw them; 'dynamic' when any is symbolic)."""
    a = c.args
    x, k, mask = a["x"], a["k"], a["mask"]
    ev = c.anchor.meta.get("example_value")
    scale = a["scale"]
    return {
        "x": list(x.shape), "k": list(k.shape), "v": list(a["v"].shape),
        "dtype": str(x.dtype).replace("torch.", ""), "device": x.device.type,
        "norm": c.pattern.norm, "gamma": a["gamma"] is not None, "beta": a["beta"] is not None,
        "projections": [n for n in ("wq", "bq", "wo", "bo") if a[n] is not None],
        "mask": "none" if mask is None else ("bool" if mask.dtype == torch.bool else "additive"),
        "mask_shape": None if mask is None else list(mask.shape),
        "heads": k.shape[1], "head_dim": k.shape[3],
        "scale": "default (head_dim^-0.5)" if scale is None else float(scale), "eps": float(a["eps"]),
        "dynamic": isinstance(ev, torch.Tensor) and any(not isinstance(s, int) for s in ev.shape),
    }


__all__ = ["run", "attempt", "choose", "Candidate", "Failure", "OP_ARGS"]
