"""The projection plan for a few query rows (decode): one launch, both projections inside the attention stage
(plans/__init__.py, templates/pnca/projections.cu), against a float64 reference on a CUDA GPU (skipped cleanly
without one). As in test_plan_gpu.py: fresh random inputs, outputs poisoned before launch, the error taken on the
block's update y - x and held within 2x eager PyTorch's in the same dtype."""
from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import fusednorm  # noqa: E402
from fusednorm import codegen  # noqa: E402
from fusednorm.codegen import launch  # noqa: E402
from fusednorm.plans.choose import unfused_block  # noqa: E402
from test_plan_gpu import DEV, DTYPES, OP, check, make, update_error  # noqa: E402

FUSED = "_qf_fp_"  # in the key of a stage kernel that runs both projections itself
WITH_BOTH = ("full", "no_biases", "q_bias_only", "o_bias_only")


@pytest.fixture(autouse=True)
def poisoned_outputs():
    codegen.poison_outputs = True
    yield
    codegen.poison_outputs = False


def check_fused(t, norm, eps=1e-5):
    err = check(t, norm, eps)  # one launch, finite, within 2x eager's error
    assert FUSED in launch.last_launched, launch.last_launched
    return err


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", WITH_BOTH)
def test_every_variant_with_both_projections_is_one_launch(dtype, variant):
    gen = torch.Generator(device=DEV).manual_seed(hash((dtype, variant, "few")) % 2**31)
    cases = itertools.product((("layer", "none"), ("layer", "bool"), ("layer", "add"), ("rms", "none"),
                               ("rms", "bool"), ("rms", "add")), (1, 6, 16))
    for (norm, mask), Lq in cases:
        check_fused(make(DTYPES[dtype], variant, norm, mask, B=3, Lq=Lq, Lk=300, gen=gen), norm)


@pytest.mark.parametrize("d,H,B,Lq,Lk", [(32, 4, 2, 2, 64), (40, 8, 2, 1, 77), (64, 20, 4, 1, 1500),
                                         (80, 4, 2, 3, 300), (96, 2, 2, 9, 500), (128, 2, 3, 16, 1500),
                                         (160, 2, 2, 5, 200), (256, 2, 2, 7, 100)])
def test_head_dims_and_lengths(d, H, B, Lq, Lk):
    gen = torch.Generator(device=DEV).manual_seed(d * 1000 + Lk)
    check_fused(make(torch.bfloat16, "full", "layer", "bool", B=B, Lq=Lq, H=H, d=d, Lk=Lk, gen=gen), "layer")


def test_keys_split_between_ctas_then_heads_summed(monkeypatch):
    """One batch of 4 heads cannot fill the GPU: each head's keys are split between CTAs (kv_chunks > 1), the last
    run of a head merges them and applies Wo, and the last head sums the heads' shares."""
    seen, real = [], codegen._launch.launch

    def launch_and_record(kernel, grid, stream, pointers, tail, maps=b""):
        seen.append(tail[-4])  # Params.kv_chunks
        return real(kernel, grid, stream, pointers, tail, maps)

    monkeypatch.setattr(codegen._launch, "launch", launch_and_record)
    for Lq in (1, 11):
        check_fused(make(torch.bfloat16, "full", "layer", "none", B=1, Lq=Lq, H=4, Lk=1500), "layer")
        assert seen[-1] > 1, seen


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_large_mean_against_spread(norm):
    """|mean| >> std: the folded norm subtracts two large numbers; the stage's own qraw is float32 like cuBLAS's."""
    check_fused(make(torch.bfloat16, "full", norm, "none", B=4, Lq=3, Lk=200, mean=40.0), norm)


def test_model_dim_other_than_heads_times_head_dim():
    """Wq [H*d, D] and Wo [D, H*d] with D != H*d (T5's inner dim): D = 200 runs inside the stage."""
    for D in (200,):
        gen = torch.Generator(device=DEV).manual_seed(D)
        t = make(torch.bfloat16, "full", "layer", "bool", B=3, Lq=2, H=4, d=64, Lk=90, gen=gen)
        r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
        Dq = 256
        t.update(x=(r(3, 2, D) * 1.5 + 0.3).to(torch.bfloat16), gamma=(1 + 0.2 * r(D)).bfloat16(),
                 beta=(0.1 * r(D)).bfloat16(), wq=(r(Dq, D) / D**0.5).bfloat16(), wo=(r(D, Dq) / Dq**0.5).bfloat16(),
                 bo=(0.2 * r(D)).bfloat16())
        check_fused(t, "layer")


def test_bit_identical_whatever_sm_count_bounds_and_run_to_run():
    """The heads' shares are summed in head order by whichever CTA finishes last: no order depends on timing."""
    t = make(torch.bfloat16, "full", "layer", "bool", B=6, Lq=5, H=8, Lk=700)
    first = OP(*t.values(), "layer", 1e-5)
    again = OP(*t.values(), "layer", 1e-5)
    bounded = OP(*t.values(), "layer", 1e-5, None, 7)
    assert FUSED in launch.last_launched
    assert torch.equal(first, again) and torch.equal(first, bounded)


def test_numerics_check_fires_on_nan_and_stays_quiet_otherwise():
    t = make(torch.bfloat16, "full", "layer", "none", B=2, Lq=4, Lk=100)
    OP(*t.values(), "layer", 1e-5, None, None, True)  # clean: no error
    assert FUSED in launch.last_launched
    t["wo"][3, 5] = float("inf")  # reaches y only through the out projection
    with pytest.raises(fusednorm.FusedNormNumericsError, match="_qf_fp_"):
        OP(*t.values(), "layer", 1e-5, None, None, True)


def test_captured_graph_replays_with_new_inputs():
    """Tickets and shares are per launch: replays of a captured call see each new x and leave the tickets zero."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    t = make(torch.bfloat16, "full", "rms", "bool", B=8, Lq=1, H=8, Lk=600, gen=gen)
    OP(*t.values(), "rms", 1e-5)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = OP(*t.values(), "rms", 1e-5)
    for _ in range(3):
        t["x"].copy_((torch.randn(t["x"].shape, device=DEV, generator=gen) * 1.5).to(torch.bfloat16))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = update_error(y, t, "rms", 1e-5)
        err_eager = update_error(unfused_block(**t, norm="rms", eps=1e-5, scale=None), t, "rms", 1e-5)
        assert err <= 2 * err_eager + 1e-6, f"replay error {err:.3e} > 2x eager error {err_eager:.3e}"


def test_the_gemm_plan_stays_selectable_and_agrees():
    """codegen.fused_projections = False puts the same call on the plan with cuBLAS GEMMs (benchmarks compare the
    two); both stay within 2x eager's error."""
    t = make(torch.bfloat16, "full", "layer", "add", B=4, Lq=1, Lk=1500)
    check_fused(t, "layer")
    codegen.fused_projections = False
    try:
        check(t, "layer")
        assert FUSED not in launch.last_launched
    finally:
        codegen.fused_projections = True
