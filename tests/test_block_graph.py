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


def test_inductor_compiles_the_block_graph_on_random_inputs_of_its_layouts(monkeypatch):
    torch.manual_seed(0)
    model, inputs, _ = t5("eager")
    graph, _ = blocks_of(model, inputs, monkeypatch)[0]
    compiled, ins, note = choose.compiler_block({}, "rms", 1e-6, 1.0, graph, torch.device("cpu"))
    assert note == ""
    for t, (_, value) in zip(ins, graph.inputs, strict=True):
        assert (t.shape, t.stride(), t.dtype) == (value.shape, value.stride(), value.dtype)
        assert t.dtype == torch.bool or t.float().std() > 0  # fresh random values, never zeros
    with torch.no_grad():
        torch.testing.assert_close(compiled(*ins), torch.fx.Interpreter(graph.gm).run(*ins), rtol=1e-4, atol=1e-4)


def test_without_the_models_nodes_the_canonical_block_is_timed_and_the_reason_given():
    torch.manual_seed(0)
    B, Lq, D, H, Lk = 2, 5, 16, 2, 7
    real = {n: None for n in ("x", "k", "v", "gamma", "beta", "wq", "bq", "wo", "bo", "mask")}
    real.update(x=torch.randn(B, Lq, D), k=torch.randn(B, H, Lk, D // H), v=torch.randn(B, H, Lk, D // H),
                gamma=torch.randn(D), wq=torch.randn(D, D), wo=torch.randn(D, D))
    for graph, note in ((None, ""), ("the block's input s0 has a dynamic shape",
                                     " (on the canonical block: the model's nodes of it could not be timed, the "
                                     "block's input s0 has a dynamic shape)")):
        compiled, ins, got = choose.compiler_block(real, "rms", 1e-6, None, graph, torch.device("cpu"))
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
