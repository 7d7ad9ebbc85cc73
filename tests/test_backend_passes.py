"""The pass pipeline: its order and dump hook, the canonicalise pass (values unchanged, fewer spellings, in-place
safety), and the rule that a block with no fused CUDA kernel/plan is left to the compiler and reported."""
from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusednorm.passes as passes
import fusednorm.passes.match as match_pass
from fusednorm.options import Options
from fusednorm.passes import PassContext
from fusednorm.report import Report
from conftest import dynamo_graph


def context():
    return PassContext(options=Options(), example_inputs=[], report=Report())


def test_pipeline_order_and_reasons():
    assert [p.name for p in passes.PIPELINE] == ["canonicalize", "match", "diagnose", "rewrite", "cleanup"]
    assert all(p.why for p in passes.PIPELINE)


def test_run_pipeline_calls_the_dump_hook_after_each_pass():
    seen = []

    class Recording(PassContext):
        def after_pass(self, index, name, gm):
            seen.append((index, name, len(gm.graph.nodes)))

    gm = dynamo_graph(lambda x: F.layer_norm(x, (8,)) + 1, torch.randn(2, 3, 8))
    passes.run_pipeline(gm, Recording(options=Options(), example_inputs=[], report=Report()))
    assert [(i, n) for i, n, _ in seen] == [(0, "input")] + [(i + 1, p.name) for i, p in enumerate(passes.PIPELINE)]


def spellings(x, y, w):
    a = x.view(2, 3, 4, 2).transpose(1, 2).contiguous()          # view, transpose, contiguous
    b = torch.reshape(y, (2, 3, 4, 2)).permute(0, 2, 1, 3)        # a permute that swaps two dims
    s = (a @ b.transpose(-1, -2)).mul(1.0) / 1                    # @, x * 1, x / 1
    p = torch.softmax(s.float(), -1, dtype=torch.float32)         # cast to the same dtype, softmax(dtype=)
    p = F.dropout(p, 0.5, training=False)                         # inert dropout
    o = torch.bmm(p.flatten(0, 1), b.flatten(0, 1).type_as(p))   # bmm, type_as the same dtype
    return F.linear(o.pow(2).mean(-1, keepdim=True).rsqrt() * o, w)


def test_canonicalize_keeps_values_and_leaves_one_spelling():
    args = (torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(5, 2))
    gm = dynamo_graph(spellings, *args)
    expected = gm(*args)
    passes.canonicalize.run(gm, context())
    gm.recompile()
    assert torch.equal(gm(*args)[0] if isinstance(expected, tuple) else gm(*args),
                       expected[0] if isinstance(expected, tuple) else expected)
    calls = [(n.op, n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    methods = {t for op, t in calls if op == "call_method"}
    functions = {t for op, t in calls if op == "call_function"}
    assert not methods & {"view", "transpose", "contiguous", "permute", "float", "type_as", "matmul", "mul", "pow",
                          "mean", "rsqrt", "softmax"}
    assert not functions & {torch.bmm, F.dropout, torch.softmax}
    assert {torch.reshape, torch.transpose, torch.matmul, F.softmax, torch.pow, torch.mean, torch.rsqrt} <= functions
    import operator
    assert not any(n.target in (operator.mul, operator.truediv) and 1 in n.args for n in gm.graph.nodes)


def test_canonicalize_keeps_an_identity_op_that_guards_an_in_place_update():
    def update(x):
        y = x.contiguous()   # a copy, because x is a transposed view: dropping it would let add_ reach x
        y.add_(1)
        return x * 2 + y

    x = torch.randn(4, 3).t()
    gm = dynamo_graph(update, x.clone())
    expected = update(x.clone())
    passes.canonicalize.run(gm, context())
    gm.recompile()
    assert torch.equal(gm(x.clone())[0], expected)


def test_canonicalize_keeps_a_contiguous_before_a_convolution():
    """Only users known to read values whatever the strides let a contiguous() go: a convolution (its lowering and
    speed depend on the layout; with dynamic shapes Inductor failed to lower a permuted input) keeps it."""
    def conv_after_permute(x, w):
        h = x.permute(0, 3, 1, 2).contiguous()                      # kept: a convolution reads it
        y = F.conv2d(h, w)
        return F.linear(y.permute(0, 2, 3, 1).contiguous(), w.flatten(1).t()[:4])  # dropped: linear takes any strides

    x, w = torch.randn(2, 5, 5, 4), torch.randn(4, 4, 1, 1)
    gm = dynamo_graph(conv_after_permute, x, w)
    expected = conv_after_permute(x, w)
    passes.canonicalize.run(gm, context())
    gm.recompile()
    # linear now reads y through its permuted strides: the BLAS may sum in another order, so close, not equal
    torch.testing.assert_close(gm(x, w)[0], expected)
    kept = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "contiguous"]
    assert len(kept) == 1 and [u.target for u in kept[0].users] == [torch.conv2d]


def test_bitwise_and_or_are_not_in_place_updates():
    """a & b and a | b reach the graph as operator.and_ / or_ (a trailing underscore, no mutation): the identity
    ops near them are dropped as usual, while a real &= still guards its tensor."""
    def masks(x, m, n):
        a = x.transpose(0, 1).contiguous()  # x first: Dynamo orders the graph's inputs by first use
        keep = (m & n) | m
        return torch.matmul(a, x) * keep.sum()

    args = (torch.randn(4, 3), torch.rand(5) > 0.5, torch.rand(5) > 0.5)
    gm = dynamo_graph(masks, *args)
    expected = masks(*args)
    passes.canonicalize.run(gm, context())
    gm.recompile()
    assert torch.equal(gm(*args)[0], expected)
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "contiguous"]

    def guarded(x, m, n):
        m &= n                               # an in-place update on the graph
        return x * m.sum()

    assert canonical_is_inplace(dynamo_graph(guarded, *(t.clone() for t in args)), "iand")


