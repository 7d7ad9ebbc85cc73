"""The generated kernel against a float64 reference on a CUDA GPU (skipped cleanly without one).

Every check draws fresh random inputs, poisons the output with NaN before the launch, and requires the fused
result's relative L2 error to stay within 2x eager PyTorch's error in the same dtype (eager = norm + SDPA + add).
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import fusednorm  # noqa: E402
from fusednorm import codegen  # noqa: E402
from fusednorm.codegen import cache, launch, select  # noqa: E402
from fusednorm.codegen.spec import (HEAD_DIMS, TILE_ROLES, WGMMA_HEAD_DIMS, WGMMA_ROLES, KernelSpec,  # noqa: E402
                                    tile_for)
from fusednorm.reference import reference_pre_norm_cross_attn  # noqa: E402
from kernel_specs import (FEW_KEYS_TWIN_CASES, MASKS, NORMS, TWIN_CASES, copy_twin_tiles, family_specs,  # noqa: E402
                          kernel_test_specs, tile_sets, tiles_of)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
Q_LENS = (1, 3, 127, 129)
K_LENS = (1, 77, 1500)
DEV = "cuda"


@pytest.fixture(autouse=True)
def poisoned_outputs():
    codegen.poison_outputs = True
    yield
    codegen.poison_outputs = False


def _arch():
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


TILE_SETS = tile_sets(_arch())


@pytest.fixture(params=TILE_SETS)
def tile_set(request, monkeypatch):
    codegen.forget_loaded_kernels()  # families are keyed without the tile choice: drop them when it changes
    monkeypatch.setattr(codegen, "tile_for", tiles_of(request.param))
    yield request.param
    codegen.forget_loaded_kernels()


def _family_specs(dtype, d, norm_variant, mask, mask_f32=False, check=False, tiles=tile_for):
    return family_specs(_arch(), dtype, d, norm_variant, mask, mask_f32, check, tiles)


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """Compile every kernel this file needs up front, in parallel, so the cases themselves only launch (from the
    disk cache where bench/prebuild_kernels.py filled it)."""
    with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        list(pool.map(cache.get_kernel, kernel_test_specs(_arch())))


# ---- inputs, reference, eager ----

def make_inputs(dtype, B, Lq, Lk, H, d, norm_variant="layer_affine", mask="none", gen=None, mask_dtype=None):
    """Random inputs as real models hand them over: k/v are [B, Lk, H, d] tensors viewed as [B, H, Lk, d]."""
    D = H * d
    x = (torch.randn(B, Lq, D, device=DEV, generator=gen) * 1.5 + 0.3).to(dtype)
    k = torch.randn(B, Lk, H, d, device=DEV, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(B, Lk, H, d, device=DEV, generator=gen).to(dtype).transpose(1, 2)
    gamma = beta = None
    if norm_variant in ("layer_affine", "rms"):
        gamma = (1 + 0.2 * torch.randn(D, device=DEV, generator=gen)).to(dtype)
    if norm_variant == "layer_affine":
        beta = (0.1 * torch.randn(D, device=DEV, generator=gen)).to(dtype)
    m = None
    if mask == "bool":  # key padding: each batch item keeps a random prefix of at least one key
        keep = torch.randint(1, Lk + 1, (B,), device=DEV, generator=gen)
        m = (torch.arange(Lk, device=DEV)[None, :] < keep[:, None])[:, None, None, :]
    elif mask == "add":
        m = (torch.randn(B, 1, Lq, Lk, device=DEV, generator=gen) * 2).to(mask_dtype or dtype)
    return x, k, v, gamma, beta, m


def reference64(x, k, v, gamma, beta, mask, norm, eps, scale):
    up = lambda t: None if t is None else (t if t.dtype == torch.bool else t.double())  # noqa: E731
    return reference_pre_norm_cross_attn(up(x), up(k), up(v), up(gamma), up(beta), None, None, None, None,
                                         up(mask), norm, eps, scale)


def eager_block(x, k, v, gamma, beta, mask, norm, eps, scale):
    B, Lq, D = x.shape
    H, d = k.shape[1], k.shape[3]
    if norm == "layer":
        h = F.layer_norm(x, (D,), gamma, beta, eps)
    else:
        h = F.rms_norm(x, (D,), gamma, eps)
    q = h.view(B, Lq, H, d).transpose(1, 2)
    m = mask if mask is None or mask.dtype == torch.bool else mask.to(x.dtype)
    # with a negative scale torch's flash and cuDNN kernels return NaN (fp16 and bf16, H100, torch 2.11:
    # bench/sdpa_backends.py): eager's answer there is the math backend's
    math_only = scale is not None and scale < 0
    with sdpa_kernel(SDPBackend.MATH) if math_only else contextlib.nullcontext():
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)
    return x + a.transpose(1, 2).reshape(B, Lq, D)


def rel_l2(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def fused(x, k, v, gamma, beta, mask, norm, eps=1e-5, scale=None, sm_count=None, check_numerics=False):
    return fusednorm.fused_pre_norm_cross_attn(x, k, v, gamma, beta, eps, sm_count, mask=mask, scale=scale,
                                               norm=norm, check_numerics=check_numerics)


def check_case(dtype, B, Lq, Lk, H, d, norm_variant, mask, gen, scale=None, mask_dtype=None):
    norm = "rms" if norm_variant == "rms" else "layer"
    eps = 1e-6 if norm == "rms" else 1e-5
    x, k, v, gamma, beta, m = make_inputs(dtype, B, Lq, Lk, H, d, norm_variant, mask, gen, mask_dtype)
    before = launch.launch_count
    y = fused(x, k, v, gamma, beta, m, norm, eps, scale)
    assert launch.launch_count == before + 1, "the generated kernel did not run"
    ref = reference64(x, k, v, gamma, beta, m, norm, eps, scale)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all(), "unwritten (poisoned) or non-finite output"
    err = rel_l2(y, ref)
    err_eager = rel_l2(eager_block(x, k, v, gamma, beta, m, norm, eps, scale), ref)
    assert err <= 2 * err_eager + 1e-7, f"fused error {err:.3e} > 2x eager error {err_eager:.3e}"
    return err, err_eager


# ---- the grid: dtype x head dim x norm x mask, each with odd lengths and non-contiguous k/v ----

_LENGTHS = list(itertools.product(Q_LENS, K_LENS))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_grid(dtype, d, tile_set):
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    for i, (norm_variant, mask) in enumerate(itertools.product(NORMS, MASKS)):
        Lq, Lk = _LENGTHS[(i + HEAD_DIMS.index(d)) % len(_LENGTHS)]
        H = 3 if d <= 64 else 2
        check_case(DTYPES[dtype], 2, Lq, Lk, H, d, norm_variant, mask, gen)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_odd_length_pair(dtype):
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    for Lq, Lk in _LENGTHS:
        check_case(DTYPES[dtype], 2, Lq, Lk, 4, 64, "layer_affine", "bool", gen)


@pytest.mark.parametrize("role", TILE_ROLES)
def test_each_tile_role_on_every_head_dim(role, monkeypatch, tile_set):
    monkeypatch.setattr(select, "force_role", role)
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    Lk = 300 if role != "few_keys" else 77  # few_keys takes at most 80 keys (more fall back to base)
    for d in HEAD_DIMS:
        for mask in ("none", "add"):
            check_case(torch.bfloat16, 2, 77, Lk, 2, d, "layer_affine", mask, gen)
            wgmma = tile_set == "native" and _arch() == 90 and d in WGMMA_HEAD_DIMS and role in WGMMA_ROLES
            assert launch.last_launched.endswith(("wg_sm90", "wgtma_sm90", "wgtmaws_sm90")) == wgmma, \
                launch.last_launched
    if role == "few_keys":  # every key count up to the stage, including a full one (no edge n-tile)
        for Lk in (1, 15, 16, 17, 64, 79, 80):
            for d in (64, 40):  # d = 40: QK^T's last k-step of 8 columns (and on sm_90 unpadded bulk-copied rows)
                check_case(torch.float16, 3, 130, Lk, 3, d, "rms", "bool", gen)


def test_model_shapes_and_custom_scale():
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    check_case(torch.bfloat16, 4, 1, 1500, 20, 64, "layer_affine", "none", gen)        # whisper decode
    check_case(torch.bfloat16, 2, 448, 1500, 20, 64, "layer_affine", "none", gen)      # whisper prefill
    check_case(torch.bfloat16, 2, 1024, 77, 8, 40, "layer_affine", "none", gen)        # SD 1.5
    check_case(torch.float16, 2, 128, 512, 16, 64, "rms", "add", gen, scale=1.0)       # T5 (no scaling)
    check_case(torch.bfloat16, 2, 64, 100, 4, 64, "layer_affine", "add", gen, scale=-0.3)
    check_case(torch.bfloat16, 2, 129, 77, 4, 64, "layer_affine", "add", gen, mask_dtype=torch.float32)


@pytest.mark.parametrize("dtype,mean_over_std", [("bf16", 3.5), ("fp16", 3.5), ("bf16", 30.0), ("fp16", 300.0),
                                                  ("bf16", float("inf"))])
@pytest.mark.parametrize("Lq", [1, 130])  # the short role (its warps split the statistics) and few_keys
def test_large_mean_does_not_cancel(dtype, mean_over_std, Lq):
    """|mean| >> std: a one-pass E[x^2] - E[x]^2 in fp32 loses most digits at 300 std. The kernel's tensor-core sums
    decide rows up to |mean| = 4 std (3.5 here) and hand the others (30, 300, constant rows) to its exact pass.
    Compared on the update y - x, which the rounding of y at |x| >> 1 would otherwise hide."""
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    x, k, v, g, b, _ = make_inputs(DTYPES[dtype], 2, Lq, 77, 4, 64, gen=gen)
    z = torch.randn(x.shape, device=DEV, generator=gen, dtype=torch.float64)
    z = (z - z.mean(-1, keepdim=True)) / z.std(-1, keepdim=True, unbiased=False)
    x = (z + mean_over_std if mean_over_std != float("inf") else torch.full_like(z, 300.0)).to(DTYPES[dtype])
    y = fused(x, k, v, g, b, None, "layer")
    ref = reference64(x, k, v, g, b, None, "layer", 1e-5, None) - x.double()
    eager = eager_block(x, k, v, g, b, None, "layer", 1e-5, None)
    err, err_eager = rel_l2(y - x.double(), ref), rel_l2(eager - x.double(), ref)
    assert err <= 2 * err_eager + 1e-7, f"fused error {err:.3e} > 2x eager error {err_eager:.3e}"


def test_fully_masked_rows_give_zero_attention():
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    for dtype, Lq, Lk in ((torch.bfloat16, 33, 77), (torch.float16, 1, 1500), (torch.bfloat16, 129, 1)):
        x, k, v, g, b, _ = make_inputs(dtype, 2, Lq, Lk, 4, 64, gen=gen)
        keep = torch.rand(2, 1, Lq, Lk, device=DEV, generator=gen) > 0.5
        keep[:, :, ::2, :] = False  # even query rows see no key at all
        keep[:, :, 1::2, 0] = True
        y = fused(x, k, v, g, b, keep, "layer")
        assert torch.equal(y[:, ::2], x[:, ::2]), "fully masked rows must give o = 0, so y = x"
        ref = reference64(x, k, v, g, b, keep, "layer", 1e-5, None)
        assert rel_l2(y, ref) < 1e-2
        additive = torch.zeros(2, 1, Lq, Lk, device=DEV, dtype=dtype).masked_fill(~keep, float("-inf"))
        assert torch.equal(fused(x, k, v, g, b, additive, "layer")[:, ::2], x[:, ::2])


def test_check_numerics_raises_on_nan_and_inf_only():
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    x, k, v, g, b, _ = make_inputs(torch.bfloat16, 2, 129, 77, 4, 64, gen=gen)
    fused(x, k, v, g, b, None, "layer", check_numerics=True)  # clean input: quiet
    bad_x = x.clone()
    bad_x[1, 100, 7] = float("nan")
    with pytest.raises(fusednorm.FusedNormNumericsError, match="pre_norm_cross_attn"):
        fused(bad_x, k, v, g, b, None, "layer", check_numerics=True)
    bad_v = v.clone()
    bad_v[0, 2, 5, 3] = float("inf")
    with pytest.raises(fusednorm.FusedNormNumericsError):
        fused(x, k, bad_v, g, b, None, "layer", check_numerics=True)
    fused(x, k, v, g, b, None, "layer", check_numerics=True)  # the flag was reset: quiet again
    y = fused(bad_x, k, v, g, b, None, "layer")  # off by default: no raise, the NaN is just there
    assert torch.isnan(y).any()


def test_sm_count_gives_bit_identical_results():
    """Fewer CTAs, each working through more items: the same bits. d = 40's decode is the case where a CTA's stage
    holds the key split's merged partials before its next item's keys (which once met stale pad columns there)."""
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    for d, Lq, Lk in ((64, 300, 77), (64, 1, 1500), (64, 200, 600), (40, 1, 1500), (40, 3, 300)):
        for dtype in (torch.bfloat16, torch.float16) if d == 40 else (torch.bfloat16,):
            x, k, v, g, b, m = make_inputs(dtype, 3, Lq, Lk, 8, d, mask="bool", gen=gen)
            outs = [fused(x, k, v, g, b, m, "layer", sm_count=s) for s in (None, 1, 3, 17)]
            assert torch.isfinite(outs[0]).all(), (d, Lq, Lk, dtype)
            for o in outs[1:]:
                assert torch.equal(o, outs[0]), (d, Lq, Lk, dtype)


def _launched_statistics(monkeypatch):
    """Record (column groups, shared) of every launch: the tail's Params.stat_col_groups and share_stats."""
    seen, real = [], codegen._launch.launch

    def launch_and_record(kernel, grid, stream, pointers, tail, maps=b""):
        seen.append(tuple(tail[-6:-4]))
        return real(kernel, grid, stream, pointers, tail, maps)

    monkeypatch.setattr(codegen._launch, "launch", launch_and_record)
    return seen


