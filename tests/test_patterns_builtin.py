"""Every generated built-in pattern computes exactly the fused op under its binding (checked on random inputs), and
each family is generated only when a graph could hold it."""
from __future__ import annotations

import operator

import pytest
import torch

import torch.nn.functional as F

from fusednorm.patterns.canonical import canonicalize_graph
from fusednorm.patterns.ops import HALF_PRECISION, graph_facts
from fusednorm.patterns.registry import builtin_families, patterns_for

FAMILIES = builtin_families()


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_every_builtin_pattern_computes_the_op(family):
    torch.manual_seed(0)
    patterns = family.patterns()
    assert patterns
    for pattern in patterns:
        # float64 makes a wrong binding stand out; patterns that cast to float32 are checked in float32
        upcast = any(n.op == "call_method" and n.target == "to" and torch.float32 in n.args
                     for n in pattern.graph.nodes)
        err = pattern.verify(pattern._example_inputs(torch.float32 if upcast else torch.float64))
        assert err <= (1e-4 if upcast else 1e-12), pattern.name


def test_families_are_generated_only_for_graphs_that_could_hold_them():
    def block(x, c, w):
        h = F.linear(F.layer_norm(x, (8,)), w).view(2, 3, 2, 4).transpose(1, 2)
        kv = c.view(2, 5, 2, 4).transpose(1, 2)
        return x + F.linear(F.scaled_dot_product_attention(h, kv, kv).transpose(1, 2).reshape(2, 3, 8), w)

    graphs = []
    torch.compile(block, backend=lambda gm, ex: graphs.append(gm) or gm.forward)(
        torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(8, 8))
    canonicalize_graph(graphs[0].graph, use_meta=True)
    facts = graph_facts(graphs[0].graph)
    names = {p.name for p in patterns_for(facts)}
    assert "layer_norm/q_linear/sdpa/out_linear" in names
    assert not any("rms" in n or "matmul" in n or "multihead" in n for n in names)
    with_half = {p.name for p in patterns_for(facts | {HALF_PRECISION, ("call_function", torch.rsqrt),
                                                       ("call_method", "to"), ("call_function", torch.pow),
                                                       ("call_function", torch.mean), ("call_function", operator.mul)})}
    assert any("rms_by_hand_variance_upcast" in n for n in with_half)
