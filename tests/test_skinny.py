"""The plan's skinny GEMM (codegen/skinny.py) on the CPU: every spec compiles for sm_90 with no spills and fits
shared memory, its K slices cover K, and calls it does not take say why (the GPU tests run it)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("cuda.bindings.nvrtc")

from fusednorm.codegen import skinny  # noqa: E402
from fusednorm.codegen.nvrtc import compile_to_cubin  # noqa: E402

SPECS = [skinny.SkinnySpec(dtype, k, out_f32, 90) for dtype in ("bf16", "fp16") for k in (8, 1024, 1288, 4096)
         for out_f32 in (True, False)]
H100_SMEM_PER_BLOCK = 227 * 1024


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key)
def test_every_spec_compiles_for_sm90_without_spills(spec):
    _, usage, _ = compile_to_cubin(spec.source(), spec.key, spec.arch)
    assert usage.spill_stores == 0 and usage.spill_loads == 0, usage
    assert 0 < usage.registers <= 128
    assert spec.smem_bytes() <= H100_SMEM_PER_BLOCK


def test_keys_name_what_the_code_is_specialised_on():
    assert skinny.SkinnySpec("bf16", 1280, True).key == "skinny_bf16_k1280_f32out_sm90"
    assert skinny.SkinnySpec("fp16", 1288, False).key == "skinny_fp16_k1288_addinto_sm90"
    assert len({s.key for s in SPECS}) == len(SPECS)


@pytest.mark.parametrize("k", [8, 40, 1024, 1280, 1288, 2056, 4096])
def test_the_cluster_slices_cover_k_in_32_column_blocks_on_rows_that_spread_the_banks(k):
    spec = skinny.SkinnySpec("bf16", k, True)
    assert spec.k_slice % 32 == 0 and k <= skinny.SPLITS * spec.k_slice < k + skinny.SPLITS * 32
    assert spec.row_bytes >= 2 * spec.k_slice and spec.row_bytes % 128 == 64


def test_calls_it_does_not_take_say_why(monkeypatch):
    a, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16)
    assert skinny.why_not(a, w) == "not on CUDA"
    monkeypatch.setattr(skinny, "enabled", False)
    assert "switched off" in skinny.why_not(a, w)
