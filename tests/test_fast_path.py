"""The eager call's signature cache, on CPU: the CUDA pieces (device, capability, kernels, launch) are faked.

A call whose signature already ran the generated kernel must skip the checks and the planning and launch with
its own pointers; any other call (new signature, bad input, fallback, input needing a copy) takes the full path.
"""
from __future__ import annotations

import ctypes
import threading
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fusednorm
from fusednorm import codegen, dispatch, op, plans
from fusednorm.codegen import launch, select
from fusednorm.codegen.spec import TILE_ROLES, KernelSpec, tile_for
from fusednorm.reference import reference_pre_norm_cross_attn

pytestmark = pytest.mark.filterwarnings("ignore::fusednorm.FusedNormWarning")

BF16 = torch.bfloat16


class FakeGPU:
    """Counts what the full path does and records each launch instead of running it."""

    def __init__(self):
        self.checks = 0
        self.why_calls = 0
        self.family_calls = 0
        self.launches: list[SimpleNamespace] = []
        self.set_flag = False  # the next launch reports a non-finite output
        self.fill: torch.Tensor | None = None  # written into the output by each launch (else left as allocated)
        self.families: dict[tuple, dict] = {}

    def family(self, dtype, d, norm, has_gamma, has_beta, affine_f32, mask_kind, mask_f32, arch, check,
               device_index, q_from_qraw=False, write_o=False):
        self.family_calls += 1
        fkey = (dtype, d, norm, has_gamma, has_beta, affine_f32, mask_kind, mask_f32, arch, check, device_index,
                q_from_qraw, write_o)
        if fkey not in self.families:  # kept alive: run_kernel's plan cache is keyed by id(kernel)
            self.families[fkey] = {
                role: SimpleNamespace(spec=SimpleNamespace(
                    tile=tile_for(role, d), key=f"fake_{role}_{fkey}",
                    grouped_stats=KernelSpec(dtype, d, norm, has_gamma, has_beta, affine_f32, mask_kind, mask_f32,
                                             tile_for(role, d), arch, check, q_from_qraw, write_o).grouped_stats),
                    ctas_per_sm=2, device_index=device_index, threads=128, smem_bytes=0)
                for role in TILE_ROLES}
        return self.families[fkey]

    def launch(self, kernel, grid, stream, pointers, tail, maps=b""):
        self.launches.append(SimpleNamespace(kernel=kernel, grid=grid, stream=stream, pointers=pointers, tail=tail,
                                             maps=maps))
        if self.fill is not None:  # the output lives in host memory here: write it as the kernel would
            ctypes.memmove(pointers[1], self.fill.data_ptr(), self.fill.numel() * self.fill.element_size())
        if pointers[11]:  # the plan's stage copies x (bf16/fp16) for the out GEMM
            B, Lq, D = tail[11], tail[12], tail[15]
            ctypes.memmove(pointers[11], pointers[0], B * Lq * D * 2)
        if self.set_flag and pointers[7]:  # the kernel writes the flag it was handed
            ctypes.memmove(pointers[7], ctypes.byref(ctypes.c_int32(1)), 4)


def _fake_cuda_like(t):
    if t is None:
        return None
    with FakeTensorMode():
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeGPU()
    real_check, real_why = op.check_inputs, codegen.why_no_kernel

    def check_inputs(*args):
        fake.checks += 1
        return real_check(*args)

    def why_no_kernel(x, k, v, gamma, beta, mask, norm):
        # the real reasons, asked about CUDA fakes of the same layout (the real tensors live on the CPU)
        fake.why_calls += 1
        return real_why(*map(_fake_cuda_like, (x, k, v, gamma, beta, mask)), norm)

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(codegen, "_current_device", lambda: 0)  # what the call key reads
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(op, "check_inputs", check_inputs)
    monkeypatch.setattr(codegen, "why_no_kernel", why_no_kernel)
    # the plan's float32-output GEMM has no CPU kernel in torch: the same product through float32 operands
    monkeypatch.setattr(plans, "gemm_f32_out", lambda a, b: a.float() @ b.float())
    monkeypatch.setattr(codegen, "_family", fake.family)
    monkeypatch.setattr(codegen, "_raw_stream", lambda device_index: 1000 + device_index)
    monkeypatch.setattr(codegen._launch, "launch", fake.launch)
    monkeypatch.setattr(codegen, "call_plans", {})
    monkeypatch.setattr(codegen, "_plans", {})
    monkeypatch.setattr(codegen, "_flags", {})
    monkeypatch.setattr(codegen, "_tickets", {})
    monkeypatch.setattr(codegen, "poison_outputs", False)
    monkeypatch.setattr(select, "force_role", None)
    for index in (0, 1):
        monkeypatch.setitem(codegen._capability, index, (9, 0))
        monkeypatch.setitem(codegen._sm_counts, index, 132)
    return fake


