"""The op's autograd key: a plain call (no gradient needed, plain tensors) goes straight to the device's
implementation; a call needing a gradient, or one traced with fakes, keeps custom_op's autograd kernel."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fusednorm import op
from fusednorm.reference import reference_pre_norm_cross_attn

CPU = torch._C.DispatchKey.CPU
OP = torch.ops.fusednorm.pre_norm_cross_attn.default

def block(B=2, Lq=3, Lk=5, H=2, d=8, requires_grad=False):
    D = H * d
    t = dict(x=torch.randn(B, Lq, D, dtype=torch.float64), k=torch.randn(B, Lk, H, d, dtype=torch.float64),
             v=torch.randn(B, Lk, H, d, dtype=torch.float64), gamma=1 + 0.1 * torch.randn(D, dtype=torch.float64),
             beta=0.1 * torch.randn(D, dtype=torch.float64), wq=torch.randn(D, D, dtype=torch.float64) / D**0.5,
             wo=torch.randn(D, D, dtype=torch.float64) / D**0.5, bo=0.1 * torch.randn(D, dtype=torch.float64))
    t["k"], t["v"] = t["k"].transpose(1, 2), t["v"].transpose(1, 2)  # strided, as models hand them over
    for n in ("x", "wq", "wo") if requires_grad else ():
        t[n].requires_grad_(True)
    return t


def call(t):
    return OP(t["x"], t["k"], t["v"], t["gamma"], t["beta"], t["wq"], None, t["wo"], t["bo"], None, "layer", 1e-5)


def reference(t):
    return reference_pre_norm_cross_attn(t["x"], t["k"], t["v"], t["gamma"], t["beta"], t["wq"], None, t["wo"],
                                         t["bo"], None, "layer", 1e-5, None)


@pytest.fixture
def device_calls(monkeypatch):
    """Records each call that reached the CPU implementation from the autograd key, and whether custom_op's
    autograd kernel was on the way (it excludes the autograd keys while it redispatches)."""
    calls = []
    real = op.DEVICE_IMPLS[CPU]

    def recorded(*args):
        calls.append(torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradCPU))
        return real(*args)

    monkeypatch.setitem(op.DEVICE_IMPLS, CPU, recorded)
    return calls


def test_both_autograd_keys_run_fusednorms_kernel():
    assert op.DIRECT_AUTOGRAD  # every supported torch (2.11 to 2.14) has what it builds on
    table = torch._C._dispatch_dump("fusednorm::pre_norm_cross_attn").replace("\\", "/")
    for key in ("AutogradCPU", "AutogradCUDA"):
        line = next(line for line in table.splitlines() if line.startswith(f"{key}:"))
        assert "fusednorm/op.py" in line, line


def test_a_plain_call_reaches_the_device_implementation_directly(device_calls):
    t = block()
    y = call(t)
    assert device_calls == [False]  # no custom_op layer between the dispatcher and the implementation
    assert not y.requires_grad
    torch.testing.assert_close(y, reference(t), rtol=0, atol=0)


def test_weights_needing_grad_under_no_grad_are_a_plain_call(device_calls):
    t = block(requires_grad=True)
    with torch.no_grad():  # as a compiled graph's forward runs
        y = call(t)
    assert device_calls == [False] and not y.requires_grad


def test_a_call_needing_grad_keeps_custom_ops_autograd_and_its_gradients(device_calls):
    t = block(requires_grad=True)
    y = call(t)
    assert device_calls == []  # custom_op's kernel redispatched to the CPU key (CompositeExplicitAutograd)
    assert y.grad_fn is not None
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (t["x"], t["wq"], t["wo"]), g)
    want = torch.autograd.grad(reference(t), (t["x"], t["wq"], t["wo"]), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_fake_tensors_take_the_fake_implementation(device_calls):
    t = block()
    with FakeTensorMode() as mode:
        fakes = {n: mode.from_tensor(v) for n, v in t.items()}
        y = call(fakes)
    assert device_calls == [] and y.shape == t["x"].shape


def test_bad_input_on_the_direct_path_names_the_argument(device_calls):
    t = block()
    t["wq"] = t["wq"][:, :-1]
    with pytest.raises(op.FusedNormInputError, match="wq must be"):
        call(t)
    assert device_calls == [False]


@pytest.mark.parametrize("needs_grad", [False, True])
def test_torch_library_opcheck_passes(needs_grad):
    """torch's own checks of a custom op: schema, autograd registration, fake tensors, AOT dispatch."""
    t = block(requires_grad=needs_grad)
    args = (t["x"], t["k"], t["v"], t["gamma"], t["beta"], t["wq"], None, t["wo"], t["bo"], None, "layer", 1e-5)
    result = torch.library.opcheck(OP, args, raise_exception=False)
    assert set(result.values()) == {"SUCCESS"}, result
