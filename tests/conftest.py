"""Shared fixtures: a fresh Dynamo per test, and ``fusion`` to compile a model and see what fusednorm did to it."""
from __future__ import annotations

import pytest
import torch

import fusednorm  # noqa: F401  (registers the backend and the fused op)
import fusednorm.backend as backend

FUSED_OP = torch.ops.fusednorm.pre_norm_cross_attn.default


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def dynamo_graph(fn, *args) -> torch.fx.GraphModule:
    """Dynamo's FX graph of fn (as a backend receives it)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


def first_tensor(out):
    """The main output of a model call (a tensor, a tuple, or a HF ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "last_hidden_state", "sample"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    if isinstance(out, (tuple, list)):
        return first_tensor(out[0])
    raise TypeError(f"no tensor in {type(out).__name__}")


def perturb(module: torch.nn.Module) -> torch.nn.Module:
    """Move every parameter off its init (LayerNorm starts at weight 1, bias 0) so a wrong binding shows."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return module


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm())


class Fusion:
    """Compiles with backend="fusednorm" and records every rewritten graph and report."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []
        self.reports = []

    def record(self, gm, report):
        self.graphs.append(gm)
        self.reports.append(report)

    def compile(self, model, compiler="eager", options=None, **compile_kwargs):
        return torch.compile(model, backend="fusednorm", options={"compiler": compiler, **(options or {})},
                             **compile_kwargs)

    @property
    def fused(self) -> int:
        return sum(1 for gm in self.graphs for n in gm.graph.nodes if n.target is FUSED_OP)

    @property
    def matches(self):
        return [m for r in self.reports for m in r.matches]

    @property
    def near_misses(self):
        return [m for r in self.reports for m in r.near_misses]

    def reasons(self) -> str:
        return " | ".join(m.reason for m in self.near_misses)

    def run(self, model, *args, compiler="eager", tol=1e-4, **kwargs):
        """Compile, run under no_grad (as inference runs: a block needing a gradient is left to the compiler by
        default), compare with eager (relative L2 <= tol); returns the compiled model's output."""
        with torch.no_grad():
            expected = first_tensor(model(*args, **kwargs))
            compiled = self.compile(model, compiler=compiler)
            actual = first_tensor(compiled(*args, **kwargs))
        err = rel_err(actual, expected)
        assert err <= tol, f"compiled output differs from eager: relative L2 error {err:.2e}; {self.reasons()}"
        return actual


@pytest.fixture
def fusion(monkeypatch):
    recorder = Fusion()
    rewrite = backend.rewrite

    def recording_rewrite(gm, example_inputs, opts, report):
        out = rewrite(gm, example_inputs, opts, report)
        recorder.record(out, report)
        return out

    monkeypatch.setattr(backend, "rewrite", recording_rewrite)
    return recorder