@pytest.mark.parametrize("role", ["base", "long"])
@pytest.mark.parametrize("mean_over_std", [0.2, 30.0])
def test_statistics_shared_between_head_groups_give_the_bits_each_item_sums_alone(role, mean_over_std,
                                                                                  monkeypatch):
    """D = 1024 in 16 heads, few enough items to run at once: each block of rows is split between head groups whose
    items sum one column group each and share the sums (statistics.cu). Against float64; and bit for bit against
    smaller grids, where each item sums every group itself; |mean| = 30 std sends rows to the exact pass."""
    tile = tile_for(role, 64, _arch())
    if tile.m_tiles != 1 or tile.key_split != 1:
        pytest.skip(f"{role}'s tile on sm_{_arch()} has warps of {tile.m_tiles} m-tiles: one pass per row")
    monkeypatch.setattr(select, "force_role", role)
    seen = _launched_statistics(monkeypatch)
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    x, k, v, g, b, m = make_inputs(torch.bfloat16, 3, 130, 300, 16, 64, mask="bool", gen=gen)
    if mean_over_std > 1:
        z = x.double()
        x = ((z - z.mean(-1, keepdim=True)) / z.std(-1, keepdim=True, unbiased=False) + mean_over_std).bfloat16()
    y = fused(x, k, v, g, b, m, "layer")
    assert len(seen) == 1 and seen[0][0] > 1 and seen[0][1] == 1, (seen, launch.last_launched)
    ref = reference64(x, k, v, g, b, m, "layer", 1e-5, None) - x.double()
    err = rel_l2(y - x.double(), ref)
    err_eager = rel_l2(eager_block(x, k, v, g, b, m, "layer", 1e-5, None) - x.double(), ref)
    assert err <= 2 * err_eager + 1e-7, f"fused error {err:.3e} > 2x eager error {err_eager:.3e}"
    for sm_count in (1, 5, 17):
        assert torch.equal(fused(x, k, v, g, b, m, "layer", sm_count=sm_count), y), (sm_count, seen[-1])
    assert all(groups == seen[0][0] for groups, _ in seen) and not any(shared for _, shared in seen[1:])


