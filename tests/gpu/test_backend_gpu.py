"""The backend on a CUDA GPU: projection-free blocks run the generated kernel inside torch.compile; blocks with
the plan option set to "never" are left to Inductor; kernel="measure" keeps the faster of the kernel and Inductor.
Skipped cleanly without a GPU."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import fusednorm  # noqa: E402
from fusednorm.codegen import launch  # noqa: E402
from fusednorm.reference import reference_pre_norm_cross_attn  # noqa: E402
from fusednorm.report import Report  # noqa: E402

FUSED = torch.ops.fusednorm.pre_norm_cross_attn.default


class ProjectionFreeBlock(nn.Module):
    """x + SDPA(LayerNorm(x) split into heads, k, v): the seed's block, as a model would write it."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.norm = heads, nn.LayerNorm(dim)

    def forward(self, x, k, v, key_padding):
        B, L, D = x.shape
        q = self.norm(x).view(B, L, self.heads, D // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=key_padding[:, None, None, :])
        return x + a.transpose(1, 2).reshape(B, L, D)


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_block_runs_the_generated_kernel(dtype):
    B, L, D, H, Lk = 4, 333, 512, 8, 77
    block = ProjectionFreeBlock(D, H).cuda().to(dtype).eval()
    with torch.no_grad():
        block.norm.weight.normal_(1.0, 0.2)
        block.norm.bias.normal_(0.0, 0.2)
    x = torch.randn(B, L, D, device="cuda", dtype=dtype)
    kv = torch.randn(2, B, Lk, H, D // H, device="cuda", dtype=dtype)
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)           # strided views, as models hand them over
    keep = torch.rand(B, Lk, device="cuda") > 0.2

    report = Report()
    compiled = torch.compile(block, backend="fusednorm", options={"report": report})
    before = launch.launch_count
    with torch.no_grad():
        got = compiled(x, k, v, keep)
        eager = block(x, k, v, keep)
    torch.cuda.synchronize()
    assert launch.launch_count > before, "the generated kernel did not run"
    assert len(report.matches) == 1 and "kernel" in report.matches[0].runs

    ref = reference_pre_norm_cross_attn(x.double(), k.double(), v.double(), block.norm.weight.double(),
                                        block.norm.bias.double(), None, None, None, None, keep[:, None, None, :],
                                        "layer", block.norm.eps, None)
    assert torch.isfinite(got).all()
    assert _rel(got, ref) <= 2 * _rel(eager, ref) + 1e-6


def test_block_left_to_the_compiler_by_the_plan_option():
    """A block with projections under plan='never': reported as a near-miss with the reason, computed by Inductor."""
    D, H = 256, 4

    class WithProjections(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.q, self.o = nn.LayerNorm(D), nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x, k, v):
            B, L, _ = x.shape
            q = self.q(self.norm(x)).view(B, L, H, D // H).transpose(1, 2)
            return x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, D))

    model = WithProjections().cuda().bfloat16().eval()
    x = torch.randn(2, 100, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, H, 77, D // H, device="cuda", dtype=torch.bfloat16)
    report = Report()
    with torch.no_grad():
        got = torch.compile(model, backend="fusednorm", options={"report": report, "plan": "never"})(x, k, v)
        want = model(x, k, v)
    assert report.matches == []
    assert any("plan='never'" in n.reason for n in report.near_misses), [n.reason for n in report.near_misses]
    assert torch.isfinite(got).all()
    assert _rel(got, want.double()) < 2e-2


def test_kernel_measure_option_keeps_the_faster_of_kernel_and_compiler():
    """kernel='measure': the block is timed both ways on the GPU (decode-like, one query row, where the two are
    close on the H200); the report carries the numbers, the decision follows them, the output is right either way."""
    import re

    from fusednorm.plans import choose

    B, L, D, H, Lk = 16, 1, 1280, 20, 1500
    block = ProjectionFreeBlock(D, H).cuda().bfloat16().eval()
    x = torch.randn(B, L, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, B, H, Lk, D // H, device="cuda", dtype=torch.bfloat16)
    keep = torch.rand(B, Lk, device="cuda") > 0.2
    report = Report()
    with torch.no_grad():
        got = torch.compile(block, backend="fusednorm", options={"report": report, "kernel": "measure"})(x, k, v, keep)
        want = block(x, k, v, keep)
    reasons = [m.runs for m in report.matches] + [n.reason for n in report.near_misses]
    said = [r for r in reasons if "measured kernel" in r]
    assert len(said) == 1, reasons
    kernel_us, compiler_us = (float(t) for t in re.search(
        r"measured kernel ([\d.]+) µs GPU, [\d.]+ µs host per call vs compiler ([\d.]+) µs GPU", said[0]).groups())
    assert kernel_us > 0 and compiler_us > 0
    assert (len(report.matches) == 1) == (kernel_us < choose.MARGIN * compiler_us)
    assert torch.isfinite(got).all()
    assert _rel(got, want.double()) < 2e-2


def test_the_op_through_the_dispatcher_reaches_the_kernel_without_custom_ops_autograd_layer(monkeypatch):
    """A plain CUDA call (no gradient needed) goes from fusednorm's AutogradCUDA kernel straight to the CUDA
    implementation, and launches the generated kernel; one needing a gradient keeps custom_op's autograd kernel."""
    from fusednorm import op

    reached = []
    real = op.DEVICE_IMPLS[torch._C.DispatchKey.CUDA]

    def recorded(*args):
        reached.append(torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradCUDA))
        return real(*args)

    monkeypatch.setitem(op.DEVICE_IMPLS, torch._C.DispatchKey.CUDA, recorded)
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    B, Lq, Lk, H, d = 2, 33, 77, 4, 64
    x = torch.randn(B, Lq, H * d, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(B, Lk, H, d, device="cuda", generator=gen).bfloat16().transpose(1, 2) for _ in range(2))
    gamma = (1 + 0.1 * torch.randn(H * d, device="cuda", generator=gen)).bfloat16().requires_grad_(True)
    args = (x, k, v, gamma, None, None, None, None, None, None, "layer", 1e-5)
    before = launch.launch_count
    with torch.no_grad():
        y = FUSED(*args)
    assert reached == [False] and launch.launch_count > before  # no layer between: autograd keys not excluded
    ref = reference_pre_norm_cross_attn(*(t.double() if isinstance(t, torch.Tensor) else t for t in args), None)
    assert _rel(y, ref) < 1e-2
    y = FUSED(*args)  # gamma needs a gradient: custom_op's autograd kernel, its redispatch reaches the CUDA key
    assert y.grad_fn is not None and reached == [False]
