"""The public pattern API: a registered pattern fuses a block the built-ins leave alone and is named in the report;
unregistering restores; a pattern whose binding contradicts the op is refused with a clear error, at registration or
(without example inputs) as a near-miss at match time, and never gives a wrong result."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusednorm
from fusednorm.patterns import Derived, Fixed, PatternError, user_patterns

B, LQ, LK, D, H = 2, 5, 7, 32, 4
HD = D // H


class EinsumBlock(nn.Module):
    """Pre-norm cross-attention written with torch.einsum: no built-in pattern knows it."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.2 * torch.randn_like(p))

    def forward(self, x, context):
        b, lq, _ = x.shape
        q = self.q(self.norm(x)).view(b, lq, H, HD).transpose(1, 2)
        k = self.k(context).view(b, -1, H, HD).transpose(1, 2)
        v = self.v(context).view(b, -1, H, HD).transpose(1, 2)
        w = (torch.einsum("bhqd,bhkd->bhqk", q, k) * HD ** -0.5).softmax(dim=-1)
        o = torch.einsum("bhqk,bhkd->bhqd", w, v)
        return x + self.o(o.transpose(1, 2).reshape(b, lq, D))


def einsum_search(x, gamma, beta, eps, wq, bq, k, v, scale, wo, bo):
    b, lq = x.shape[0], x.shape[1]
    q = F.linear(F.layer_norm(x, x.shape[-1:], gamma, beta, eps), wq, bq)
    q = q.view(b, lq, k.shape[1], k.shape[3]).transpose(1, 2)
    w = (torch.einsum("bhqd,bhkd->bhqk", q, k) * scale).softmax(dim=-1)
    o = torch.einsum("bhqk,bhkd->bhqd", w, v)
    return x + F.linear(o.transpose(1, 2).reshape(b, lq, -1), wo, bo)


BIND = {"x": "x", "gamma": "gamma", "beta": "beta", "eps": "eps", "wq": "wq", "bq": "bq", "k": "k", "v": "v",
        "scale": "scale", "wo": "wo", "bo": "bo"}


def example_inputs():
    return dict(x=torch.randn(2, 3, D), gamma=torch.randn(D), beta=torch.randn(D), eps=1e-5,
                wq=torch.randn(D, D) / D ** 0.5, bq=torch.randn(D), k=torch.randn(2, H, 6, HD),
                v=torch.randn(2, H, 6, HD), scale=0.3, wo=torch.randn(D, D) / D ** 0.5, bo=torch.randn(D))


@pytest.fixture
def registered():
    names = []

    def register(name, search=einsum_search, bind=BIND, **kwargs):
        pattern = fusednorm.register_pattern(name, search, bind, **kwargs)
        names.append(name)
        return pattern

    yield register
    still = {p.name for p in user_patterns()}
    for name in names:
        if name in still:
            fusednorm.unregister_pattern(name)


def inputs():
    return torch.randn(B, LQ, D), torch.randn(B, LK, D)


def test_registered_pattern_fuses_a_block_the_builtins_leave_alone(fusion, registered):
    model = EinsumBlock().eval()
    fusion.run(model, *inputs())
    assert fusion.fused == 0
    assert "torch.einsum" in fusion.reasons()  # the near-miss names what no pattern knows

    registered("einsum_attention", norm="layer", example_inputs=example_inputs())
    torch._dynamo.reset()
    fusion.run(model, *inputs())
    assert fusion.fused == 1
    (match,) = fusion.matches
    assert match.pattern == "einsum_attention"
    assert match.summary["scale"] == pytest.approx(HD ** -0.5)

    fusednorm.unregister_pattern("einsum_attention")
    torch._dynamo.reset()
    fusion.graphs.clear()
    fusion.run(model, *inputs())
    assert fusion.fused == 0


def test_higher_priority_wins_over_a_builtin(fusion, registered):
    class SdpaBlock(EinsumBlock):
        def forward(self, x, context):
            b, lq, _ = x.shape
            q = self.q(self.norm(x)).view(b, lq, H, HD).transpose(1, 2)
            k = self.k(context).view(b, -1, H, HD).transpose(1, 2)
            v = self.v(context).view(b, -1, H, HD).transpose(1, 2)
            return x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, lq, D))

    def sdpa_search(x, gamma, beta, eps, wq, bq, k, v, wo, bo):
        b, lq = x.shape[0], x.shape[1]
        q = F.linear(F.layer_norm(x, x.shape[-1:], gamma, beta, eps), wq, bq)
        q = q.view(b, lq, k.shape[1], k.shape[3]).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v)
        return x + F.linear(a.transpose(1, 2).reshape(b, lq, -1), wo, bo)

    registered("my_sdpa_block", sdpa_search, {n: n for n in BIND if n != "scale"}, priority=5)
    fusion.run(SdpaBlock().eval(), *inputs())
    assert [m.pattern for m in fusion.matches] == ["my_sdpa_block"]


