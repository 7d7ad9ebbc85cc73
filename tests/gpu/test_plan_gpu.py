"""The projection plan (plans/) against a float64 reference on a CUDA GPU (skipped cleanly without one).

Every projection variant (Wq and Wo each with or without its bias, Wq alone, Wo alone), LayerNorm and RMSNorm,
no / bool / additive mask, fp16 and bf16; fresh random inputs, outputs poisoned before launch. The error is
taken on the block's update y - x (the residual would hide it) and must stay within 2x eager PyTorch's error in
the same dtype. Also: activations whose mean is large against their spread (where folding the norm into Wq
cancels), weights updated in place (also between replays of a captured CUDA graph), and the compiled model taking
the plan, also replayed as CUDA graphs (option cudagraphs).
"""
from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import fusednorm  # noqa: E402
from fusednorm import codegen  # noqa: E402
from fusednorm.codegen import launch  # noqa: E402
from fusednorm.plans import weights  # noqa: E402
from fusednorm.plans.choose import unfused_block  # noqa: E402
from fusednorm.reference import reference_pre_norm_cross_attn  # noqa: E402
from fusednorm.report import Report  # noqa: E402

DEV = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
VARIANTS = {  # which of wq, bq, wo, bo are present
    "full": (1, 1, 1, 1), "no_biases": (1, 0, 1, 0), "q_bias_only": (1, 1, 1, 0), "o_bias_only": (1, 0, 1, 1),
    "wq_only": (1, 1, 0, 0), "wo_only": (0, 0, 1, 1),
}
OP = torch.ops.fusednorm.pre_norm_cross_attn


@pytest.fixture(autouse=True)
def poisoned_outputs():
    codegen.poison_outputs = True
    yield
    codegen.poison_outputs = False


def make(dtype, variant, norm, mask, B=2, Lq=37, H=4, d=64, Lk=77, mean=0.3, gen=None):
    D = H * d
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    has = dict(zip(("wq", "bq", "wo", "bo"), VARIANTS[variant]))
    t = dict(x=(r(B, Lq, D) * 1.5 + mean).to(dtype),
             k=r(B, Lk, H, d).to(dtype).transpose(1, 2), v=r(B, Lk, H, d).to(dtype).transpose(1, 2),
             gamma=(1 + 0.2 * r(D)).to(dtype), beta=(0.1 * r(D)).to(dtype) if norm == "layer" else None,
             wq=(r(D, D) / D**0.5).to(dtype) if has["wq"] else None, bq=(0.2 * r(D)).to(dtype) if has["bq"] else None,
             wo=(r(D, D) / D**0.5).to(dtype) if has["wo"] else None, bo=(0.2 * r(D)).to(dtype) if has["bo"] else None,
             mask=None)
    if mask == "bool":
        keep = torch.randint(1, Lk + 1, (B,), device=DEV, generator=gen)
        t["mask"] = (torch.arange(Lk, device=DEV)[None, :] < keep[:, None])[:, None, None, :]
    elif mask == "add":
        t["mask"] = (2 * r(B, 1, Lq, Lk)).to(dtype)
    return t


def update_error(y, t, norm, eps):
    """Relative L2 error of y - x against the float64 reference's."""
    up = {n: (None if v is None else (v if v.dtype == torch.bool else v.double())) for n, v in t.items()}
    ref = reference_pre_norm_cross_attn(*up.values(), norm, eps, None) - up["x"]
    return ((y.double() - up["x"] - ref).norm() / ref.norm()).item()


def check(t, norm, eps=1e-5):
    before = launch.launch_count
    y = OP(*t.values(), norm, eps)
    assert launch.launch_count == before + 1, "the plan's attention stage did not run"
    assert y.shape == t["x"].shape and y.dtype == t["x"].dtype and torch.isfinite(y).all()
    err = update_error(y, t, norm, eps)
    err_eager = update_error(unfused_block(**t, norm=norm, eps=eps, scale=None), t, norm, eps)
    assert err <= 2 * err_eager + 1e-6, f"plan error {err:.3e} > 2x eager error {err_eager:.3e}"
    return err, err_eager


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_projection_variant(dtype, variant):
    gen = torch.Generator(device=DEV).manual_seed(hash((dtype, variant)) % 2**31)
    for norm, mask in itertools.product(("layer", "rms"), ("none", "bool", "add")):
        check(make(DTYPES[dtype], variant, norm, mask, gen=gen), norm)


@pytest.mark.parametrize("d,H,Lq,Lk", [(40, 8, 1, 77), (80, 4, 129, 300), (128, 2, 3, 1500), (64, 4, 200, 16),
                                       (160, 2, 70, 77)])
