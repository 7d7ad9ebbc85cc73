"""fusednorm.explain: matches with their source lines, near-misses with reasons, a table, JSON; no side effects."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusednorm
from fusednorm.report import KernelRecord, MatchRecord, NearMiss, Report

D, H = 32, 4
THIS_FILE = os.path.basename(__file__)


def _heads(t, B):
    return t.view(B, -1, H, D // H).transpose(1, 2)


class CrossBlock(nn.Module):
    """A pre-norm cross-attention block: the one thing fusednorm fuses."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x, context):
        B, L, _ = x.shape
        h = self.norm(x)  # <norm>
        a = F.scaled_dot_product_attention(  # <attention>
            _heads(self.q(h), B), _heads(self.k(context), B), _heads(self.v(context), B))
        return x + self.o(a.transpose(1, 2).reshape(B, L, D))  # <add>


class SelfBlock(CrossBlock):
    """Pre-norm self-attention: the normed x also feeds K and V, so it is not a cross-attention block."""

    def forward(self, x, context):
        B, L, _ = x.shape
        h = self.norm(x)  # <self-norm>
        a = F.scaled_dot_product_attention(_heads(self.q(h), B), _heads(self.k(h), B), _heads(self.v(h), B))
        return x + self.o(a.transpose(1, 2).reshape(B, L, D))


class PostNormBlock(CrossBlock):
    """Post-norm: the add comes first, then the norm."""

    def forward(self, x, context):
        B, L, _ = x.shape
        a = F.scaled_dot_product_attention(
            _heads(self.q(x), B), _heads(self.k(context), B), _heads(self.v(context), B))
        return self.norm(x + self.o(a.transpose(1, 2).reshape(B, L, D)))  # <post-norm>


def _line(marker: str) -> int:
    """The line of this file that carries `# <marker>`."""
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# <{marker}>"))


def _inputs(batch=2):
    torch.manual_seed(0)
    return torch.randn(batch, 5, D), torch.randn(batch, 7, D)


# ---- matches and near-misses on real models

def test_a_cross_attention_block_is_fused_and_located_in_this_file():
    report = fusednorm.explain(CrossBlock().eval(), *_inputs())
    assert len(report.matches) == 1 and report.graphs == 1
    m = report.matches[0]
    assert m.pattern
    assert m.locations["norm"].endswith(f"{THIS_FILE}:{_line('norm')}")
    assert m.locations["attention"].endswith(f"{THIS_FILE}:{_line('attention')}")
    assert m.locations["add"].endswith(f"{THIS_FILE}:{_line('add')}")
    assert os.path.isabs(m.locations["norm"].rsplit(":", 1)[0])
    assert m.runs, "a match says what runs it (a kernel, a plan or the reference)"
    text = str(report)
    assert m.pattern in text and f"{THIS_FILE}:{_line('norm')}" in text


def test_the_summary_names_the_fused_ops_arguments():
    report = fusednorm.explain(CrossBlock().eval(), *_inputs())
    flat = json.dumps(report.to_dict()["matches"][0]["summary"])
    for fact in ("[2, 5, 32]", "float32", "layer"):
        assert fact in flat, f"{fact} missing from the summary {flat}"


class TwoBlocksWithABreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = CrossBlock(), CrossBlock()

    def forward(self, x, context):
        x = self.first(x, context)
        torch._dynamo.graph_break()   # Dynamo compiles the two halves as two graphs
        return self.second(x, context)


def test_every_graph_dynamo_makes_is_reported():
    report = fusednorm.explain(TwoBlocksWithABreak().eval(), *_inputs())
    assert report.graphs == 2
    assert len(report.matches) == 2 and report.matches[0].graph != report.matches[1].graph
    assert "(2 graphs compiled)" in str(report).splitlines()[0]