def inputs(dtype=BF16, B=2, Lq=5, Lk=7, H=4, d=64, affine=True):
    """k/v as models hand them over: [B, Lk, H, d] viewed as [B, H, Lk, d]."""
    D = H * d
    x = torch.randn(B, Lq, D).to(dtype)
    k = torch.randn(B, Lk, H, d).to(dtype).transpose(1, 2)
    v = torch.randn(B, Lk, H, d).to(dtype).transpose(1, 2)
    gamma = torch.randn(D).to(dtype) if affine else None
    beta = torch.randn(D).to(dtype) if affine else None
    return dict(x=x, k=k, v=v, gamma=gamma, beta=beta)


def fused(x, k, v, gamma, beta, eps=1e-5, sm_count=None, **kw):
    return fusednorm.fused_pre_norm_cross_attn(x, k, v, gamma, beta, eps, sm_count, **kw)


def misaligned(t):
    """Same shape, strides and values at an address one element off a 16-byte boundary."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    out = torch.empty(span + 8, dtype=t.dtype).as_strided(t.shape, t.stride(), storage_offset=1)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


def ptrs(t):
    return t.data_ptr() if t is not None else 0


# ---- hits ----

def test_a_repeated_signature_skips_the_checks_and_launches_with_its_own_pointers(gpu):
    y1 = fused(**inputs())
    assert (gpu.checks, gpu.why_calls, gpu.family_calls, len(gpu.launches)) == (1, 1, 1, 1)
    assert len(codegen.call_plans) == 1
    t = inputs()  # fresh tensors, same layout
    y2 = fused(**t)
    assert (gpu.checks, gpu.why_calls, gpu.family_calls, len(gpu.launches)) == (1, 1, 1, 2)
    first, second = gpu.launches
    assert second.pointers == (ptrs(t["x"]), y2.data_ptr(), ptrs(t["k"]), ptrs(t["v"]), ptrs(t["gamma"]),
                               ptrs(t["beta"]), 0, 0, 0, 0, 0, 0, 0, 0)
    assert second.pointers[1] != first.pointers[1]
    assert (second.kernel, second.grid, second.tail, second.stream) == (first.kernel, first.grid, first.tail, 1000)
    assert y2.shape == y1.shape == t["x"].shape and y2.dtype == BF16 and y2.is_contiguous()


def _two_calls_with_zeroed_tickets(gpu, monkeypatch, ticket_words, **shape):
    """Two calls of one shape (the second a cached launch), each of which must hand the kernel a Params.part and
    Params.tickets whose first ticket_words words are zero, as the kernel meets them; their two launches."""
    seen = []
    record = gpu.launch

    def launch(kernel, grid, stream, pointers, tail, maps=b""):
        seen.append((pointers[12], pointers[13], ctypes.string_at(pointers[13], 4 * ticket_words)))
        record(kernel, grid, stream, pointers, tail, maps)

    monkeypatch.setattr(codegen._launch, "launch", launch)
    for _ in range(2):
        fused(**inputs(**shape))
    for part, tickets, ticket_bytes in seen:
        assert part != 0 and tickets != 0 and ticket_bytes == bytes(4 * ticket_words)
    return gpu.launches


def test_decode_at_batch_one_launches_runs_of_keys_with_zeroed_tickets(gpu, monkeypatch):
    """20 (batch, head) pairs on 132 SMs: each pair's 8 key tiles go to 4 CTAs, which need a partial-state
    workspace and one zeroed ticket per pair (Params.part, Params.tickets: the last two pointers); the tail carries
    the runs and their key tiles, the grid one CTA per run. Cached launch or not, every call gets zeroed tickets."""
    first, second = _two_calls_with_zeroed_tickets(gpu, monkeypatch, 20, B=1, Lq=1, Lk=1500, H=20)
    assert first.tail[-4:-2] == (4, 2) == second.tail[-4:-2] and first.grid == 80  # runs, key tiles per run
    wide = fused(**inputs(B=64, Lq=1, Lk=1500, H=20))
    assert gpu.launches[-1].pointers[12:] == (0, 0) and gpu.launches[-1].tail[-4] == 1 and wide.shape[0] == 64


def test_shared_statistics_get_zeroed_counters_and_a_sums_workspace_on_every_call(gpu, monkeypatch):
    """A row block split between head groups that all run at once (16 one-head items of 64 rows, D = 1024, 100 keys:
    the base tile) shares its rows' statistics: two zeroed counters per (batch, row block) and the groups' sums of
    every row (Params.tickets, Params.part); the tail carries the groups and the sharing. Every call gets zeroed
    counters."""
    first, second = _two_calls_with_zeroed_tickets(gpu, monkeypatch, 4, B=2, Lq=64, Lk=100, H=16)
    assert first.tail[-6:-4] == (16, 1) == second.tail[-6:-4] and first.grid == 32
    narrow = fused(**inputs(B=2, Lq=64, Lk=100, H=4))  # D = 256: one pass per row
    assert gpu.launches[-1].pointers[12:] == (0, 0) and gpu.launches[-1].tail[-6:-4] == (1, 0)
    few_keys = fused(**inputs(B=2, Lq=64, H=16))  # the one-tile kernel: one pass per row
    assert gpu.launches[-1].pointers[12:] == (0, 0) and gpu.launches[-1].tail[-6:-4] == (1, 0)
    assert narrow.shape == (2, 64, 256) and few_keys.shape == (2, 64, 1024)


def test_tickets_are_kept_per_stream_and_a_capture_gets_its_own(gpu, monkeypatch):
    """Every kernel leaves Params.tickets zero, so eager launches on one stream (which run one after another) share
    one zeroed buffer and pay no memset; another stream's launch may run beside them and gets another; a capture
    gets zeroed words in its own graph's memory, kept by nobody, since its replays may run beside anything."""
    pointers = []
    record = gpu.launch

    def launch(kernel, grid, stream, ptrs, tail, maps=b""):
        pointers.append((stream, ptrs[13]))
        record(kernel, grid, stream, ptrs, tail, maps)

    monkeypatch.setattr(codegen._launch, "launch", launch)
    decode = dict(B=1, Lq=1, Lk=1500, H=20)  # key-split runs: tickets
    fused(**inputs(**decode))
    fused(**inputs(B=2, Lq=64, Lk=100, H=16))  # shared statistics: counters in the same buffer
    assert pointers[0] == pointers[1] and pointers[0][1] != 0
    monkeypatch.setattr(codegen, "_raw_stream", lambda device_index: 2000 + device_index)
    fused(**inputs(**decode))
    assert pointers[2][0] == 2000 and pointers[2][1] not in (0, pointers[0][1])
    kept = dict(codegen._tickets)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    fused(**inputs(**decode))
    assert pointers[3][1] not in (0, pointers[0][1], pointers[2][1]) and codegen._tickets == kept
    assert sorted(kept) == [(0, 1000), (0, 2000)] and all(not t.any() for t in kept.values())


