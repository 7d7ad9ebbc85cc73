"""examples/teach_pattern.py: a real SD v1-era block is left alone by the built-ins and fused once registered."""
import importlib.util
import pathlib
import sys

import pytest
import torch

import fusednorm

_path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "teach_pattern.py"
_spec = importlib.util.spec_from_file_location("teach_pattern", _path)
teach = importlib.util.module_from_spec(_spec)
sys.modules["teach_pattern"] = teach   # Dynamo looks modules of traced code up by name
_spec.loader.exec_module(teach)


@pytest.fixture
def block_and_inputs():
    torch.manual_seed(0)
    block = teach.LegacyCrossAttention(dim=64, context_dim=48, heads=4).eval()
    return block, torch.randn(2, 24, 64), torch.randn(2, 7, 48)


def test_builtins_leave_the_block_alone_and_say_why(block_and_inputs):
    report = fusednorm.explain(*block_and_inputs)
    assert report.matches == []
    assert len(report.near_misses) == 1
    assert "torch.baddbmm" in report.near_misses[0].reason


def test_registered_pattern_fuses_the_block_and_matches_eager(block_and_inputs):
    block, x, context = block_and_inputs
    teach.register()
    try:
        report = fusednorm.explain(block, x, context)
        assert [m.pattern for m in report.matches] == ["legacy_sd_baddbmm"]
        assert report.matches[0].summary["heads"] == 4
        with torch.no_grad():
            compiled = torch.compile(block, backend="fusednorm", options={"compiler": "eager"})
            got, want = compiled(x, context), block(x, context)
        assert ((got - want).norm() / want.norm()).item() <= 1e-4
    finally:
        fusednorm.unregister_pattern("legacy_sd_baddbmm")
    assert fusednorm.explain(block, x, context).matches == []   # unregistering restores the built-ins' view