def test_self_attention_is_a_near_miss_with_its_reason():
    report = fusednorm.explain(SelfBlock().eval(), *_inputs())
    assert report.matches == []
    [miss] = report.near_misses
    assert miss.locations["norm"].endswith(f"{THIS_FILE}:{_line('self-norm')}")
    assert "k" in miss.reason.lower() and "v" in miss.reason.lower(), miss.reason
    assert miss.reason in str(report)


def test_post_norm_is_a_near_miss_with_its_reason():
    report = fusednorm.explain(PostNormBlock().eval(), *_inputs())
    assert report.matches == []
    assert any("post-norm" in n.reason.lower() for n in report.near_misses), report.near_misses


def test_torch_decoder_layer_fuses_cross_attention_only():
    layer = nn.TransformerDecoderLayer(D, H, 64, dropout=0.0, norm_first=True, batch_first=True).eval()
    report = fusednorm.explain(layer, *_inputs())
    [m] = report.matches
    [miss] = report.near_misses
    assert "self-attention" in miss.reason
    # torch's own modules carry no source lines in Dynamo's graph: the module's forward and path stand in
    assert "normalization.py:" in m.locations["norm"] and "norm2" in m.locations["norm"]
    assert "multihead_attn" in m.locations["attention"] and "norm1" in miss.locations["norm"]
    assert not any("fusednorm" in loc for loc in [*m.locations.values(), *miss.locations.values()])


def test_whisper_decoder_blocks_point_into_the_model_source():
    transformers = pytest.importorskip("transformers")
    config = transformers.WhisperConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    decoder = transformers.WhisperForConditionalGeneration(config).model.decoder.eval()
    report = fusednorm.explain(decoder, input_ids=torch.randint(0, 100, (2, 6)),
                               encoder_hidden_states=torch.randn(2, 16, 32), use_cache=False)
    assert len(report.matches) == 2
    for m in report.matches:
        assert "modeling_whisper.py:" in m.locations["norm"]
    assert len({m.locations["norm"] for m in report.matches}) == 1   # both layers run the same source line


class EinsumBlock(CrossBlock):
    """Attention written with torch.einsum and unscaled: no built-in pattern knows this form."""

    def forward(self, x, context):
        B, L, _ = x.shape
        q, k, v = _heads(self.q(self.norm(x)), B), _heads(self.k(context), B), _heads(self.v(context), B)
        w = torch.einsum("bhqd,bhkd->bhqk", q, k).softmax(dim=-1)  # <einsum>
        return x + self.o(torch.einsum("bhqk,bhkd->bhqd", w, v).transpose(1, 2).reshape(B, L, D))


def einsum_search(x, gamma, beta, eps, wq, bq, k, v, wo, bo):
    B, L = x.shape[0], x.shape[1]
    q = F.linear(F.layer_norm(x, x.shape[-1:], gamma, beta, eps), wq, bq)
    w = torch.einsum("bhqd,bhkd->bhqk", q.view(B, L, k.shape[1], k.shape[3]).transpose(1, 2), k).softmax(dim=-1)
    return x + F.linear(torch.einsum("bhqk,bhkd->bhqd", w, v).transpose(1, 2).reshape(B, L, -1), wo, bo)


def test_a_registered_pattern_is_named_in_the_report():
    from fusednorm.patterns import Fixed

    model, (x, ctx) = EinsumBlock().eval(), _inputs()
    before = fusednorm.explain(model, x, ctx)
    assert before.matches == [] and "torch.einsum" in before.near_misses[0].reason
    bind = {a: a for a in ("x", "gamma", "beta", "eps", "wq", "bq", "k", "v", "wo", "bo")}
    fusednorm.register_pattern("einsum_cross", einsum_search, bind={**bind, "scale": Fixed(1.0)}, norm="layer")
    try:
        after = fusednorm.explain(model, x, ctx)
    finally:
        fusednorm.unregister_pattern("einsum_cross")
    [m] = after.matches
    assert m.pattern == "einsum_cross" and "einsum_cross" in str(after)
    assert m.locations["attention"].endswith(f"{THIS_FILE}:{_line('einsum')}")
    assert m.summary["scale"] == 1.0