def test_a_broadcast_bool_mask_is_used_in_place_and_cached(gpu):
    t = inputs()
    mask = torch.rand(2, 1, 1, 7) > 0.3
    fused(**t, mask=mask)
    mask2 = torch.rand(2, 1, 1, 7) > 0.3
    fused(**t, mask=mask2)
    assert gpu.checks == 1 and len(gpu.launches) == 2
    miss, hit = gpu.launches
    assert hit.pointers[6] == mask2.data_ptr() and hit.tail == miss.tail
    assert hit.tail[6:9] == (mask2.stride(0), 0, 0)  # batch stride kept, broadcast head and query dims


# ---- misses: every fact in the key is looked at ----

def _variants():
    base = inputs()
    return {
        "longer x": (dict(base, x=torch.randn(2, 6, 256).to(BF16)), {}),
        "k strides": (dict(base, k=base["k"].contiguous(), v=base["v"].contiguous()), {}),
        "fp16": (inputs(torch.float16), {}),
        "fp32 gamma/beta": (dict(base, gamma=base["gamma"].float(), beta=base["beta"].float()), {}),
        "no affine": (dict(base, gamma=None, beta=None), {}),
        "eps": (base, dict(eps=1e-6)),
        "scale": (base, dict(scale=0.5)),
        "sm_count": (base, dict(sm_count=3)),
        "rms": (dict(base, beta=None), dict(norm="rms")),
        "mask": (base, dict(mask=torch.ones(2, 4, 5, 7, dtype=torch.bool))),
        "check_numerics": (base, dict(check_numerics=True)),
    }, base


@pytest.mark.parametrize("name", list(_variants()[0]))
def test_a_different_signature_misses_then_hits(gpu, name):
    variants, base = _variants()
    t, kw = variants[name]
    fused(**base)
    y = fused(**t, **kw)
    assert gpu.checks == 2, f"{name}: the changed call did not take the full path"
    assert y.shape == t["x"].shape
    fused(**t, **kw)
    assert gpu.checks == 2, f"{name}: the changed call was not cached in turn"
    assert len(codegen.call_plans) == 2 and len(gpu.launches) == 3


def test_force_role_and_current_device_are_part_of_the_key(gpu, monkeypatch):
    t = inputs(Lq=200)
    fused(**t)
    monkeypatch.setattr(select, "force_role", "short")
    fused(**t)
    assert gpu.checks == 2 and gpu.launches[1].kernel.spec.key.startswith("fake_short")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(codegen, "_current_device", lambda: 1)
    fused(**t)
    assert gpu.checks == 3 and gpu.launches[2].kernel.device_index == 1 and gpu.launches[2].stream == 1001