def test_check_refuses_a_match_with_its_reason(fusion, registered):
    registered("einsum_short_context", norm="layer",
               check=lambda m: m.values["k"].shape[2] <= 4 or f"context of {m.values['k'].shape[2]} tokens")
    model = EinsumBlock().eval()
    args = inputs()
    assert torch.equal(fusion.compile(model)(*args), model(*args))
    assert fusion.fused == 0
    assert f"context of {LK} tokens" in fusion.reasons()


def test_a_binding_that_contradicts_the_op_at_match_time_is_a_near_miss(fusion, registered):
    # k and v bound to the context projections before the head split ([B, Lk, H*d], not [B, H, Lk, d])
    def search(x, gamma, beta, eps, wq, bq, k_flat, v_flat, scale, wo, bo):
        b = x.shape[0]
        k = k_flat.view(b, -1, H, HD).transpose(1, 2)
        v = v_flat.view(b, -1, H, HD).transpose(1, 2)
        return einsum_search(x, gamma, beta, eps, wq, bq, k, v, scale, wo, bo)

    registered("flat_kv", search, {**BIND, "k": "k_flat", "v": "v_flat"}, norm="layer")
    model = EinsumBlock().eval()
    args = inputs()
    assert torch.equal(fusion.compile(model)(*args), model(*args))
    assert fusion.fused == 0
    (miss,) = [m for m in fusion.near_misses if m.pattern == "flat_kv"]
    assert "k must be [B, H, Lk, d]" in miss.reason


@pytest.mark.parametrize("bind,kwargs,message", [
    ({**BIND, "query": "x"}, {}, "unknown op argument(s) ['query']"),
    ({n: b for n, b in BIND.items() if n != "v"}, {}, "missing ['v']"),
    ({**BIND, "bq": "bias"}, {}, "has no parameter 'bias'"),
    ({n: b for n, b in BIND.items() if n != "wq"}, {}, "binds bq without wq"),
    (BIND, {"norm": "rms"}, "calls layer_norm"),
    ({**BIND, "k": Fixed(torch.zeros(1))}, {}, "cannot be Fixed"),
    ({**BIND, "k": Derived(lambda t: t, "key")}, {}, "not parameters of the search function"),
    ({**BIND, "gamma": "beta", "beta": "gamma"}, {"example_inputs": example_inputs()}, "does not compute the fused op"),
    ({**BIND, "scale": Fixed(1.0)}, {"example_inputs": example_inputs()}, "does not compute the fused op"),
    (BIND, {"norm": "batch"}, "norm must be one of"),
])
def test_contradictory_patterns_are_refused_at_registration(bind, kwargs, message):
    with pytest.raises(PatternError) as error:
        fusednorm.register_pattern("contradiction", einsum_search, bind, **kwargs)
    assert message in str(error.value)
    with pytest.raises(KeyError):
        fusednorm.unregister_pattern("contradiction")  # nothing was registered


def test_rms_pattern_with_beta_is_refused():
    def rms_search(x, gamma, beta, eps, k, v):
        h = gamma * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) + beta
        a = F.scaled_dot_product_attention(h.view(x.shape[0], x.shape[1], k.shape[1], k.shape[3]).transpose(1, 2),
                                           k, v)
        return x + a.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)

    with pytest.raises(PatternError, match="an RMS norm has no beta"):
        fusednorm.register_pattern("rms_beta", rms_search, {"x": "x", "gamma": "gamma", "beta": "beta", "eps": "eps",
                                                           "k": "k", "v": "v"}, norm="rms")


def test_search_function_must_end_in_the_residual_add():
    def no_residual(x, gamma, beta, eps, wq, bq, k, v, scale, wo, bo):
        return einsum_search(x, gamma, beta, eps, wq, bq, k, v, scale, wo, bo) * 2

    with pytest.raises(PatternError, match="must return the residual add"):
        fusednorm.register_pattern("no_residual", no_residual, BIND, norm="layer")


def test_duplicate_names_are_refused(registered):
    registered("twice", norm="layer")
    with pytest.raises(PatternError, match="already registered"):
        fusednorm.register_pattern("twice", einsum_search, BIND, norm="layer")


def test_a_parameter_used_only_in_sizes_is_refused():
    def sized(x, gamma, beta, eps, wq, bq, k, v, scale, wo, bo, heads):
        b, lq = x.shape[0], x.shape[1]
        q = F.linear(F.layer_norm(x, x.shape[-1:], gamma, beta, eps), wq, bq).view(b, lq, heads, -1).transpose(1, 2)
        w = (torch.einsum("bhqd,bhkd->bhqk", q, k) * scale).softmax(dim=-1)
        return x + F.linear(torch.einsum("bhqk,bhkd->bhqd", w, v).transpose(1, 2).reshape(b, lq, -1), wo, bo)

    with pytest.raises(PatternError, match=r"parameter\(s\) \['heads'\] are not used"):
        fusednorm.register_pattern("sized", sized, BIND, norm="layer")
