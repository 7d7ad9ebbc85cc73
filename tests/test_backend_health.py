"""The compile stays healthy with fusednorm: fullgraph, no needless recompiles, symbolic shapes, dynamic=True,
gradients, a failing pass falls back with one warning, options, and the backend resolving by name alone."""
from __future__ import annotations

import subprocess
import sys
import uuid
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusednorm
import fusednorm.passes as passes
from fusednorm.backend import fusednorm_backend
from conftest import FUSED_OP, dynamo_graph, rel_err

D, H, CTX = 32, 4, 24


class CrossBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.o = nn.Linear(D, D), nn.Linear(D, D)
        self.k, self.v = nn.Linear(CTX, D), nn.Linear(CTX, D)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.2 * torch.randn_like(p))

    def forward(self, x, context):
        b, lq, _ = x.shape

        def split(t):
            return t.view(b, -1, H, D // H).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(self.q(self.norm(x))), split(self.k(context)),
                                           split(self.v(context)))
        return x + self.o(a.transpose(1, 2).reshape(b, lq, D))


def inputs(b=2, lq=5, lk=7):
    return torch.randn(b, lq, D), torch.randn(b, lk, CTX)


class CountingBackend:
    """Counts compiles (Dynamo calls the backend once per graph it compiles) and keeps the rewritten graphs."""

    def __init__(self, **options):
        self.options = {"compiler": "eager", **options}
        self.graphs = []

    def __call__(self, gm, example_inputs):
        compiled = fusednorm_backend(gm, example_inputs, options=self.options)
        self.graphs.append(compiled.__self__ if self.options["compiler"] == "eager" else None)
        return compiled

    def fused(self, i):
        return sum(1 for n in self.graphs[i].graph.nodes if n.target is FUSED_OP)


def test_fullgraph_under_inductor_still_compiles(fusion):
    model = CrossBlock().eval()
    x, context = inputs()
    with torch.no_grad():
        expected = model(x, context)
        torch.compile(model, backend="inductor", fullgraph=True)(x, context)  # the premise: Inductor takes it whole
        actual = torch.compile(model, backend="fusednorm", fullgraph=True)(x, context)
    assert fusion.fused == 1
    assert rel_err(actual, expected) <= 1e-4


def test_same_shapes_do_not_recompile():
    model, backend = CrossBlock().eval(), CountingBackend()
    compiled = torch.compile(model, backend=backend)
    for _ in range(3):
        x, context = inputs()
        assert rel_err(compiled(x, context), model(x, context)) <= 1e-4
    assert len(backend.graphs) == 1


def test_new_sizes_recompile_at_most_once_and_stay_fused():
    model, backend = CrossBlock().eval(), CountingBackend()
    compiled = torch.compile(model, backend=backend)
    for b, lq, lk in [(2, 5, 7), (3, 6, 9), (4, 8, 11), (5, 3, 2)]:
        x, context = inputs(b, lq, lk)
        with torch.no_grad():
            assert rel_err(compiled(x, context), model(x, context)) <= 1e-4
    assert len(backend.graphs) <= 2  # the first sizes, then one automatic-dynamic graph
    assert all(backend.fused(i) == 1 for i in range(len(backend.graphs)))
    symbolic = backend.graphs[-1]
    fused = next(n for n in symbolic.graph.nodes if n.target is FUSED_OP)
    assert any(isinstance(s, torch.SymInt) for s in fused.meta["example_value"].shape)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_dynamic_true(fusion, compiler):
    model = CrossBlock().eval()
    compiled = fusion.compile(model, compiler=compiler, dynamic=True)
    for b, lq, lk in [(2, 5, 7), (3, 4, 6)]:
        x, context = inputs(b, lq, lk)
        with torch.no_grad():
            assert rel_err(compiled(x, context), model(x, context)) <= 1e-4
    assert fusion.fused >= 1 and fusion.fused == len(fusion.graphs)
    assert all(m.summary["dynamic"] for m in fusion.matches)