def test_the_mask_dtype_is_part_of_the_key(gpu):
    t = inputs()
    keep = torch.rand(2, 4, 5, 7) > 0.3
    fused(**t, mask=keep)
    additive = torch.zeros(2, 4, 5, 7).to(BF16).masked_fill(~keep, float("-inf"))
    fused(**t, mask=additive)
    assert gpu.checks == 2 and gpu.launches[1].kernel is not gpu.launches[0].kernel
    fused(**t, mask=additive.double())  # same layout again, but a conversion: the full path every time
    fused(**t, mask=additive.double())
    assert gpu.checks == 4 and gpu.launches[3].pointers[6] != additive.data_ptr()


def test_the_cache_stays_bounded(gpu, monkeypatch):
    monkeypatch.setattr(codegen, "_CALL_PLANS_MAX", 3)
    for Lq in range(1, 8):
        fused(**inputs(Lq=Lq))
        assert len(codegen.call_plans) <= 3
    assert gpu.checks == 7 and len(gpu.launches) == 7


# ---- never cached ----

def _bad_calls():
    t = inputs()
    return {
        "gamma shape": (dict(t, gamma=torch.randn(255).to(BF16)), {}, "gamma must have shape"),
        "k dtype": (dict(t, k=t["k"].half()), {}, "k has dtype"),
        "v dtype": (dict(t, v=t["v"].half()), {}, "v has dtype"),
        "x dtype": (dict(t, x=t["x"].half()), {}, "k has dtype"),
        "gamma device": (dict(t, gamma=t["gamma"].to("meta")), {}, "gamma is on meta"),
        "eps": (t, dict(eps=0.0), "eps must be > 0"),
        "sm_count": (t, dict(sm_count=0), "sm_count must be >= 1"),
        "mask shape": (t, dict(mask=torch.ones(2, 4, 5, 6, dtype=torch.bool)), "does not broadcast"),
        "norm": (t, dict(norm="batch"), "norm must be one of"),
        "rms with beta": (t, dict(norm="rms"), "an RMS norm has no beta"),
        "scale": (t, dict(scale=float("nan")), "scale must be finite"),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_invalid_input_raises_on_every_call(gpu, name):
    t, kw, message = _bad_calls()[name]
    fused(**inputs())  # a valid signature is cached first
    for i in range(3):
        with pytest.raises(fusednorm.FusedNormInputError, match=message):
            fused(**t, **kw)
        assert gpu.checks == 2 + i
    assert len(gpu.launches) == 1 and len(codegen.call_plans) == 1


@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (BF16, 48)])
def test_a_fallback_to_the_reference_is_not_cached(gpu, dtype, d):
    t = inputs(dtype, d=d, H=2)
    for i in range(3):
        y = fused(**t)
        assert gpu.checks == gpu.why_calls == i + 1
    ref = reference_pre_norm_cross_attn(t["x"], t["k"], t["v"], t["gamma"], t["beta"], None, None, None, None, None,
                                        "layer", 1e-5, None)
    assert torch.equal(y, ref)
    assert not gpu.launches and not codegen.call_plans


def _copy_cases():
    """Each case: inputs, keywords, and the Params pointer slot that must hold a copy."""
    t = inputs()
    k_wide = torch.randn(2, 4, 7, 128).to(BF16)[..., ::2]  # last-dim stride 2
    mixed_beta = t["beta"].float()
    return t, {
        "x not contiguous": (dict(t, x=torch.randn(2, 5, 512).to(BF16)[:, :, ::2]), {}, 0),
        "x misaligned": (dict(t, x=misaligned(t["x"])), {}, 0),
        "x rows sliced": (dict(t, x=torch.randn(2, 5, 256).to(BF16)[:, :4]), {}, 0),  # the cached x's strides
        "k strided": (dict(t, k=k_wide), {}, 2),
        "k misaligned": (dict(t, k=misaligned(t["k"])), {}, 2),
        "v misaligned": (dict(t, v=misaligned(t["v"])), {}, 3),
        "beta misaligned": (dict(t, beta=misaligned(t["beta"])), {}, 5),
        "gamma float64": (dict(t, gamma=t["gamma"].double()), {}, 4),
        "gamma strided": (dict(t, gamma=torch.randn(512).to(BF16)[::2]), {}, 4),
        "gamma misaligned": (dict(t, gamma=misaligned(t["gamma"])), {}, 4),
        "gamma/beta dtypes differ": (dict(t, beta=mixed_beta), {}, 4),
        "mask float64": (t, dict(mask=torch.randn(2, 1, 5, 7, dtype=torch.float64)), 6),
        "mask broadcast over keys": (t, dict(mask=torch.randn(2, 1, 5, 1).to(BF16)), 6),
    }


@pytest.mark.parametrize("name", list(_copy_cases()[1]))
def test_a_call_needing_a_copy_never_takes_the_fast_path(gpu, name):
    well_laid_out, cases = _copy_cases()
    t, kw, slot = cases[name]
    fused(**well_laid_out)  # cached; the misaligned cases share its shapes and strides
    given = (t["x"], None, t["k"], t["v"], t["gamma"], t["beta"], kw.get("mask"))[slot]
    for i in range(3):
        fused(**t, **kw)
        assert gpu.checks == i + 2, f"{name}: call {i + 1} skipped the checks"
        assert gpu.launches[-1].pointers[slot] != given.data_ptr(), f"{name}: the kernel got the uncopied tensor"
    assert len(codegen.call_plans) == 1