def test_head_dims_and_lengths(d, H, Lq, Lk):
    check(make(torch.bfloat16, "full", "layer", "bool", H=H, d=d, Lq=Lq, Lk=Lk), "layer")


@pytest.mark.parametrize("d,H,B,Lq,mask", [(40, 16, 4, 1100, "none"), (64, 8, 8, 1030, "none"),
                                          (40, 16, 4, 1100, "bool"), (64, 8, 8, 1030, "add")])
def test_stage_takes_the_few_keys_tile_where_its_items_fill_the_gpu(d, H, B, Lq, mask):
    """Up to 80 keys, with 128-row items filling the GPU 4 times over (on 132 SMs: B * ceil(Lq / 128) * H >= 528),
    the stage runs the few_keys tile when that kernel holds 2 CTAs per SM, as it does on sm_90 without a mask (with
    a mask, whichever tile runs is checked the same way)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device=DEV).manual_seed(int(d * Lq))
    t = make(torch.bfloat16, "full", "layer", mask, B=B, Lq=Lq, H=H, d=d, gen=gen)
    check(t, "layer")
    if mask == "none" and B * -(-Lq // 128) * H >= 4 * sms:
        few_keys = next(fam["few_keys"] for fam in codegen._families.values()
                        if (fam["few_keys"].spec.q_from_qraw, fam["few_keys"].spec.head_dim,
                            fam["few_keys"].spec.mask, fam["few_keys"].spec.dtype) == (True, d, "none", "bf16"))
        ran_few_keys = "_qf_wo_t128x80w8one" in launch.last_launched
        assert ran_few_keys == (few_keys.ctas_per_sm >= 2), (launch.last_launched, few_keys.ctas_per_sm)
        if torch.cuda.get_device_capability() == (9, 0):
            assert ran_few_keys


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant,norm,Lq,Lk,mean", [("full", "layer", 200, 1100, 0.3), ("full", "rms", 150, 2048, 0.3),
                                                     ("wq_only", "layer", 200, 1500, 40.0),
                                                     ("wo_only", "rms", 150, 1100, 0.3)])
def test_stage_takes_the_warp_specialised_tile_from_many_keys_on(dtype, variant, norm, Lq, Lk, mean):
    """From 1024 keys on, with d = 64 and no mask, the stage runs the warp-specialised kernel on sm_90 (q from qraw
    and o out, or either alone), in 96-key stages (Lk 1100, 1500) or 128-key ones (Lk 2048). Lq 200 leaves a
    warpgroup of the second row block with 8 rows, Lq 150 one with none; mean 40 is where folding cancels."""
    gen = torch.Generator(device=DEV).manual_seed(Lq * Lk)
    check(make(DTYPES[dtype], variant, norm, "none", B=2, Lq=Lq, H=4, d=64, Lk=Lk, mean=mean, gen=gen), norm)
    if torch.cuda.get_device_capability() == (9, 0):
        tile = "t128x128w8s3wgtmaws" if Lk % 128 == 0 else "t128x96w8s4wgtmaws"
        assert tile in launch.last_launched, launch.last_launched


@pytest.mark.parametrize("mean", [0.3, 40.0])
def test_stage_sums_each_row_whole_where_the_projection_free_kernel_would_share(mean, monkeypatch):
    """D = 1024 in 16 heads, one wave: the projection-free kernel would share its rows' statistics by column groups,
    the plan's stage sums each row whole (KernelSpec.grouped_stats: sharing measured slower there) and copies every
    column of x for the out GEMM (a column left out would show in y)."""
    seen, real = [], codegen._launch.launch

    def launch_and_record(kernel, grid, stream, pointers, tail, maps=b""):
        seen.append(tuple(tail[-6:-4]))
        return real(kernel, grid, stream, pointers, tail, maps)

    monkeypatch.setattr(codegen._launch, "launch", launch_and_record)
    check(make(torch.bfloat16, "full", "layer", "bool", B=3, Lq=130, H=16, d=64, Lk=300, mean=mean), "layer")
    assert seen and seen[-1] == (1, 0), seen


def test_a_model_dim_of_rows_not_whole_16_byte_chunks_runs_the_reference_with_a_warning():
    """D = 204 with Wq [H*d, D]: the stage would read x's rows misaligned; the reference runs instead, warned once."""
    gen = torch.Generator(device=DEV).manual_seed(204)
    t = make(torch.bfloat16, "full", "layer", "none", B=2, Lq=3, H=4, d=64, Lk=50, gen=gen)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    D, Dq = 204, 256
    t.update(x=(r(2, 3, D) * 1.5 + 0.3).bfloat16(), gamma=(1 + 0.2 * r(D)).bfloat16(), beta=(0.1 * r(D)).bfloat16(),
             wq=(r(Dq, D) / D**0.5).bfloat16(), wo=(r(D, Dq) / Dq**0.5).bfloat16(), bo=(0.2 * r(D)).bfloat16())
    before = launch.launch_count
    with pytest.warns(fusednorm.FusedNormWarning, match="model dim 204 is not a multiple of 8"):
        y = OP(*t.values(), "layer", 1e-5)
    torch.cuda.synchronize()
    assert launch.launch_count == before
    err, err_eager = update_error(y, t, "layer", 1e-5), update_error(unfused_block(**t, norm="layer", eps=1e-5,
                                                                                  scale=None), t, "layer", 1e-5)
    assert err <= 2 * err_eager + 1e-6


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_large_mean_against_spread(norm):
    """|mean| >> std: folding the norm into Wq subtracts two large numbers; float32 qraw keeps it within 2x eager."""
    check(make(torch.bfloat16, "full", norm, "none", mean=40.0), norm)