def test_a_compile_dynamo_restarts_is_reported_once():
    """With dynamic=True Dynamo restarts its analysis of this decoder (after specialising its float attributes) and
    calls the backend again for the same frame: the report keeps the attempt that was kept, not both."""
    from fusednorm.report import Report

    layer = nn.TransformerDecoderLayer(D, H, 2 * D, dropout=0.0, batch_first=True, norm_first=True)
    decoder = nn.TransformerDecoder(layer, 3).eval()
    calls, report = [], Report()

    def counting(gm, example_inputs):
        calls.append(gm)
        return fusednorm_backend(gm, example_inputs, options={"report": report})

    x, memory = torch.randn(2, 5, D), torch.randn(2, 7, D)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(decoder, backend=counting, dynamic=True)(x, memory),
                                   decoder(x, memory), rtol=1e-4, atol=1e-5)
    assert len(report.matches) == 3 and len({m.graph for m in report.matches}) == 1  # torch 2.13: 2 calls
    assert len([n for n in report.near_misses if "self-attention" in n.reason]) == 3

    # the same, whatever this torch's Dynamo does: two attempts of one frame, then another frame
    from torch._guards import CompileContext, CompileId, compile_context

    report, example = Report(), list(inputs())
    with torch.no_grad():
        gm = dynamo_graph(CrossBlock().eval(), *example)
        for frame, attempt in ((0, 0), (0, 1), (1, 0)):
            with compile_context(CompileContext(CompileId(frame_id=frame, frame_compile_id=0))) as ctx:
                ctx.attempt = attempt
                fusednorm_backend(gm, example, options={"report": report, "compiler": "eager"})
    assert len(report.matches) == 2 and len({m.graph for m in report.matches}) == 2  # frame 0's retry, frame 1


def test_a_failing_pass_falls_back_with_one_warning(fusion, monkeypatch):
    message = f"pass broke {uuid.uuid4()}"  # unique: the warning is said once per process

    def broken(gm, ctx):
        raise RuntimeError(message)

    pipeline = [passes.Pass(p.name, broken, p.why) if p.name == "match" else p for p in passes.PIPELINE]
    monkeypatch.setattr(passes, "PIPELINE", pipeline)
    model = CrossBlock().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in (2, 3):  # two graphs (a recompile): still one warning
            x, context = inputs(b)
            assert torch.equal(fusion.compile(model)(x, context), model(x, context))
    said = [w for w in caught if issubclass(w.category, fusednorm.FusedNormWarning) and message in str(w.message)]
    assert len(said) == 1
    assert fusion.fused == 0


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_gradients_match_eager(fusion, compiler):
    model = CrossBlock().train()
    x, context = inputs()
    x.requires_grad_(True)
    context.requires_grad_(True)

    def grads(fn):
        for t in (x, context, *model.parameters()):
            t.grad = None
        fn(x, context).square().sum().backward()
        return [t.grad.clone() for t in (x, context, *model.parameters())]

    expected = grads(model)
    actual = grads(fusion.compile(model, compiler=compiler, options={"grad": "fuse"}))
    assert fusion.fused == 1
    scale = torch.cat([e.flatten() for e in expected]).norm()
    for a, e in zip(actual, expected):
        # the K bias gets an exactly-zero gradient (softmax ignores a per-row constant): compare it at the scale
        # of all the gradients, not at its own rounding noise
        assert (a - e).norm() <= 1e-4 * max(e.norm(), 1e-3 * scale)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_block_needing_gradients_is_left_to_the_compiler_and_the_reason_says_why(fusion, compiler):
    """Training: the fused op's backward recomputes the block unfused in float32, so by default a block whose
    output needs a gradient stays with the compiler (its backward is the compiler's); the report says so."""
    model = CrossBlock().train()
    x, context = inputs()
    x.requires_grad_(True)
    compiled = fusion.compile(model, compiler=compiler)
    compiled(x, context).square().sum().backward()
    assert fusion.fused == 0 and x.grad is not None
    assert "the block's output needs a gradient" in fusion.reasons()
    assert "options={'grad': 'fuse'}" in fusion.reasons()
    with torch.no_grad():  # the same model for inference: fused
        torch.testing.assert_close(compiled(x, context), model(x, context), rtol=1e-4, atol=1e-5)
    assert fusion.fused == 1