# ---- unchanged behaviour on the fast path ----

def test_poisoned_outputs_on_a_hit(gpu, monkeypatch):
    monkeypatch.setattr(codegen, "poison_outputs", True)
    t = inputs()
    for _ in range(2):
        y = fused(**t)
        assert torch.isnan(y).all(), "the (fake) kernel writes nothing, so y must still hold the poison"
    assert gpu.checks == 1


def test_check_numerics_on_a_hit(gpu):
    t = inputs()
    fused(**t, check_numerics=True)
    gpu.set_flag = True
    with pytest.raises(fusednorm.FusedNormNumericsError, match="generated kernel fake_"):
        fused(**t, check_numerics=True)
    assert gpu.checks == 1 and gpu.launches[-1].pointers[7] == codegen._flags[0].data_ptr() != 0
    gpu.set_flag = False
    fused(**t, check_numerics=True)  # the flag was reset: quiet again
    fused(**t)  # off: no flag pointer
    assert gpu.launches[-1].pointers[7] == 0


def test_check_numerics_under_a_capture_warns_once_and_keeps_no_flag_of_the_capture(gpu, monkeypatch):
    """A capture cannot read the flag: the check is skipped with a warning, and a flag first made during a capture
    (in the graph's memory) is not kept for later calls; the reference path's check skips alike."""
    from fusednorm import numerics, warn

    monkeypatch.setattr(warn, "_said", set())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    t = inputs()
    gpu.set_flag = True  # the (fake) kernel flags: a check that ran would raise
    with pytest.warns(fusednorm.FusedNormWarning, match="check_numerics cannot read its flag"):
        fused(**t, check_numerics=True)
    assert codegen._flags == {} and gpu.launches[-1].pointers[7] != 0
    numerics.raise_if_not_finite(torch.full((2,), float("nan")))  # skipped too (the warning was given)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(fusednorm.FusedNormNumericsError):
        numerics.raise_if_not_finite(torch.full((2,), float("nan")))


def test_a_call_needing_grad_keeps_the_autograd_path(gpu):
    t = inputs()
    t["gamma"].requires_grad_(True)
    y = fused(**t)
    assert y.requires_grad and not gpu.launches and not codegen.call_plans
    with torch.no_grad():
        fused(**t)
    assert len(gpu.launches) == 1 and len(codegen.call_plans) == 1


def test_an_argument_that_cannot_be_keyed_gets_the_full_paths_error(gpu):
    t = inputs()
    with pytest.raises(AttributeError):
        fused(**dict(t, k=None))
    with pytest.raises(fusednorm.FusedNormInputError, match="norm must be one of"):
        fused(**t, norm=["layer"])  # unhashable: no key, the check reports it
    assert gpu.checks == 2 and not codegen.call_plans  # both errors came from the checks


# ---- the op as a compiled graph calls it, and the projection plan ----

def test_the_ops_cuda_impl_caches_like_the_eager_function(gpu):
    t = inputs()
    args = (t["x"], t["k"], t["v"], t["gamma"], t["beta"], None, None, None, None, None, "layer", 1e-5)
    op._pre_norm_cross_attn_cuda(*args)
    op._pre_norm_cross_attn_cuda(*args)
    fused(**t)  # the eager function's call with the same signature: the same entry
    assert gpu.checks == 1 and len(gpu.launches) == 3 and len(codegen.call_plans) == 1


def test_the_ops_cuda_key_runs_fusednorms_function_with_no_wrapper_between():
    # custom_op's register_kernel would put its own Python wrapper (~36 µs per call) on the CUDA key
    table = torch._C._dispatch_dump("fusednorm::pre_norm_cross_attn")
    cuda_line = next(line for line in table.splitlines() if line.startswith("CUDA:"))
    assert "fusednorm/op.py" in cuda_line.replace("\\", "/"), cuda_line
    assert "custom_ops.py" not in cuda_line


def plan_inputs(B=2, Lq=5, Lk=7, H=4, d=64, D=96, bias=True):
    t = inputs(B=B, Lq=Lq, Lk=Lk, H=H, d=d)
    Dq = H * d
    t["x"] = torch.randn(B, Lq, D).to(BF16)
    t["gamma"], t["beta"] = (1 + 0.1 * torch.randn(D)).to(BF16), (0.1 * torch.randn(D)).to(BF16)
    w = dict(wq=(torch.randn(Dq, D) / D**0.5).to(BF16), bq=(0.1 * torch.randn(Dq)).to(BF16) if bias else None,
             wo=(torch.randn(D, Dq) / Dq**0.5).to(BF16), bo=(0.1 * torch.randn(D)).to(BF16) if bias else None)
    return t, w


