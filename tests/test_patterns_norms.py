"""Norm pieces: every way of writing the pre-norm is fused (LayerNorm with or without affine / bias, F.layer_norm,
nn.RMSNorm, F.rms_norm, T5's and LLaMA's hand-written RMS norm); a norm over more than the last dim is not."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm
from conftest import perturb

B, LQ, LK, D, H = 2, 5, 7, 32, 4
HD = D // H



class SdpaCrossAttention(nn.Module):
    def __init__(self, dim=D, context_dim=24):
        super().__init__()
        self.q, self.o = nn.Linear(dim, D), nn.Linear(D, dim)
        self.k, self.v = nn.Linear(context_dim, D), nn.Linear(context_dim, D)

    def forward(self, h, context):
        b, lq, _ = h.shape
        q = self.q(h).view(b, lq, H, HD).transpose(1, 2)
        k = self.k(context).view(b, -1, H, HD).transpose(1, 2)
        v = self.v(context).view(b, -1, H, HD).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v)
        return self.o(a.transpose(1, 2).reshape(b, lq, D))


class Block(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm, self.attn = norm, SdpaCrossAttention()

    def forward(self, x, context):
        return x + self.attn(self.norm(x), context)


class FunctionalLayerNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(D)), nn.Parameter(torch.zeros(D))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.w, self.b, 1e-6)


class FunctionalRMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(D))

    def forward(self, x):
        return F.rms_norm(x, (D,), self.w)  # eps=None: the dtype's epsilon


class RMSOverDim1(nn.Module):
    """An RMS norm written by hand over the sequence dim: not a norm over the last dim."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(D))

    def forward(self, x):
        return self.w * (x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6))


NORMS = {
    "LayerNorm": lambda: nn.LayerNorm(D),
    "LayerNorm without affine": lambda: nn.LayerNorm(D, elementwise_affine=False),
    "LayerNorm without bias": lambda: nn.LayerNorm(D, bias=False),
    "F.layer_norm": FunctionalLayerNorm,
    "RMSNorm": lambda: nn.RMSNorm(D, eps=1e-6),
    "RMSNorm without weight, eps=None": lambda: nn.RMSNorm(D, elementwise_affine=False),
    "F.rms_norm, eps=None": FunctionalRMSNorm,
    "T5LayerNorm (by hand)": lambda: T5LayerNorm(D),
    "LlamaRMSNorm (by hand)": lambda: LlamaRMSNorm(D),
}


@pytest.mark.parametrize("name", list(NORMS))
def test_norm_is_fused(fusion, name):
    model = perturb(Block(NORMS[name]())).eval()
    x, context = torch.randn(B, LQ, D), torch.randn(B, LK, 24)
    fusion.run(model, x, context)
    assert fusion.fused == 1, fusion.reasons()
    expected_kind = "layer" if "Layer" in name and "T5" not in name or "layer_norm" in name else "rms"
    assert fusion.matches[0].summary["norm"] == expected_kind


@pytest.mark.parametrize("name,dtype", [("T5LayerNorm (by hand)", torch.bfloat16),
                                        ("LlamaRMSNorm (by hand)", torch.float16)])
def test_half_precision_rms_norm_with_float32_upcast_is_fused(fusion, name, dtype):
    # in half precision T5 computes the variance in float32 and casts back; LLaMA upcasts x itself
    model = perturb(Block(NORMS[name]())).eval().to(dtype)
    x, context = torch.randn(B, LQ, D, dtype=dtype), torch.randn(B, LK, 24, dtype=dtype)
    out = fusion.run(model, x, context, tol=2e-2)
    assert out.dtype == dtype
    assert fusion.fused == 1, fusion.reasons()
    assert "upcast" in fusion.matches[0].pattern


@pytest.mark.parametrize("norm", [lambda: nn.LayerNorm((LQ, D)), RMSOverDim1],
                         ids=["LayerNorm((Lq, D))", "rms over dim 1"])
def test_norm_not_over_the_last_dim_is_left_alone(fusion, norm):
    model = perturb(Block(norm())).eval()
    x, context = torch.randn(B, LQ, D), torch.randn(B, LK, 24)
    expected = model(x, context)
    actual = fusion.compile(model)(x, context)
    assert fusion.fused == 0
    assert torch.equal(actual, expected)
    assert "not the last dim" in fusion.reasons()