def test_weights_updated_in_place_are_seen():
    t = make(torch.bfloat16, "full", "layer", "none")
    check(t, "layer")
    with torch.no_grad():
        t["wq"].mul_(-1.5)
        t["gamma"].add_(0.5)
        t["bo"].add_(1.0)
    check(t, "layer")  # the folded copies are rebuilt from the new versions


@pytest.mark.parametrize("held", [False, True])
def test_a_captured_plan_follows_weights_updated_in_place_between_replays(held):
    """A replay runs no Python. Unheld, the capture records the fold itself; under GraphWeights.capture() it reads
    the kept folded buffers, which refresh() folds again in place. Either way the replay uses the new weights."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    t = make(torch.bfloat16, "full", "layer", "bool", gen=gen)
    keep = weights.GraphWeights()
    graph = torch.cuda.CUDAGraph()
    with keep.capture() if held else contextlib.nullcontext():
        OP(*t.values(), "layer", 1e-5)  # warm-up: compiles, plans, folds and keeps the weights
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            y = OP(*t.values(), "layer", 1e-5)
    assert len(keep) == (1 if held else 0)
    for _ in range(2):
        with torch.no_grad():
            t["wq"].mul_(-1.5)
            t["gamma"].add_(0.25)
            t["bo"].add_(0.5)
            t["x"].copy_(torch.randn(t["x"].shape, device=DEV, generator=gen))
        keep.refresh()
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = update_error(y, t, "layer", 1e-5)
        err_eager = update_error(unfused_block(**t, norm="layer", eps=1e-5, scale=None), t, "layer", 1e-5)
        assert err <= 2 * err_eager + 1e-6, f"replay error {err:.3e} > 2x eager error {err_eager:.3e}"


def test_kept_folded_weights_never_come_from_a_graph_pool():
    """A CUDA-graph warm-up routes its thread's allocations to the graph's private pool, which may hand that memory
    to a later recording: the folded weights kept across calls must be allocated outside it."""
    t = make(torch.bfloat16, "full", "layer", "none")
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        folded = weights.fold_weights("layer", t["gamma"], t["beta"], t["wq"], t["bq"], t["wo"], t["bo"],
                                      torch.bfloat16)
        control = torch.empty(4096, device=DEV)  # an ordinary allocation here lands in the pool
    segments = [(seg["address"], seg["address"] + seg["total_size"]) for seg in pool.snapshot()]

    def in_pool(tensor):
        return any(lo <= tensor.data_ptr() < hi for lo, hi in segments)

    assert in_pool(control)
    assert not any(in_pool(kept) for kept in folded.tensors() if kept is not None)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_repeated_signature_takes_the_cached_launch_with_new_values(variant):
    """The second and third calls share the first one's signature (dispatch.call_key): they skip the checks and
    the stage's planning, and must still read their own x, k, v, mask and (folded again) weights."""
    gen = torch.Generator(device=DEV).manual_seed(7)
    check(make(torch.bfloat16, variant, "layer", "bool", gen=gen), "layer")
    cached = len(codegen.call_plans)
    for _ in range(2):
        check(make(torch.bfloat16, variant, "layer", "bool", gen=gen), "layer")
    assert len(codegen.call_plans) == cached, "a repeated signature was planned again"


