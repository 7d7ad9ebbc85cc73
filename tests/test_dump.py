"""Dumps: numbered graph files, reports, kernel sources with their resources, MLIR, the structured trace."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusednorm  # noqa: F401  (registers the op and the backend)
from fusednorm.inspect import dump, kernels, mlir
from fusednorm.inspect.graph_text import readable_graph
from fusednorm.report import MatchRecord, NearMiss, Report
from fusednorm.warn import FusedNormWarning

D, H = 32, 4
FUSED_IN_MLIR = 'torch.operator "torch.fusednorm.pre_norm_cross_attn"'
# torch-mlir is in the test extra; only where it cannot be installed (no wheel for this Python / torch) the
# MLIR checks turn into checks of the note that says so
MLIR_MISSING = mlir.mlir_available()
needs_mlir = pytest.mark.skipif(MLIR_MISSING is not None, reason=f"{MLIR_MISSING}")


def assert_rewritten_mlir(folder) -> str:
    """The graph folder's MLIR holds the fused op (or, without torch-mlir, the note says why not)."""
    if MLIR_MISSING is not None:
        assert "torch-mlir is not importable" in (folder / "rewritten.mlir.txt").read_text()
        return ""
    text = (folder / "rewritten.mlir").read_text()
    assert FUSED_IN_MLIR in text
    return text


