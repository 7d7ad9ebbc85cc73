"""nn.MultiheadAttention (one F.multi_head_attention_forward call in Dynamo's graph): batch_first or not, packed or
separate projection weights, with or without biases, bool or float key padding masks. attn_mask and active dropout
are left alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import perturb

B, LQ, LK, D, H = 2, 5, 7, 32, 4



class MHABlock(nn.Module):
    def __init__(self, batch_first=True, kdim=None, bias=True, dropout=0.0, norm=None, need_weights=False):
        super().__init__()
        self.norm = norm or nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, H, dropout=dropout, bias=bias, batch_first=batch_first, kdim=kdim,
                                          vdim=kdim)
        self.need_weights = need_weights

    def forward(self, x, context, key_padding_mask=None, attn_mask=None):
        a, _ = self.attn(self.norm(x), context, context, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                         need_weights=self.need_weights)
        return x + a


def make_inputs(batch_first, context_dim=D, mask=None):
    x, context = torch.randn(B, LQ, D), torch.randn(B, LK, context_dim)
    if not batch_first:
        x, context = x.transpose(0, 1).contiguous(), context.transpose(0, 1).contiguous()
    ignore = torch.rand(B, LK) > 0.6
    ignore[:, 0] = False  # keep one key per row: a fully masked row is NaN in eager
    if mask == "bool":
        return x, context, ignore
    if mask == "float":
        return x, context, ignore.float() * -1e4
    return x, context


CASES = {
    "batch_first": dict(batch_first=True),
    "sequence first": dict(batch_first=False),
    "no biases": dict(bias=False),
    "context dim != model dim (separate weights)": dict(kdim=24),
    "need_weights=True": dict(need_weights=True),
    "RMSNorm": dict(norm=nn.RMSNorm(D)),
    "dropout in eval": dict(dropout=0.1),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_multihead_attention_is_fused(fusion, case, mask):
    config = CASES[case]
    model = perturb(MHABlock(**config)).eval()
    fusion.run(model, *make_inputs(config.get("batch_first", True), config.get("kdim") or D, mask))
    assert fusion.fused == 1, fusion.reasons()
    summary = fusion.matches[0].summary
    assert summary["projections"] == (["wq", "wo"] if config.get("bias") is False else ["wq", "bq", "wo", "bo"])
    assert summary["mask"] == ("none" if mask is None else "additive")  # nn.MultiheadAttention makes it additive


def test_self_attention_through_multihead_is_left_alone(fusion):
    class SelfBlock(MHABlock):
        def forward(self, x, context):
            h = self.norm(x)
            return x + self.attn(h, h, h, need_weights=False)[0]

    model = perturb(SelfBlock()).eval()
    x, context = make_inputs(True)
    expected = model(x, context)
    assert torch.equal(fusion.compile(model)(x, context), expected)
    assert fusion.fused == 0
    assert "self-attention" in fusion.reasons()


def test_attn_mask_is_left_alone(fusion):
    model = perturb(MHABlock()).eval()
    x, context = make_inputs(True)
    attn_mask = torch.randn(LQ, LK)
    expected = model(x, context, attn_mask=attn_mask)
    assert torch.equal(fusion.compile(model)(x, context, attn_mask=attn_mask), expected)
    assert fusion.fused == 0
    assert "attn_mask is not supported" in fusion.reasons(), fusion.reasons()


def test_active_dropout_is_left_alone(fusion):
    model = perturb(MHABlock(dropout=0.2)).train()
    fusion.compile(model)(*make_inputs(True))
    assert fusion.fused == 0
    assert "dropout is active" in fusion.reasons(), fusion.reasons()