def decoder_layer(B, Lq, Lk=77, D=256, H=4):
    """A bf16 nn.TransformerDecoderLayer(norm_first=True) on the GPU and fresh (tgt, memory) for it."""
    layer = nn.TransformerDecoderLayer(D, H, 2 * D, dropout=0.0, batch_first=True, norm_first=True)
    inputs = (torch.randn(B, Lq, D, device=DEV, dtype=torch.bfloat16),
              torch.randn(B, Lk, D, device=DEV, dtype=torch.bfloat16))
    return layer.to(DEV, torch.bfloat16).eval(), inputs


def compile_and_run(layer, inputs, plan=None):
    report = Report()
    options = {"report": report} if plan is None else {"report": report, "plan": plan}
    with torch.no_grad():
        out = torch.compile(layer, backend="fusednorm", options=options)(*inputs)
    return out, report


def test_compiled_decoder_layer_takes_the_plan():
    """nn.TransformerDecoderLayer(norm_first=True) in bf16: the cross-attention block runs as the plan."""
    torch.manual_seed(0)
    layer, inputs = decoder_layer(2, 64)
    with torch.no_grad():
        want = layer(*inputs)
    before = launch.launch_count
    got, report = compile_and_run(layer, inputs, "always")
    assert len(report.matches) == 1 and report.matches[0].runs.startswith("CUDA projection plan")
    assert launch.launch_count > before
    assert torch.isfinite(got).all()
    assert ((got.double() - want.double()).norm() / want.double().norm()).item() < 2e-2


def test_measured_choice_is_reported():
    """plan='measure': the report carries the measured times, whichever way the choice went; the compiler was timed
    on the block's own nodes (passes/block_graph.py), not on the canonical block."""
    _, report = compile_and_run(*decoder_layer(4, 256), "measure")
    texts = [m.runs for m in report.matches] + [n.reason for n in report.near_misses]
    assert any("measured plan" in s and "host per call" in s for s in texts), texts
    assert not any("on the canonical block" in s or "op alone" in s for s in texts), texts


def test_with_cudagraphs_the_default_measures_the_plan_on_gpu_time():
    """options={"cudagraphs": True} and no plan option: the block is measured, the plan (with the nodes the rewrite
    emits beside it) against the block's own nodes, and GPU time alone decides; the result matches eager."""
    torch.manual_seed(0)
    layer, inputs = decoder_layer(4, 256)
    report = Report()
    with torch.no_grad():
        want = layer(*inputs)
        got = torch.compile(layer, backend="fusednorm", options={"report": report, "cudagraphs": True})(*inputs)
    texts = [m.runs for m in report.matches] + [n.reason for n in report.near_misses]
    assert any("measured plan" in s and "host time not counted" in s for s in texts), texts
    assert not any("canonical block" in s or "op alone" in s for s in texts), texts
    assert ((got.double() - want.double()).norm() / want.double().norm()).item() < 2e-2


def test_by_default_blocks_with_projections_stay_with_the_compiler():
    layer, inputs = decoder_layer(2, 64)
    before = launch.launch_count
    _, report = compile_and_run(layer, inputs)  # no plan option
    assert report.matches == [] and launch.launch_count == before
    assert any("plan='never'" in n.reason for n in report.near_misses)


@pytest.mark.parametrize("compiler", ["inductor", "eager"])
def test_compiled_with_cudagraphs_the_plan_is_replayed_and_follows_weight_updates(compiler):
    """options={"cudagraphs": True}: the graph is captured (no cudagraph skips) with the plan in it, replays take
    fresh inputs, and an in-place update of the block's weights between calls reaches the replay."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    torch.manual_seed(0)
    layer, (tgt, memory) = decoder_layer(2, 64)
    report = Report()
    compiled = torch.compile(layer, backend="fusednorm", options={
        "report": report, "plan": "always", "cudagraphs": True, "compiler": compiler})
    counters.clear()
    with torch.no_grad():
        for step in range(5):  # warm-up, record, replays
            if step == 3:
                layer.multihead_attn.in_proj_weight.mul_(0.5)   # its first D rows are the block's Wq
                layer.norm2.weight.add_(0.3)                   # the block's norm: folded into Wq
                layer.multihead_attn.out_proj.bias.add_(0.2)
            tgt, memory = torch.randn_like(tgt), torch.randn_like(memory)
            want = layer(tgt, memory)
            got = compiled(tgt, memory)
            rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
            assert torch.isfinite(got).all() and rel < 2e-2, f"call {step}: relative error {rel:.3e}"
    assert len(report.matches) == 1 and report.matches[0].runs.startswith("CUDA projection plan")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and manager.roots, "nothing was recorded as a CUDA graph"