def test_options_are_checked_before_anything_compiles():
    from fusednorm.options import Options

    assert Options.from_dict({}).grad == "compiler"
    with pytest.raises(ValueError, match=r"option grad='always'; expected one of \('compiler', 'fuse'\)"):
        Options.from_dict({"grad": "always"})
    for bad in (0, -2, "4", 2.5, True):  # each once fell through to the op's check: the graph ran unfused
        with pytest.raises(ValueError, match=r"option sm_count=.*; expected None or a whole number >= 1"):
            Options.from_dict({"sm_count": bad})
    import numpy as np

    assert Options.from_dict({"sm_count": np.int64(3)}).sm_count == 3
    with pytest.raises(ValueError, match="option dump_dir=5; expected a folder path"):
        Options.from_dict({"dump_dir": 5})
    with pytest.raises(ValueError, match="option report='x'; expected a fusednorm.report.Report"):
        Options.from_dict({"report": "x"})


def test_rewrite_off_and_on():
    model = CrossBlock().eval()
    x, context = inputs()
    off, on = CountingBackend(rewrite=False), CountingBackend(rewrite=True)
    with torch.no_grad():
        assert torch.equal(torch.compile(model, backend=off)(x, context), model(x, context))
        torch._dynamo.reset()
        assert rel_err(torch.compile(model, backend=on)(x, context), model(x, context)) <= 1e-4
    assert (off.fused(0), on.fused(0)) == (0, 1)


def test_under_autocast_the_mixed_dtype_block_is_left_alone_and_the_reason_says_why(fusion):
    """Autocast runs the norm in float32 and the projections and attention in bfloat16: the block's tensors mix
    dtypes, which the op refuses; the model still runs as under eager autocast, and the report says what to do."""
    model = CrossBlock().eval()
    x, context = inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x, context)
        got = fusion.compile(model)(x, context)
    assert fusion.fused == 0 and torch.equal(got, want)
    assert "k has dtype torch.bfloat16 but x has torch.float32 (under torch.autocast" in fusion.reasons()
    assert "model.to(torch.bfloat16)" in fusion.reasons()


def test_sm_count_and_check_numerics_reach_the_op():
    backend = CountingBackend(sm_count=3, check_numerics=True)
    with torch.no_grad():
        torch.compile(CrossBlock().eval(), backend=backend)(*inputs())
    fused = next(n for n in backend.graphs[0].graph.nodes if n.target is FUSED_OP)
    assert fused.args[13:] == (3, True)


def test_report_names_the_pattern_and_this_file(fusion):
    fusion.run(CrossBlock().eval(), *inputs())
    (match,) = fusion.matches
    assert match.pattern == "layer_norm/q_linear/sdpa/out_linear"
    assert all(where.split(":")[0].endswith("test_backend_health.py") for where in match.locations.values())
    assert match.runs == "reference"
    summary = match.summary
    assert (summary["x"], summary["k"], summary["heads"], summary["head_dim"]) == ([2, 5, D], [2, H, 7, D // H], H,
                                                                                  D // H)
    assert summary["projections"] == ["wq", "bq", "wo", "bo"] and summary["norm"] == "layer"


def test_backend_resolves_in_a_fresh_interpreter_without_import():
    code = """
import sys, torch, torch.nn as nn
assert "fusednorm" not in sys.modules
torch.manual_seed(0)
layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True).eval()
x, memory = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
with torch.no_grad():
    out = torch.compile(layer, backend="fusednorm", options={"compiler": "eager"})(x, memory)
    assert "fusednorm" in sys.modules
    import fusednorm.backend
    assert len(fusednorm.backend.last_report.matches) == 1
    print(float((out - layer(x, memory)).abs().max()))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 1e-4