class PreNormCrossAttention(nn.Module):
    """norm -> Q projection -> SDPA over a context -> out projection -> residual add."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x, context):
        B, L, _ = x.shape
        heads = lambda t: t.view(B, -1, H, D // H).transpose(1, 2)  # noqa: E731
        h = self.norm(x)
        a = F.scaled_dot_product_attention(heads(self.q(h)), heads(self.k(context)), heads(self.v(context)))
        return x + self.o(a.transpose(1, 2).reshape(B, L, D))


def _inputs():
    torch.manual_seed(0)
    return torch.randn(2, 5, D), torch.randn(2, 7, D)


def _fused_graph():
    """A Dynamo graph that calls the fused op (as the rewrite leaves it), with its example inputs."""
    captured = {}

    def fused(x, k, v, gamma, beta):
        y = torch.ops.fusednorm.pre_norm_cross_attn(x, k, v, gamma, beta, None, None, None, None, None,
                                                    "layer", 1e-5, None, None, False)
        return torch.relu(y)

    def keep(gm, example_inputs):
        captured["gm"], captured["inputs"] = gm, example_inputs
        return gm.forward

    args = (torch.randn(2, 5, D), torch.randn(2, H, 7, D // H), torch.randn(2, H, 7, D // H), torch.ones(D),
            torch.zeros(D))
    torch._dynamo.reset()
    torch.compile(fused, backend=keep)(*args)
    return captured["gm"], captured["inputs"]


def test_readable_graph_shows_dtypes_shapes_and_the_fused_op():
    gm, _ = _fused_graph()
    text = readable_graph(gm, "title line")
    assert text.startswith("# title line\n")
    assert 'f32[2, 5, 32]' in text and 'f32[2, 4, 7, 8]' in text
    assert "torch.ops.fusednorm.pre_norm_cross_attn" in text
    assert "fusednorm nodes: " in text and "fusednorm nodes: none" not in text
    compile(text, "<graph>", "exec")   # the dump is valid Python


def test_dump_graph_writes_numbered_files(tmp_path):
    gm, _ = _fused_graph()
    dump.dump_graph(str(tmp_path), 7, 0, "before passes", gm)
    dump.dump_graph(str(tmp_path), 7, 3, "rewrite", gm)
    folder = tmp_path / "graph_007"
    assert sorted(os.listdir(folder)) == ["00_before_passes.py", "03_rewrite.py"]
    assert "before the passes" in (folder / "00_before_passes.py").read_text()
    assert "after pass 3 (rewrite)" in (folder / "03_rewrite.py").read_text()


@needs_mlir
def test_mlir_of_a_graph_shows_the_fusednorm_op():
    gm, inputs = _fused_graph()
    text = mlir.graph_to_mlir(gm, inputs, func_name="graph_001")
    assert FUSED_IN_MLIR in text
    assert "func.func @graph_001" in text
    assert "!torch.vtensor<[2,5,32],f32>" in text
    # from the placeholders' own example values too, as a dump after a pass has no inputs at hand
    assert FUSED_IN_MLIR in mlir.graph_to_mlir(gm)


def test_after_the_last_pass_the_mlir_and_the_graphs_report_are_written(tmp_path):
    from fusednorm.passes import PIPELINE

    gm, _ = _fused_graph()
    report = Report(matches=[MatchRecord("p", {"norm": "m.py:3"}, {"x": [2, 5, 32]}, graph=4),
                             MatchRecord("p", {"norm": "m.py:9"}, {}, graph=5)],
                    near_misses=[NearMiss("post-norm", {"norm": "m.py:20"}, graph=4)])
    dump.dump_graph(str(tmp_path), 4, len(PIPELINE) - 1, PIPELINE[-2].name, gm, report=report)
    folder = tmp_path / "graph_004"
    assert not (folder / "rewritten.mlir").exists() and not (folder / "report.json").exists()
    dump.dump_graph(str(tmp_path), 4, len(PIPELINE), PIPELINE[-1].name, gm, report=report)
    assert_rewritten_mlir(folder)
    graph_report = json.loads((folder / "report.json").read_text())   # only this graph's records
    assert [m["locations"]["norm"] for m in graph_report["matches"]] == ["m.py:3"]
    assert [n["reason"] for n in graph_report["near_misses"]] == ["post-norm"]
    assert "m.py:3" in (folder / "report.txt").read_text() and "m.py:9" not in (folder / "report.txt").read_text()


def test_without_torch_mlir_a_note_says_why(tmp_path, monkeypatch):
    gm, inputs = _fused_graph()
    monkeypatch.setattr(mlir, "mlir_available", lambda: "torch-mlir is not importable (ImportError: test)")
    dump.dump_mlir(str(tmp_path), 1, gm, inputs)
    folder = tmp_path / "graph_001"
    assert not (folder / "rewritten.mlir").exists()
    assert "torch-mlir is not importable" in (folder / "rewritten.mlir.txt").read_text()


def test_a_failing_dump_warns_once_and_never_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(dump, "_failed", set())
    gm, _ = _fused_graph()
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the dump folder should be")
    with pytest.warns(FusedNormWarning, match="could not write the graph dump") as caught:
        dump.dump_graph(str(blocker), 1, 0, "before passes", gm)
        dump.dump_graph(str(blocker), 2, 1, "match", gm)
    assert len([w for w in caught if issubclass(w.category, FusedNormWarning)]) == 1


def test_record_kernel_writes_source_options_and_resources(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEDNORM_DUMP", str(tmp_path))
    seen: list = []
    with kernels.collecting(seen):
        kernels.record_kernel("pnca_bf16_d64_layer_gb_mnone_t64x64_sm90", "__global__ void k() {}",
                              [b"--gpu-architecture=sm_90", "-lineinfo"],
                              {"registers": 96, "spill_stores": 0, "spill_loads": 0, "static_smem": 0})
    kernels.record_kernel("after the block", "", [], {})   # nobody collects it any more
    assert [r.key for r in seen] == ["pnca_bf16_d64_layer_gb_mnone_t64x64_sm90"]
    folder = tmp_path / "kernels"
    assert (folder / "pnca_bf16_d64_layer_gb_mnone_t64x64_sm90.cu").read_text() == "__global__ void k() {}"
    meta = json.loads((folder / "pnca_bf16_d64_layer_gb_mnone_t64x64_sm90.json").read_text())
    assert meta["options"] == ["--gpu-architecture=sm_90", "-lineinfo"]
    assert meta["resources"]["registers"] == 96 and meta["cached"] is False


def test_record_kernel_never_raises(monkeypatch):
    def broken(record):
        raise RuntimeError("listener bug")

    monkeypatch.setattr(kernels, "_listeners", [broken])
    with pytest.warns(FusedNormWarning, match="could not record kernel"):
        kernels.record_kernel("k1", "src", [], {})


def test_kernel_file_names_are_safe():
    assert dump.slug("a b/c:d") == "a_b_c_d"
    long = dump.slug("x" * 300)
    assert len(long) < 120 and long != dump.slug("x" * 301)


# ---- through the backend: every compiled graph is dumped

def _compile_and_run(model, *args, options):
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(model, backend="fusednorm", options=options)(*args)


def test_backend_dumps_each_pass_and_the_rewritten_graph(tmp_path):
    from fusednorm.passes import PIPELINE

    model = PreNormCrossAttention().eval()
    x, ctx = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedNormWarning)   # a dump problem would show up here
        out = _compile_and_run(model, x, ctx, options={"compiler": "eager", "dump_dir": str(tmp_path)})
    torch.testing.assert_close(out, model(x, ctx))
    graphs = sorted(p for p in os.listdir(tmp_path) if p.startswith("graph_"))
    assert len(graphs) == 1
    folder = tmp_path / graphs[0]
    files = sorted(os.listdir(folder))
    numbered = [f for f in files if f[:2].isdigit()]
    stages = ["input"] + [p.name for p in PIPELINE]
    assert numbered == [f"{i:02d}_{dump.slug(name)}.py" for i, name in enumerate(stages)]
    first, last = (folder / numbered[0]).read_text(), (folder / numbered[-1]).read_text()
    assert "f32[2, 5, 32]" in first
    assert "fusednorm.pre_norm_cross_attn" not in first
    assert "fusednorm.pre_norm_cross_attn" in last
    assert_rewritten_mlir(folder)


def test_a_recompile_with_symbolic_sizes_gets_its_own_numbered_dump(tmp_path):
    model = PreNormCrossAttention().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusednorm", options={"compiler": "eager", "dump_dir": str(tmp_path)})
    with torch.no_grad():
        compiled(torch.randn(2, 5, D), torch.randn(2, 7, D))
        compiled(torch.randn(3, 6, D), torch.randn(3, 7, D))   # Dynamo makes the sizes symbolic
    graphs = sorted(p for p in os.listdir(tmp_path) if p.startswith("graph_"))
    assert len(graphs) == 2
    second = tmp_path / graphs[1]
    first_file = (second / "00_input.py").read_text()
    assert ': "Sym(' in first_file and '"f32[s' in first_file   # sizes shown as the symbols Dynamo chose
    mlir_text = assert_rewritten_mlir(second)
    assert MLIR_MISSING or "!torch.int" in mlir_text   # the symbolic sizes are inputs of the MLIR function


def test_dynamic_shapes_dump_mlir_with_the_traced_eps(tmp_path):
    # dynamic=True: Dynamo lifts LayerNorm's eps to a 0-d tensor input read by .item(), which torch.export turned
    # into a value the fused op's float eps refused, so the MLIR dump failed with a warning
    model = PreNormCrossAttention().eval()
    x, ctx = _inputs()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusednorm", dynamic=True,
                             options={"compiler": "eager", "dump_dir": str(tmp_path)})
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FusedNormWarning)
        torch.testing.assert_close(compiled(x, ctx), model(x, ctx))
    graphs = sorted(p for p in os.listdir(tmp_path) if p.startswith("graph_"))
    assert len(graphs) == 1
    mlir_text = assert_rewritten_mlir(tmp_path / graphs[0])
    if not MLIR_MISSING:
        assert "eps is a graph input read by .item(): shown as the value it was traced with, 1e-05" in mlir_text
        assert "%float1.000000e-05" in mlir_text


def test_env_var_turns_dumps_on(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEDNORM_DUMP", str(tmp_path))
    model = PreNormCrossAttention().eval()
    _compile_and_run(model, *_inputs(), options={"compiler": "eager"})
    assert any(p.startswith("graph_") for p in os.listdir(tmp_path))


def test_unwritable_dump_dir_does_not_break_the_model(tmp_path, monkeypatch):
    monkeypatch.setattr(dump, "_failed", set())
    blocker = tmp_path / "file"
    blocker.write_text("")
    model = PreNormCrossAttention().eval()
    x, ctx = _inputs()
    with pytest.warns(FusedNormWarning):
        out = _compile_and_run(model, x, ctx, options={"compiler": "eager", "dump_dir": str(blocker / "sub")})
    torch.testing.assert_close(out, model(x, ctx))


def test_structured_trace_carries_the_same_artifacts(tmp_path):
    """TORCH_TRACE=<dir>: tlparse finds fusednorm's graphs, report and MLIR among the compile's artifacts."""
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_dump import PreNormCrossAttention, _inputs
        import fusednorm
        model = PreNormCrossAttention().eval()
        with torch.no_grad():
            torch.compile(model, backend="fusednorm", options={{"compiler": "eager"}})(*_inputs())
    """)
    trace_dir = tmp_path / "trace"
    env = dict(os.environ, TORCH_TRACE=str(trace_dir), FUSEDNORM_DUMP=str(tmp_path / "dump"))
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    logs = "".join(p.read_text() for p in trace_dir.iterdir())
    numbered = sorted(os.listdir(tmp_path / "dump" / "graph_001"))
    for name in (f[:-3] for f in numbered if f.endswith(".py")):
        assert f'"name": "fusednorm_graph_001_{name}"' in logs
    assert '"name": "fusednorm_graph_001_mlir"' in logs
    assert "fusednorm.pre_norm_cross_attn" in logs