def run_plan_op(t, w, mask=None):
    return op._pre_norm_cross_attn_cuda(t["x"], t["k"], t["v"], t["gamma"], t["beta"], w["wq"], w["bq"], w["wo"],
                                        w["bo"], mask, "layer", 1e-5)


def test_a_repeated_plan_signature_skips_the_checks_and_the_stage_planning(gpu):
    t, w = plan_inputs()
    Dq, D = w["wq"].shape
    o_cols = Dq + plans.weights.K_ALIGN
    run_plan_op(t, w)
    assert (gpu.checks, gpu.why_calls, gpu.family_calls, len(gpu.launches)) == (1, 1, 1, 1)
    t2 = dict(t, x=torch.randn_like(t["x"].float()).to(BF16))  # a new x, the same weights
    o = torch.randn(2, 5, o_cols).to(BF16)
    gpu.fill = o  # what the (fake) stage kernel writes: o, then the ones column the out GEMM multiplies by bo
    o[..., Dq:] = 0
    o[..., Dq] = 1
    y = run_plan_op(t2, w)
    assert (gpu.checks, gpu.why_calls, gpu.family_calls, len(gpu.launches)) == (1, 1, 1, 2)
    miss, hit = gpu.launches
    assert hit.kernel is miss.kernel and hit.tail == miss.tail and hit.grid == miss.grid
    assert hit.pointers[0] == t2["x"].data_ptr() and hit.pointers[8] != 0  # its own x, and a qraw
    assert hit.pointers[9:11] == miss.pointers[9:11] != (0, 0)  # u and b': folded once, from the weight cache
    assert hit.pointers[11] == y.data_ptr()  # the stage copies x into y, which the out GEMM then adds to in place
    expected = t2["x"].float() + o[..., :Dq].float() @ w["wo"].float().t() + w["bo"].float()
    torch.testing.assert_close(y.float(), expected, atol=3e-2, rtol=2e-2)


def _folded_u(w, t):
    return plans.weights.fold_weights("layer", t["gamma"], t["beta"], w["wq"], w["bq"], w["wo"], w["bo"], BF16).u


def _u_from(w, t):
    return (w["wq"].float() * t["gamma"].float()).to(BF16).float().sum(1)


def test_a_weight_updated_in_place_is_folded_again_on_a_hit(gpu):
    t, w = plan_inputs()
    run_plan_op(t, w)
    run_plan_op(t, w)
    with torch.no_grad():
        w["wq"].mul_(2)  # an optimizer step: same tensor, new version
    run_plan_op(t, w)
    assert gpu.checks == 1 and len(gpu.launches) == 3
    first, second, third = gpu.launches
    # the same buffers (a captured graph reads them by address), folded again from the new Wq
    assert first.pointers[9:11] == second.pointers[9:11] == third.pointers[9:11]
    torch.testing.assert_close(_folded_u(w, t), _u_from(w, t))


def test_a_captured_plan_folds_inside_the_graph_unless_its_weights_are_held(gpu, monkeypatch):
    """A capture records kernels without running them: an unheld capture records the fold itself (every replay
    folds the weights it reads); one under GraphWeights.capture() reads the kept buffers and refresh() keeps them
    current."""
    t, w = plan_inputs()
    run_plan_op(t, w)  # eager: the weights are folded and kept
    kept = gpu.launches[-1].pointers[9:11]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    run_plan_op(t, w)
    assert gpu.launches[-1].pointers[9:11] != kept  # recorded fold: buffers of the capture's own
    held = plans.weights.GraphWeights()
    with held.capture():
        run_plan_op(t, w)
    assert gpu.launches[-1].pointers[9:11] == kept and len(held) == 1
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with torch.no_grad():
        w["wq"].mul_(2)  # between replays: the op does not run, refresh() re-folds in place
    held.refresh()
    entry = next(iter(held._held.values()))[0]
    torch.testing.assert_close(entry.folded.u, _u_from(w, t))
    with torch.no_grad():
        w["wq"].mul_(2)
    with held.capture():  # a later capture after an update that nothing refreshed: the fold is recorded
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        run_plan_op(t, w)
    assert gpu.launches[-1].pointers[9:11] != kept


@pytest.mark.parametrize("change", ["no bias", "wq strides", "bo dtype", "mask"])
def test_a_different_plan_signature_misses_then_hits(gpu, change):
    t, w = plan_inputs()
    mask = None
    run_plan_op(t, w)
    if change == "no bias":
        w = dict(w, bq=None, bo=None)
    elif change == "wq strides":
        w = dict(w, wq=w["wq"].t().contiguous().t())
    elif change == "bo dtype":
        w = dict(w, bo=w["bo"].float())
    else:
        mask = torch.rand(2, 1, 1, 7) > 0.3
    run_plan_op(t, w, mask)
    run_plan_op(t, w, mask)
    assert gpu.checks == 2 and len(gpu.launches) == 3 and len(codegen.call_plans) == 2