def canonical_is_inplace(gm, name):
    from fusednorm.patterns.canonical import _is_inplace

    return any(_is_inplace(n) for n in gm.graph.nodes if getattr(n.target, "__name__", "") == name)


def test_canonicalize_keeps_a_contiguous_whose_layout_is_relied_on():
    """Dropped where values are all that matter (matmul, or a .view() that becomes a reshape), kept where the
    strides matter: a graph output, whose caller may .view() it."""
    def layouts(x):
        inner = torch.matmul(x.transpose(0, 1).contiguous(), x)      # droppable: matmul takes any strides
        flat = x.t().contiguous().view(-1)                            # droppable: the view becomes a reshape
        return x.transpose(0, 1).contiguous(), inner, flat            # the caller gets a contiguous tensor

    x = torch.randn(4, 3)
    gm = dynamo_graph(layouts, x)
    passes.canonicalize.run(gm, context())
    gm.recompile()
    out, inner, flat = gm(x)
    assert out.is_contiguous() and torch.equal(out, x.t()) and torch.equal(flat, x.t().reshape(-1))
    assert torch.equal(inner, x.t() @ x)
    kept = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "contiguous"]
    assert len(kept) == 1 and any(u.op == "output" for u in kept[0].users)


def test_what_runs_on_cuda(monkeypatch):
    import fusednorm.dispatch as dispatch

    args = {n: None for n in ("k", "v", "gamma", "beta", "wq", "bq", "wo", "bo", "mask")}
    args["x"] = types.SimpleNamespace(device=torch.device("cuda"))
    monkeypatch.setattr(dispatch, "why_not_fast", lambda *a: "head dim 7 is not supported")
    assert match_pass._what_runs(args, "layer") == (
        "left to the compiler", "no fused CUDA kernel/plan for this block: head dim 7 is not supported")

    def no_codegen(*a):
        raise ImportError("No module named 'fusednorm.codegen'")

    monkeypatch.setattr(dispatch, "why_not_fast", no_codegen)
    runs, reason = match_pass._what_runs(args, "layer")
    assert "fusednorm.codegen is not available" in reason
    monkeypatch.setattr(dispatch, "why_not_fast", lambda *a: None)
    assert match_pass._what_runs(args, "layer", "never", "always") == ("generated CUDA kernel", None)
    assert match_pass._what_runs({**args, "wq": object()}, "layer", "always") == (
        "CUDA projection plan: the plan (option plan='always')", None)
    assert match_pass._what_runs({**args, "wq": object()}, "layer", "never") == (
        "left to the compiler", "left to the compiler (option plan='never', the default without option cudagraphs)")
    from fusednorm.plans import choose

    def decide(a, norm, policy, host_time_counts, block=None):
        nodes = f", on {block()}" if block is not None else ""
        return choose.Choice(policy == "measure" and a["k"] == 1, f"measured {a['k']}, host {host_time_counts}{nodes}")

    monkeypatch.setattr(choose, "decide", decide)
    assert match_pass._what_runs({**args, "k": 1}, "layer", "never", "measure") == (
        "generated CUDA kernel: measured 1, host True", None)
    assert match_pass._what_runs({**args, "k": 1, "wq": object()}, "layer", "measure", cudagraphs=True) == (
        "CUDA projection plan: measured 1, host False", None)  # replayed as CUDA graphs: host time does not count
    assert match_pass._what_runs({**args, "k": 2}, "layer", "never", "measure") == (
        "left to the compiler", "measured 2, host True")
    assert match_pass._what_runs({**args, "k": 1}, "layer", "never", "measure", block=lambda: "its nodes") == (
        "generated CUDA kernel: measured 1, host True, on its nodes", None)  # the match's block reaches the choice
    on_cpu = {**args, "x": types.SimpleNamespace(device=torch.device("cpu"))}
    assert match_pass._what_runs(on_cpu, "layer") == ("reference, compiled inline by Inductor", None)
    assert match_pass._what_runs(on_cpu, "layer", compiler="eager") == ("reference", None)
    assert match_pass._what_runs(on_cpu, "layer", check_numerics=True) == ("reference", None)  # the op's own check


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.k, self.v = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, c):
        split = lambda t: t.view(t.shape[0], -1, 2, 8).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(self.norm(x)), split(self.k(c)), split(self.v(c)))
        return x + a.transpose(1, 2).reshape(x.shape)


def test_a_block_without_a_fast_path_is_left_to_the_compiler(fusion, monkeypatch):
    monkeypatch.setattr(match_pass, "_what_runs", lambda args, norm, plan, kernel, cudagraphs, compiler, check, block: (
        "left to the compiler", "no fused CUDA kernel/plan for this block: no kernel for d=8"))
    model = Block().eval()
    x, c = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.equal(fusion.compile(model)(x, c), model(x, c))
    assert fusion.fused == 0
    assert fusion.reasons() == "no fused CUDA kernel/plan for this block: no kernel for d=8"


def test_projection_free_block_is_fused(fusion):
    model = Block().eval()
    fusion.run(model, torch.randn(2, 3, 16), torch.randn(2, 5, 16))
    assert fusion.fused == 1
    assert fusion.matches[0].summary["projections"] == []