def test_shared_statistics_never_wait_for_an_item_that_is_not_running(monkeypatch):
    """Sharing told to a grid too small to run every item at once: an item's partners come later on the same
    CTAs, so it waits a bounded time and sums their groups itself. It finishes, with the same bits."""
    monkeypatch.setattr(select, "force_heads_per_item", 1)  # 16 groups whatever the grid
    real_plan = select.plan_launch

    def plan_sharing_anyway(*args, **kwargs):
        p = real_plan(*args, **kwargs)
        return dataclasses.replace(p, share_stats=p.stat_col_groups == p.head_groups > 1)

    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    x, k, v, g, b, m = make_inputs(torch.bfloat16, 2, 128, 300, 16, 64, gen=gen)  # not the one-tile kernel
    seen = _launched_statistics(monkeypatch)
    y = fused(x, k, v, g, b, m, "layer")
    monkeypatch.setattr(select, "plan_launch", plan_sharing_anyway)
    codegen.call_plans.clear()
    codegen._plans.clear()
    late = fused(x, k, v, g, b, m, "layer", sm_count=1)
    assert seen[0] == (16, 1) and seen[-1] == (16, 1), seen
    assert torch.equal(late, y)


def test_shared_statistics_launched_on_two_streams_at_once_keep_their_bits(monkeypatch):
    """The counters that share the statistics are kept per stream (codegen._zeroed_tickets): launches on one stream
    run one after another and leave them zero, launches on two streams may overlap and use their own. Twenty
    launches alternating between two streams, none waited for, each equal to the bits of a lone launch."""
    seen = _launched_statistics(monkeypatch)
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    x, k, v, g, b, m = make_inputs(torch.bfloat16, 3, 130, 300, 16, 64, gen=gen)
    y = fused(x, k, v, g, b, m, "layer")
    assert seen[0][0] > 1 and seen[0][1] == 1, seen
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for i in range(20):
        with torch.cuda.stream(streams[i % 2]):
            outs.append(fused(x, k, v, g, b, m, "layer"))
    torch.cuda.synchronize()
    assert all(torch.equal(o, y) for o in outs)
    assert len({key for key in codegen._tickets if key[1] in {s.cuda_stream for s in streams}}) == 2