# ---- no side effects

def test_explain_leaves_the_users_compiled_model_alone():
    model = CrossBlock().eval()
    x, ctx = _inputs()
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    users = torch.compile(model, backend=counting)
    with torch.no_grad():
        expected = users(x, ctx)
        first = fusednorm.explain(model, x, ctx)
        second = fusednorm.explain(model, x, ctx)   # compiles afresh: the first run left no cache behind
        again = users(x, ctx)
    assert len(compiles) == 1
    torch.testing.assert_close(again, expected)
    assert len(second.matches) == 1
    # the same facts both times; only the graph numbers (counted per process) move on
    for record in first.matches + second.matches:
        record.graph = 0
    assert first.to_dict() == second.to_dict()


def test_explain_keeps_grad_mode_and_dynamo_counters():
    from torch._dynamo.utils import counters

    before = {k: dict(v) for k, v in counters.items()}
    assert torch.is_grad_enabled()
    fusednorm.explain(CrossBlock().eval(), *_inputs())
    assert torch.is_grad_enabled()
    assert {k: dict(v) for k, v in counters.items() if v} == {k: v for k, v in before.items() if v}


def test_bad_inputs_give_clear_errors():
    with pytest.raises(TypeError, match="model must be an nn.Module or a callable"):
        fusednorm.explain(42)
    with pytest.raises(fusednorm.ExplainError, match="running the model on the given inputs failed") as info:
        fusednorm.explain(CrossBlock().eval(), torch.randn(2, 5, D + 1), torch.randn(2, 7, D))
    assert info.value.__cause__ is not None


# ---- the report itself

def _sample_report() -> Report:
    return Report(
        matches=[MatchRecord("layer_norm+sdpa", {"norm": "/src/m.py:10", "attention": "/src/m.py:12",
                                                 "add": "/src/m.py:13"},
                             {"x": torch.Size([2, 5, 32]), "dtype": torch.float16, "norm": "layer", "mask": None},
                             runs="reference (CPU)", graph=1)],
        near_misses=[NearMiss("post-norm: the add comes before the norm", {"norm": "/src/m.py:30"}, graph=1)],
        kernels=[KernelRecord("pnca_fp16_d64", ["-lineinfo"], {"registers": 96, "spill_stores": 0})],
        notes=["a note"],
        graphs=1,
    )


def test_report_json_round_trip():
    report = _sample_report()
    data = json.loads(report.to_json())
    assert data["matches"][0]["summary"] == {"x": [2, 5, 32], "dtype": "float16", "norm": "layer", "mask": None}
    again = Report.from_json(report.to_json())
    assert again.to_dict() == report.to_dict()
    assert str(again) == str(Report.from_dict(data))


def test_report_from_dict_names_what_is_wrong():
    with pytest.raises(ValueError, match=r"matches\[0\] lacks \['locations', 'summary'\]"):
        Report.from_dict({"matches": [{"pattern": "p"}]})
    with pytest.raises(TypeError, match="expected a dict"):
        Report.from_dict([])


def test_table_columns_line_up():
    text = str(_sample_report())
    lines = text.splitlines()
    assert lines[0] == "fusednorm: 1 block fused, 1 chain not fused (1 graph compiled)"
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  graph  pattern"))
    head, row = lines[header], lines[header + 1]
    names = head.split()
    starts = [head.index(f" {n} " if n != "#" else "#") + (n != "#") for n in names[:-1]] + [head.rindex(names[-1])]
    cells = {n: row[a:b].strip() for n, a, b in zip(names, starts, starts[1:] + [None])}
    assert cells == {"#": "1", "graph": "1", "pattern": "layer_norm+sdpa", "norm": "/src/m.py:10",
                     "attention": "/src/m.py:12", "add": "/src/m.py:13", "runs": "reference (CPU)"}
    assert "f16" in text or "float16" in text
    assert "post-norm: the add comes before the norm" in text and "a note" in text and "pnca_fp16_d64" in text
