"""The plan's skinny GEMM (codegen/skinny.py) on an sm_90 GPU, against float64: out = a @ w^T in float32 and
y += a @ w^T rounded once, for 1 to 64 rows, K with a short last slice, N with a short last tile; outputs poisoned
before launch, fresh random inputs; the error within 2x cuBLAS's in the same call; the same bits on every run.
Then the plan takes it for a decode-shaped block."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs an sm_90 GPU (thread-block clusters)", allow_module_level=True)

from fusednorm import codegen  # noqa: E402
from fusednorm.codegen import launch, skinny  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = [(1, 1280, 1280), (5, 1280, 1288), (16, 1024, 1024), (33, 72, 40), (64, 1280, 1288), (64, 200, 4096)]


@pytest.fixture(autouse=True)
def poisoned_outputs():
    codegen.poison_outputs = True
    yield
    codegen.poison_outputs = False


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def operands(m, n, k, dtype):
    a = (torch.randn(m, k, device="cuda") + 0.5).to(dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    return a, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_float32_out_matches_float64_as_closely_as_cublas(dtype, m, n, k):
    a, w = operands(m, n, k, DTYPES[dtype])
    assert skinny.why_not(a, w) is None
    before = skinny.launches
    out = skinny.gemm_f32_out(a, w)
    assert skinny.launches == before + 1 and launch.last_launched.startswith(f"skinny_{dtype}_k{k}_f32out")
    ref = a.double() @ w.double().T
    assert out.dtype == torch.float32 and out.shape == (m, n) and torch.isfinite(out).all()
    cublas = torch.mm(a, w.T, out_dtype=torch.float32)
    assert rel_err(out, ref) <= 2 * rel_err(cublas, ref) + 1e-7
    assert torch.equal(skinny.gemm_f32_out(a, w), out)  # the same bits on every run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_add_into_matches_float64_as_closely_as_addmm(dtype, m, n, k):
    a, w = operands(m, n, k, DTYPES[dtype])
    y0 = torch.randn(m, n, device="cuda").to(DTYPES[dtype])
    assert skinny.why_not(a, w, y0) is None
    ref = y0.double() + a.double() @ w.double().T
    y = skinny.gemm_add_into(y0.clone(), a, w)
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) <= 2 * rel_err(y0.clone().addmm_(a, w.T), ref) + 1e-6
    assert torch.equal(skinny.gemm_add_into(y0.clone(), a, w), y)


def test_calls_it_does_not_take_go_elsewhere_with_the_reason():
    a, w = operands(65, 128, 64, torch.bfloat16)
    assert "more than 64" in skinny.why_not(a, w)
    assert "K 60" in skinny.why_not(a[:4, :60], w[:, :60])
    assert "not row-major" in skinny.why_not(a[:4, :64], w, torch.empty(4, 256, device="cuda")[:, 1:129])
    assert "not one 16-bit" in skinny.why_not(a[:4].float(), w)


def test_a_decode_block_on_the_plan_takes_it_for_both_projections():
    from test_plan_gpu import check, make  # the plan's float64 check (update error within 2x eager's)

    t = make(torch.bfloat16, "full", "layer", "none", B=16, Lq=1, H=4, d=64, Lk=300)
    before = skinny.launches
    check(t, "layer")
    assert skinny.launches == before + 2
    skinny.enabled = False
    try:
        before = skinny.launches
        check(t, "layer")
        assert skinny.launches == before
    finally:
        skinny.enabled = True


def test_weights_loaded_before_the_wait_give_the_same_bits():
    """The out GEMM loads its weights before it waits for the kernel before, which here writes its a: another
    skinny GEMM, whose programmatic trigger lets this one start while it runs. The same bits as loading them after
    the wait."""
    a0, w = operands(64, 1280, 1288, torch.bfloat16)
    b = torch.randn(1288, 1288, device="cuda").to(torch.bfloat16) / 40
    a_base, y0 = torch.randn(64, 1288, device="cuda").to(torch.bfloat16), torch.randn(64, 1280, device="cuda")
    ys = []
    for early in (False, True):
        a = skinny.gemm_add_into(a_base.clone(), a0, b)  # written by the kernel just before the GEMM
        ys.append(skinny.gemm_add_into(y0.to(torch.bfloat16), a, w, w_before_wait=early))
    assert torch.isfinite(ys[0]).all() and torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("B,Lk", [(64, 1500), (3, 77)])
def test_the_stage_prefetching_its_keys_before_the_wait_changes_no_bit(B, Lk):
    """The decode plan's chain (skinny Q GEMM, then the stage, which prefetches its first K/V into L2 while the Q
    GEMM still runs, then the skinny out GEMM) gives the bits of the same plan whose stage waits first."""
    from test_plan_gpu import OP, check, make  # the plan's float64 check (update error within 2x eager's)

    t = make(torch.bfloat16, "full", "layer", "none", B=B, Lq=1, H=20, d=64, Lk=Lk)
    before = skinny.launches
    check(t, "layer")
    assert skinny.launches == before + 2
    ys = []
    for prefetch in (True, False):
        codegen.stage_prefetch = prefetch
        codegen.call_plans.clear()
        try:
            ys.append(OP(*t.values(), "layer", 1e-5))
        finally:
            codegen.stage_prefetch = True
            codegen.call_plans.clear()
    assert torch.equal(ys[0], ys[1])