@pytest.mark.parametrize("role", TILE_ROLES)
def test_every_tile_role_gives_the_same_bits_when_each_cta_works_through_many_items(role, monkeypatch, tile_set):
    """sm_count=1: a grid of one SM's CTAs, each running many items, heads and key tiles one after another, so
    whatever one item leaves in shared memory (stages, x slots, statistics, merge buffers) meets the next; the
    bits must be those of the default grid, where most CTAs run one item. Partial last row blocks and key tiles."""
    monkeypatch.setattr(select, "force_role", role)
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    Lq, Lk = (77, 77) if role == "few_keys" else ((3, 300) if role == "short" else (77, 300))
    for d in HEAD_DIMS:
        for dtype in (torch.bfloat16, torch.float16) if d % 16 else (torch.bfloat16,):
            x, k, v, g, b, m = make_inputs(dtype, 5, Lq, Lk, 3 if d <= 64 else 2, d, mask="bool", gen=gen)
            wide, narrow = (fused(x, k, v, g, b, m, "layer", sm_count=s) for s in (None, 1))
            assert torch.isfinite(wide).all() and torch.equal(narrow, wide), (role, d, dtype, launch.last_launched)
    if role == "short":  # each head's keys in 3 runs: one CTA then takes several runs of one head, and their tickets
        monkeypatch.setattr(select, "force_kv_chunks", 3)
        for d in (40, 64):
            x, k, v, g, b, m = make_inputs(torch.bfloat16, 2, 1, 700, 3, d, mask="bool", gen=gen)
            wide, narrow = (fused(x, k, v, g, b, m, "layer", sm_count=s) for s in (None, 1))
            ref = reference64(x, k, v, g, b, m, "layer", 1e-5, None)
            assert rel_l2(wide, ref) <= 2 * rel_l2(eager_block(x, k, v, g, b, m, "layer", 1e-5, None), ref) + 1e-7
            assert torch.equal(narrow, wide), d


