"""The matched block's own nodes as a graph of their own (passes/block_graph.py), on which the measured choice
times the compiler: in real models' graphs it computes exactly what those nodes computed in the model, Inductor
compiles it, and where it cannot be had the canonical block stands in, with the reason."""
from __future__ import annotations

import pytest
import torch
import torch.fx

from fusednorm.backend import fusednorm_backend
from fusednorm.passes import match
from fusednorm.passes.block_graph import BlockGraph
from fusednorm.passes.rewrite import FUSED_OP
from fusednorm.plans import choose

transformers = pytest.importorskip("transformers")
from test_models_hf import t5, whisper  # noqa: E402


class Recorder(torch.fx.Interpreter):
    """Runs a graph and keeps every node's value by name."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        self.values[n.name] = out = super().run_node(n)
        return out


def blocks_of(model, inputs, monkeypatch):
    """Compile on the CPU with the backend; per block the match checks: its BlockGraph (or why none) and the values
    the model's graph took, node by node."""
    seen, current = [], {}
    real = match._what_runs

    def what_runs(*args, block=None, **kwargs):
        seen.append((block(), current["values"]))
        return real(*args, block=block, **kwargs)

    def backend(gm, example_inputs):
        recorder = Recorder(gm)
        recorder.run(*example_inputs)
        current["values"] = recorder.values
        return fusednorm_backend(gm, example_inputs)

    monkeypatch.setattr(match, "_what_runs", what_runs)
    with torch.no_grad():
        torch.compile(model, backend=backend)(**inputs)
    return seen


@pytest.mark.parametrize("build", [t5, whisper], ids=["t5", "whisper"])
def test_the_block_graph_computes_what_the_models_nodes_did(build, monkeypatch):
    torch.manual_seed(0)
    model, inputs, layers = build("eager")
    seen = blocks_of(model, inputs, monkeypatch)
    assert len(seen) == layers
    for graph, values in seen:
        assert isinstance(graph, BlockGraph), graph
        out = torch.fx.Interpreter(graph.gm).run(*(values[name] for name in graph.sources))
        assert torch.equal(out, values[graph.output])
        assert {role for role, _ in graph.inputs} >= {"x", "wq", "wo"}  # the op's arguments keep their names
    if build is t5:  # T5's attention as it wrote it: matmul, softmax in float32, matmul (no SDPA)
        targets = [target for _, target in seen[0][0].signature]
        assert "softmax" in " ".join(targets) and "scaled_dot_product_attention" not in " ".join(targets)


def no_op_arguments():
    raise AssertionError("the op's random arguments were made for a block timed on its own nodes")


def test_inductor_compiles_the_block_graph_on_random_inputs_of_its_layouts(monkeypatch):
    torch.manual_seed(0)
    model, inputs, _ = t5("eager")
    graph, _ = blocks_of(model, inputs, monkeypatch)[0]
    compiled, ins, note = choose.compiler_block(no_op_arguments, "rms", 1e-6, 1.0, graph, torch.device("cpu"))
    assert note == ""
    for t, (_, value) in zip(ins, graph.inputs, strict=True):
        assert (t.shape, t.stride(), t.dtype) == (value.shape, value.stride(), value.dtype)
        assert t.dtype == torch.bool or t.float().std() > 0  # fresh random values, never zeros
    with torch.no_grad():
        torch.testing.assert_close(compiled(*ins), torch.fx.Interpreter(graph.gm).run(*ins), rtol=1e-4, atol=1e-4)


def torch_decoder(_compiler=None):
    """nn.TransformerDecoder(norm_first=True): its cross-attention block is one multi_head_attention_forward node,
    which also projects K and V from the memory."""
    layer = torch.nn.TransformerDecoderLayer(64, 4, 128, dropout=0.0, batch_first=True, norm_first=True)
    model = torch.nn.TransformerDecoder(layer, num_layers=2).eval()
    return model, dict(tgt=torch.randn(2, 16, 64), memory=torch.randn(2, 7, 64)), 2


def fused_calls(gm):
    return [n for n in gm.graph.nodes if n.target is FUSED_OP]