def test_plan_and_kernel_signatures_never_share_an_entry(gpu):
    t, w = plan_inputs(D=256)  # D == H * d: the same x, k, v also make a valid projection-free call
    run_plan_op(t, w)
    fused(t["x"], t["k"], t["v"], t["gamma"], t["beta"])
    assert gpu.checks == 2 and len(codegen.call_plans) == 2
    assert gpu.launches[0].kernel is not gpu.launches[1].kernel  # the stage mode is a kernel of its own


def test_a_bad_plan_call_raises_every_time_after_a_good_one_was_cached(gpu):
    t, w = plan_inputs()
    run_plan_op(t, w)
    bad = dict(w, wo=w["wo"][:, :-8])
    for i in range(2):
        with pytest.raises(fusednorm.FusedNormInputError, match="wo must be"):
            run_plan_op(t, bad)
        assert gpu.checks == 2 + i
    key = dispatch.call_key(t["x"], t["k"], t["v"], t["gamma"], t["beta"], w["wq"], w["bq"], w["wo"], w["bo"], None,
                            "layer", 1e-5, None, None, False)
    assert list(codegen.call_plans) == [key] and len(gpu.launches) == 1


# ---- launch.py: the per-thread Params buffer ----

def test_launch_packs_params_into_a_per_thread_buffer(monkeypatch):
    seen = []

    def cuLaunchKernel(function, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        params_address = ctypes.c_void_p.from_address(argv).value
        seen.append((threading.get_ident(), argv, ctypes.string_at(params_address, launch.PARAMS.size),
                     (function, gx, bx, smem, stream)))
        return (0,)

    fake_driver = SimpleNamespace(cuLaunchKernel=cuLaunchKernel,
                                  CUresult=SimpleNamespace(CUDA_SUCCESS=0, CUDA_ERROR_INVALID_CONTEXT=201))
    monkeypatch.setattr(launch, "_cu", fake_driver)
    monkeypatch.setattr(launch, "_raw_launch", None)  # no libcuda: the cuda-python binding launches
    kernel = SimpleNamespace(function="fn", handle=1, threads=256, smem_bytes=4096, device_index=0,
                             spec=SimpleNamespace(key="k"))
    tail = tuple(range(1, 26)) + (1e-5, 0.18)  # 11 strides, 14 sizes and settings, eps, scale_log2
    before = launch.launch_count

    def two_launches(base):
        for n in range(2):
            launch.launch(kernel, 7, 99, tuple(range(base + n, base + n + launch.POINTERS)), tail)

    two_launches(100)
    worker = threading.Thread(target=two_launches, args=(200,))
    worker.start()
    worker.join()
    assert launch.launch_count == before + 4
    for i, (_, _, params, config) in enumerate(seen):
        base = (100, 101, 200, 201)[i]
        assert params == launch.PARAMS.pack(*range(base, base + launch.POINTERS), *tail)
        assert config == ("fn", 7, 256, 4096, 99)
    assert seen[0][1] == seen[1][1], "one thread reuses its buffer"
    assert seen[2][1] == seen[3][1] != seen[0][1], "another thread gets its own"


def test_the_ctypes_launch_is_used_and_a_failure_goes_to_the_binding(monkeypatch):
    raw_calls, bound_calls = [], []

    def raw(handle, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        raw_calls.append((handle, gx, bx, smem, stream, ctypes.string_at(ctypes.c_void_p.from_address(argv).value,
                                                                         launch.PARAMS.size)))
        return raw_result[0]

    def cuLaunchKernel(function, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        bound_calls.append(function)
        return (0,)

    raw_result = [0]
    monkeypatch.setattr(launch, "_raw_launch", raw)
    monkeypatch.setattr(launch, "_cu", SimpleNamespace(cuLaunchKernel=cuLaunchKernel, CUresult=SimpleNamespace(
        CUDA_SUCCESS=0, CUDA_ERROR_INVALID_CONTEXT=201)))
    kernel = SimpleNamespace(function="fn", handle=0xABC, threads=128, smem_bytes=1024, device_index=0,
                             spec=SimpleNamespace(key="k"))
    tail = tuple(range(1, 26)) + (1e-5, 0.18)
    pointers = tuple(range(500, 500 + launch.POINTERS))
    before = launch.launch_count
    launch.launch(kernel, 3, 77, pointers, tail)
    assert raw_calls == [(0xABC, 3, 128, 1024, 77, launch.PARAMS.pack(*pointers, *tail))] and bound_calls == []
    raw_result[0] = 201  # e.g. no current context on this thread: the binding path retries and reports
    monkeypatch.setattr(launch, "_make_primary_context_current", lambda index: None)
    launch.launch(kernel, 3, 77, pointers, tail)
    assert bound_calls == ["fn"] and launch.launch_count == before + 2


def test_sm90_kernels_launch_programmatically_and_a_refusal_falls_back_to_the_plain_launch(monkeypatch):
    """cuLaunchKernelEx with programmatic stream serialization (the kernel may start while the one before it ends)
    for kernels built for sm_90 on; the plain launch for older archs, with the switch off, and for good once the
    driver refuses the attribute."""
    ex_calls, plain_calls = [], []

    def raw_ex(config_address, handle, argv, extra):
        config = launch._LaunchConfig.from_address(config_address)
        attribute = launch._LaunchAttribute.from_address(config.attrs)
        ex_calls.append((handle, tuple(config.grid), tuple(config.block), config.smem_bytes, config.stream,
                         config.num_attrs, attribute.id, attribute.value,
                         ctypes.string_at(ctypes.c_void_p.from_address(argv).value, launch.PARAMS.size)))
        return ex_result[0]

    def raw(handle, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        plain_calls.append((handle, gx, bx, smem, stream))
        return 0

    ex_result = [0]
    monkeypatch.setattr(launch, "_raw_launch", raw)
    monkeypatch.setattr(launch, "_raw_launch_ex", raw_ex)
    sm90, sm80 = (SimpleNamespace(function="fn", handle=0xABC, threads=256, smem_bytes=99000, device_index=0,
                                  spec=SimpleNamespace(key="k", arch=arch)) for arch in (90, 80))
    tail = tuple(range(1, 26)) + (1e-5, 0.18)
    pointers = tuple(range(500, 500 + launch.POINTERS))
    before = launch.launch_count
    launch.launch(sm90, 264, 77, pointers, tail)
    assert ex_calls == [(0xABC, (264, 1, 1), (256, 1, 1), 99000, 77, 1,
                         launch._CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1,
                         launch.PARAMS.pack(*pointers, *tail))] and plain_calls == []
    launch.launch(sm80, 7, 77, pointers, tail)
    monkeypatch.setattr(launch, "programmatic_launch", False)
    launch.launch(sm90, 9, 77, pointers, tail)
    assert len(ex_calls) == 1 and plain_calls == [(0xABC, 7, 256, 99000, 77), (0xABC, 9, 256, 99000, 77)]
    monkeypatch.setattr(launch, "programmatic_launch", True)
    ex_result[0] = 201  # CUDA_ERROR_INVALID_CONTEXT: a new thread; the plain launch makes the context current
    launch.launch(sm90, 10, 77, pointers, tail)
    assert len(ex_calls) == 2 and plain_calls[2:] == [(0xABC, 10, 256, 99000, 77)] and launch._raw_launch_ex is raw_ex
    ex_result[0] = 1  # CUDA_ERROR_INVALID_VALUE: this driver takes no such attribute
    launch.launch(sm90, 11, 77, pointers, tail)
    launch.launch(sm90, 12, 77, pointers, tail)
    assert len(ex_calls) == 3 and plain_calls[3:] == [(0xABC, 11, 256, 99000, 77), (0xABC, 12, 256, 99000, 77)]
    assert launch._raw_launch_ex is None and launch.launch_count == before + 6


def test_the_prebuilt_plan_stages_are_the_ones_the_plan_asks_for(gpu):
    """bench/prebuild_kernels.py lists the plan's stage kernels by hand (tests/gpu/kernel_specs.py); the kernel
    families the plan really asks for, for each projection variant, norm and mask, must be among them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    try:
        from kernel_specs import plan_test_specs
    finally:
        sys.path.pop(0)
    listed = {s.key for s in plan_test_specs(90)}
    for norm in ("layer", "rms"):
        for mask in (None, "bool", "add"):
            for drop in ((), ("wq", "bq"), ("wo", "bo")):
                t, w = plan_inputs(D=256)  # D = H * d: a block without Wq needs it
                if norm == "rms":
                    t["beta"] = None
                w = {n: (None if n in drop else v) for n, v in w.items()}
                m = None if mask is None else (torch.rand(2, 1, 5, 7) > 0.3 if mask == "bool"
                                               else torch.randn(2, 1, 5, 7).to(BF16))
                op._pre_norm_cross_attn_cuda(t["x"], t["k"], t["v"], t["gamma"], t["beta"], w["wq"], w["bq"],
                                             w["wo"], w["bo"], m, norm, 1e-5)
    asked = set()
    for (dtype, d, norm, has_g, has_b, affine_f32, kind, mask_f32, arch, check, _, qraw, write_o) in gpu.families:
        asked |= {KernelSpec(dtype, d, norm, has_g, has_b, affine_f32, kind, mask_f32,
                             tile_for(r, d, arch, stage=qraw, warp_specialised=kind == "none"), arch, check, qraw,
                             write_o).key for r in TILE_ROLES}
    assert len(gpu.families) == 18 and asked <= listed, sorted(asked - listed)[:3]