def test_decode_at_small_batch_splits_keys_between_ctas():
    """Few (batch, head) pairs: each pair's keys run on several CTAs, the last merges them. Against float64 at batch
    1..16, with key padding that leaves whole runs masked, rows masked throughout, additive -inf, repeated calls and
    graph replays (the tickets must come back to zero), and the numerics flag raised from one run's keys."""
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B, H, Lk in ((1, 20, 1500), (2, 8, 1500), (4, 20, 1500), (16, 20, 1500), (1, 12, 4000)):
        tile = codegen.tile_for("short", 64, _arch())
        plan = select.plan_launch("short", tile, B, 1, Lk, H, 64, sms, 2)
        if B * H * 4 <= sms:
            assert plan.kv_chunks > 1, plan
        for mask in ("none", "bool", "add"):
            check_case(torch.bfloat16, B, 1, Lk, H, 64, "layer_affine", mask, gen)
        x, k, v, g, b, _ = make_inputs(torch.float16, B, 1, Lk, H, 64, gen=gen)
        keep = torch.zeros(B, 1, 1, Lk, dtype=torch.bool, device=DEV)
        keep[..., -100:] = True  # only the last run sees keys
        y = fused(x, k, v, g, b, keep, "layer")
        ref = reference64(x, k, v, g, b, keep, "layer", 1e-5, None)
        assert rel_l2(y, ref) <= 2 * rel_l2(eager_block(x, k, v, g, b, keep, "layer", 1e-5, None), ref) + 1e-7
        assert torch.equal(fused(x, k, v, g, b, keep, "layer"), y)  # the same bits on the next call
        none = torch.zeros_like(keep)
        assert torch.equal(fused(x, k, v, g, b, none, "layer"), x)  # every key masked: y = x
        additive = torch.zeros(B, 1, 1, Lk, device=DEV, dtype=x.dtype).masked_fill(~keep, float("-inf"))
        assert rel_l2(fused(x, k, v, g, b, additive, "layer"), ref) < 1e-2
    codegen.poison_outputs = False
    x, k, v, g, b, _ = make_inputs(torch.bfloat16, 1, 1, 1500, 20, 64, gen=gen)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(x, k, v, g, b, None, "layer")
    for _ in range(2):
        x.copy_(torch.randn(x.shape, device=DEV, generator=gen).to(x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused(x, k, v, g, b, None, "layer"))
    bad_v = v.clone()
    bad_v[0, 3, 700, 5] = float("nan")  # in a middle run of keys
    with pytest.raises(fusednorm.FusedNormNumericsError):
        fused(x, k, bad_v, g, b, None, "layer", check_numerics=True)
    fused(x, k, v, g, b, None, "layer", check_numerics=True)


def test_layouts_that_need_a_copy_still_compute_right():
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    x, k, v, g, b, _ = make_inputs(torch.bfloat16, 2, 65, 77, 4, 64, gen=gen)
    x_nc = torch.empty(2, 65, 512, device=DEV, dtype=x.dtype)[:, :, ::2]
    x_nc.copy_(x)
    k_nc = torch.empty(2, 4, 77, 128, device=DEV, dtype=k.dtype)[..., ::2]  # last-dim stride 2
    k_nc.copy_(k)
    with pytest.warns(fusednorm.FusedNormWarning):
        y = fused(x_nc, k_nc, v, g, b, None, "layer")
    ref = reference64(x, k, v, g, b, None, "layer", 1e-5, None)
    assert rel_l2(y, ref) <= 2 * rel_l2(eager_block(x, k, v, g, b, None, "layer", 1e-5, None), ref) + 1e-7
    g32 = g.float()  # fp32 norm parameters with bf16 activations
    y32 = fused(x, k, v, g32, b.float(), None, "layer")
    ref32 = reference64(x, k, v, g32, b.float(), None, "layer", 1e-5, None)
    assert rel_l2(y32, ref32) < 1e-2


def test_float32_runs_the_reference_with_a_warning():
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    x, k, v, g, b, _ = make_inputs(torch.float32, 2, 5, 7, 2, 64, gen=gen)
    assert "float32" in codegen.why_no_kernel(x, k, v, g, b, None, "layer")
    before = launch.launch_count
    y = fused(x, k, v, g, b, None, "layer")
    assert launch.launch_count == before
    assert rel_l2(y, reference64(x, k, v, g, b, None, "layer", 1e-5, None)) < 1e-5


@pytest.mark.parametrize("B,Lq,Lk", [(2, 5, 0), (0, 5, 7), (2, 0, 7)], ids=["no keys", "batch 0", "no queries"])
def test_empty_inputs_run_the_reference(B, Lq, Lk):
    """No kernel launch for an empty input; with no keys every row attends to nothing: y = x exactly."""
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    x, k, v, g, b, _ = make_inputs(torch.bfloat16, B, Lq, Lk, 2, 64, gen=gen)
    assert codegen.why_no_kernel(x, k, v, g, b, None, "layer") == "an input is empty"
    before = launch.launch_count
    y = fused(x, k, v, g, b, None, "layer")
    assert launch.launch_count == before and y.shape == x.shape
    if y.numel():
        assert torch.equal(y, x)


def test_works_under_cuda_graph_capture():
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    codegen.poison_outputs = False
    x, k, v, g, b, _ = make_inputs(torch.bfloat16, 2, 200, 77, 8, 64, gen=gen)
    expected = fused(x, k, v, g, b, None, "layer")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(x, k, v, g, b, None, "layer")
    x.copy_(torch.randn(x.shape, device=DEV, generator=gen).to(x.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused(x, k, v, g, b, None, "layer"))
    assert not torch.equal(out, expected)


@pytest.mark.parametrize("Lk", [77, 300])
def test_a_programmatic_launch_waits_for_the_kernel_before_it(Lk, monkeypatch):
    """On sm_90 the kernel may start while the kernel before it in the stream ends (launch.programmatic_launch), so
    it must wait for that kernel before it reads its input or writes its output. Here the kernel right before
    writes x, and the one before that reads the memory y is then given; both behind a GPU spin, so that every
    launch is queued before the first runs. The bits must be those of a launch after a synchronize, the sums read
    must be whole, and a launch without the attribute gives the same bits."""
    codegen.poison_outputs = False  # a fill of y would be the kernel right before
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    x, k, v, g, b, m = make_inputs(torch.bfloat16, 4, 300, Lk, 16, 64, mask="bool", gen=gen)
    expected = fused(x, k, v, g, b, m, "layer")
    torch.cuda.synchronize()
    tried, real = [], launch._launch_programmatic
    monkeypatch.setattr(launch, "_launch_programmatic", lambda *a: tried.append(real(*a)) or tried[-1])
    for _ in range(3):
        freed = torch.randn(expected.shape, device=DEV, generator=gen).to(expected.dtype)
        whole = torch.sum(freed, dtype=torch.float32)
        late_x = torch.full_like(x, float("nan"))
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)
        total = torch.sum(freed, dtype=torch.float32)  # reads the block that y is likely to get
        del freed
        late_x.copy_(x)
        y = fused(late_x, k, v, g, b, m, "layer")
        assert torch.equal(y, expected) and torch.equal(total, whole)
    if _arch() >= launch.PROGRAMMATIC_MIN_ARCH:
        assert tried and all(tried), "the programmatic launch did not run"
    monkeypatch.setattr(launch, "programmatic_launch", False)
    assert torch.equal(fused(x, k, v, g, b, m, "layer"), expected)


@pytest.mark.parametrize("role", ["few_keys", "base", "long"])
@pytest.mark.parametrize("d", [64, 128])
def test_operand_layouts(role, d, monkeypatch, tile_set):
    """Each matmul on its own, with inputs that make the other one trivial (a layout slip in one shows here by
    name): K = 0 makes P uniform, so o is the mean of V's rows (P V alone); V = I makes o the softmax row itself
    (Q K^T alone). Max error on y - x within 2x eager's (+ y's rounding)."""
    monkeypatch.setattr(select, "force_role", role)
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    Lk = 77 if role == "few_keys" else d  # V = I needs Lk = d; few_keys takes at most 80 keys
    x, k, v, g, b, _ = make_inputs(torch.bfloat16, 2, 130, Lk, 2, d, gen=gen)
    mean_v = v.double().mean(2).unsqueeze(2).expand(2, 2, 130, d).transpose(1, 2).reshape(2, 130, 2 * d)
    eye = torch.eye(d, device=DEV, dtype=torch.bfloat16).expand(2, 2, d, d)
    checks = [("P V", torch.zeros_like(k), v, mean_v)]
    if role != "few_keys":
        checks.append(("Q K^T", k, eye, reference64(x, k, eye, g, b, None, "layer", 1e-5, None) - x.double()))
    for what, kk, vv, want in checks:
        err = (fused(x, kk, vv, g, b, None, "layer").double() - x.double() - want).abs().max().item()
        err_eager = (eager_block(x, kk, vv, g, b, None, "layer", 1e-5, None).double() - x.double() - want).abs().max()
        assert err <= 2 * err_eager.item() + 1e-3, f"{what}: max error {err:.3e}, eager {err_eager:.3e}"


@pytest.mark.skipif(_arch() != 90, reason="bulk tensor copies fill sm_90 stages only")
@pytest.mark.parametrize("role", ["few_keys", "long", "many_keys", "many_keys_fine", "base"])
def test_bulk_copy_stages_match_the_16_byte_copies_bit_for_bit(role, monkeypatch):
    """The TMA-filled stages of the sm_90 wgmma tiles, and of d = 40's few-key tile (unpadded rows, mma.sync), give
    exactly what their 16-byte-copy twins give (same math in the same order): odd lengths, several batches (rows
    and keys past the ends must arrive as zeros, not as the next batch's or head's), k/v as transposed views, each
    mask kind, the head dims the tiles take."""
    monkeypatch.setattr(select, "force_role", role)
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    lengths = ((3, 129, 77), (2, 1, 1), (2, 300, 80), (1, 127, 33))
    if role != "few_keys":  # several key tiles per head, the last one partial
        lengths += ((2, 70, 300), (1, 200, 1500))
    dims = TWIN_CASES + (FEW_KEYS_TWIN_CASES if role == "few_keys" else ())
    for d, mask in dims:
        cases = [make_inputs(torch.bfloat16, B, Lq, Lk, 4, d, "layer_affine", mask, gen) for B, Lq, Lk in lengths]
        outs = {}
        for name, tiles in (("tma", tile_for), ("copies", copy_twin_tiles)):
            monkeypatch.setattr(codegen, "tile_for", tiles)
            codegen.forget_loaded_kernels()
            outs[name] = [fused(*c, "layer") for c in cases]
            assert launch.last_launched.endswith(("tma_sm90", "tmaws_sm90")) == (name == "tma"), launch.last_launched
        for c, a, b in zip(cases, outs["tma"], outs["copies"]):
            assert torch.isfinite(a).all()
            assert torch.equal(a, b), f"d {d}, mask {mask}, x {tuple(c[0].shape)}, Lk {c[1].shape[2]}"
    codegen.forget_loaded_kernels()


@pytest.mark.skipif(_arch() != 90, reason="the warp-specialised kernel runs on sm_90")
def test_warp_specialised_kernel_runs_long_keys_without_a_mask():
    """From MANY_KEYS keys on, d = 64 without a mask runs kernel_ws.cu (a producer warpgroup filling the stages for
    two consumer warpgroups), in 96-key stages (the many_keys_fine tile) wherever they pad Lk no further than
    128-key ones. Against float64: each norm form and dtype, odd lengths (a consumer warpgroup wholly past Lq at
    Lq 129, a last key tile of one key at Lk 1057, of 98 keys in 128-key stages at Lk 1250), k/v as transposed views
    and broadcast over batch, fp32 norm parameters, a negative scale; sm_count=1 (one CTA per SM working through
    every item, the rings' phases wrapping many times) gives the same bits; the numerics flag fires on an injected
    NaN."""
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    cases = ((torch.bfloat16, 2, 129, 1057, 4, "layer_affine", None), (torch.float16, 1, 448, 1500, 6, "rms", None),
             (torch.bfloat16, 3, 200, 2048, 2, "layer_plain", None), (torch.float16, 2, 130, 1250, 3, "layer_affine",
                                                                        -0.05))
    for dtype, B, Lq, Lk, H, norm_variant, scale in cases:
        check_case(dtype, B, Lq, Lk, H, 64, norm_variant, "none", gen, scale=scale)
        fine = -(-Lk // 96) * 96 <= -(-Lk // 128) * 128
        stages = "x96w8s4wgtmaws_sm90" if fine else "x128w8s3wgtmaws_sm90"
        assert launch.last_launched.endswith(stages), launch.last_launched
    x, k, v, g, b, _ = make_inputs(torch.bfloat16, 3, 257, 1100, 5, 64, gen=gen)
    k = k[:1].expand(3, -1, -1, -1)  # one batch's keys for all three
    g32, b32 = g.float(), b.float()
    ref = reference64(x, k, v, g32, b32, None, "layer", 1e-5, None)
    y, y1 = (fused(x, k, v, g32, b32, None, "layer", sm_count=s) for s in (None, 1))
    assert launch.last_launched.endswith("x96w8s4wgtmaws_sm90"), launch.last_launched
    assert rel_l2(y, ref) <= 2 * rel_l2(eager_block(x, k, v, g, b, None, "layer", 1e-5, None), ref) + 1e-7
    assert torch.equal(y, y1)
    bad_v = v.clone()
    bad_v[2, 4, 1099, 5] = float("nan")  # the last key of the last head
    with pytest.raises(fusednorm.FusedNormNumericsError):
        fused(x, k, bad_v, g, b, None, "layer", check_numerics=True)
    fused(x, k, v, g, b, None, "layer", check_numerics=True)  # quiet on clean input


def test_broadcast_kv_is_read_in_place_and_repeated_keys_are_copied():
    """k/v broadcast over batch or heads (one key head for every query head) are read where they lie, with no copy
    and no warning (a tensor map gives the broadcast dim size 1); a key dim with stride 0, which no tensor map
    describes, is copied with a warning. Both against the float64 reference."""
    import warnings

    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    x, k, v, g, b, _ = make_inputs(torch.bfloat16, 3, 130, 77, 4, 64, gen=gen)
    k = k[:1].expand(3, -1, -1, -1)      # one batch's keys for all three: batch stride 0
    v = v[:, :1].expand(-1, 4, -1, -1)   # one value head for all four: head stride 0
    ref = reference64(x, k, v, g, b, None, "layer", 1e-5, None)
    bound = 2 * rel_l2(eager_block(x, k, v, g, b, None, "layer", 1e-5, None), ref) + 1e-7
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusednorm.FusedNormWarning)
        assert rel_l2(fused(x, k, v, g, b, None, "layer"), ref) <= bound
    k1 = k[:, :, :1].expand(-1, -1, 77, -1)  # one key repeated: key stride 0
    ref1 = reference64(x, k1, v, g, b, None, "layer", 1e-5, None)
    bound1 = 2 * rel_l2(eager_block(x, k1, v, g, b, None, "layer", 1e-5, None), ref1) + 1e-7
    if _arch() == 90:
        with pytest.warns(fusednorm.FusedNormWarning, match="tensor map"):
            y1 = fused(x, k1, v, g, b, None, "layer")
    else:
        y1 = fused(x, k1, v, g, b, None, "layer")
    assert rel_l2(y1, ref1) <= bound1


def test_code_rebuilt_under_the_same_key_loads_as_its_own_module(tmp_path, monkeypatch):
    """A benchmark that rebuilds a kernel under the same key (a source edit, another occupancy bound) must launch
    the new code, not the module loaded first for that key; and forget_loaded_kernels must not hand back the old
    compile from memory either."""
    spec = _family_specs("bf16", 64, "layer_affine", "none")[TILE_ROLES.index("few_keys")]
    built = cache.get_kernel(spec, tmp_path)
    first = launch.load(built, 0)
    monkeypatch.setattr(KernelSpec, "min_ctas_per_sm", property(lambda s: 1))  # a looser register bound
    codegen.forget_loaded_kernels()
    rebuilt = cache.get_kernel(spec, tmp_path)
    assert rebuilt.cubin != built.cubin
    second = launch.load(rebuilt, 0)
    assert second.handle != first.handle
    assert second.registers == rebuilt.usage.registers
    assert launch.load(rebuilt, 0) is second  # the same code is still loaded once