@pytest.mark.parametrize("build", [t5, whisper, torch_decoder], ids=["t5", "whisper", "torch"])
def test_the_replacement_computes_what_the_block_did(build, monkeypatch):
    """The measured choice times the block's nodes against what the rewrite puts in their place: one fused call and
    the nodes making its arguments (for nn.MultiheadAttention the K and V projections), over the same inputs."""
    torch.manual_seed(0)
    model, inputs, layers = build("eager")
    seen = blocks_of(model, inputs, monkeypatch)
    assert len(seen) == layers
    for graph, _ in seen:
        assert len(fused_calls(graph.replacement)) == 1 and not fused_calls(graph.gm)
        _, ins, note = choose.compiler_block(no_op_arguments, "layer", 1e-5, None, graph, torch.device("cpu"))
        assert note == ""
        with torch.no_grad():
            want = torch.fx.Interpreter(graph.gm).run(*ins)
            got = choose._inductor(graph.replacement, ins)(*ins)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if build is torch_decoder:
        targets = [str(n.target) for n in seen[0][0].replacement.graph.nodes]
        assert sum("linear" in t for t in targets) == 2  # K and V, projected beside the op as the rewrite emits them
        assert any("multi_head_attention_forward" in str(n.target) for n in seen[0][0].gm.graph.nodes)


def test_a_replacement_that_cannot_be_emitted_leaves_the_block_graph_and_says_why(monkeypatch):
    """The compiler is still timed on the block's own nodes; the fused side falls back to the op alone, and the
    reason reaches the report (choose._time_both notes it)."""
    from fusednorm.passes import block_graph

    def broken(*args):
        raise RuntimeError("no fakes here")

    monkeypatch.setattr(block_graph, "emit_fused", broken)
    torch.manual_seed(0)
    model, inputs, layers = torch_decoder()
    seen = blocks_of(model, inputs, monkeypatch)
    assert len(seen) == layers
    for graph, _ in seen:
        assert isinstance(graph, BlockGraph) and len(list(graph.gm.graph.nodes)) > 2
        assert graph.replacement == "emitting it raised RuntimeError: no fakes here"


def test_the_compilers_block_has_the_models_matmuls(monkeypatch):
    """Inductor gets the block traced as the model's graph is: the random inputs require grad where the model's do,
    and the trace runs in grad mode, so nn.MultiheadAttention's projections of its transposed inputs fold into mm
    (the bmm against a weight expanded per row that a no_grad trace gives ran 6x slower on an H100)."""
    torch.manual_seed(0)
    model, inputs, _ = torch_decoder()
    graph, _ = blocks_of(model, inputs, monkeypatch)[0]
    traced = []
    monkeypatch.setattr(torch._inductor, "compile", lambda gm, ins: traced.append(gm) or gm)
    with torch.no_grad():
        _, ins, _ = choose.compiler_block(no_op_arguments, "layer", 1e-5, None, graph, torch.device("cpu"))
    assert [t.requires_grad for t in ins] == [value.requires_grad for _, value in graph.inputs]
    assert any(t.requires_grad for t in ins) and not all(t.requires_grad for t in ins)
    ops = [n.target for n in traced[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.bmm.default not in ops
    assert ops.count(torch.ops.aten.mm.default) + ops.count(torch.ops.aten.addmm.default) == 3  # Q, K/V, out


def test_without_the_models_nodes_the_canonical_block_is_timed_and_the_reason_given():
    torch.manual_seed(0)
    B, Lq, D, H, Lk = 2, 5, 16, 2, 7
    real = {n: None for n in ("x", "k", "v", "gamma", "beta", "wq", "bq", "wo", "bo", "mask")}
    real.update(x=torch.randn(B, Lq, D), k=torch.randn(B, H, Lk, D // H), v=torch.randn(B, H, Lk, D // H),
                gamma=torch.randn(D), wq=torch.randn(D, D), wo=torch.randn(D, D))
    for graph, note in ((None, ""), ("the block's input s0 has a dynamic shape",
                                     " (on the canonical block: the model's nodes of it could not be timed, the "
                                     "block's input s0 has a dynamic shape)")):
        compiled, ins, got = choose.compiler_block(lambda: real, "rms", 1e-6, None, graph, torch.device("cpu"))
        assert got == note
        expected = choose.unfused_block(**real, norm="rms", eps=1e-6, scale=None)
        torch.testing.assert_close(compiled(*ins), expected, rtol=1e-4, atol=1e-4)


def test_a_block_with_a_dynamic_input_has_no_graph():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = object()
    y = graph.call_function(torch.add, (x, x))
    graph.output(y)
    torch.fx.GraphModule(torch.nn.Module(), graph)
    why = match.block_graph({y}, y, {})
    assert why == "the block's input x is not a tensor (object)"
