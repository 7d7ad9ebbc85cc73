"""Attention pieces: F.scaled_dot_product_attention and attention written out (matmul or bmm, scale before, after
or none, masks, float32 softmax, inert dropout), with or without Q / out projections and their biases, the residual
add in either order. Self-attention, causal attention, active dropout, post-norm and a normed x with other users
are left alone, with the reason reported."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import perturb

B, LQ, LK, D, H, CTX = 2, 5, 7, 32, 4, 24
HD = D // H



def split(t, b):
    return t.view(b, -1, H, HD).transpose(1, 2)


class CrossBlock(nn.Module):
    """x + attention(norm(x), context), the attention configurable piece by piece."""

    def __init__(self, attention="sdpa", q_proj=True, q_bias=True, out_proj=True, out_bias=True, scale="default",
                 softmax_f32=False, dropout=0.0, residual_first=True, causal=False, self_attention=False):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q = nn.Linear(D, D, bias=q_bias) if q_proj else None
        self.o = nn.Linear(D, D, bias=out_bias) if out_proj else None
        self.k, self.v = nn.Linear(CTX, D), nn.Linear(CTX, D)
        self.kh, self.vh = nn.Linear(D, D), nn.Linear(D, D)
        self.attention, self.scale, self.softmax_f32, self.dropout = attention, scale, softmax_f32, dropout
        self.residual_first, self.causal, self.self_attention = residual_first, causal, self_attention

    def forward(self, x, context, mask=None):
        b, lq, _ = x.shape
        h = self.norm(x)
        q = self.q(h) if self.q is not None else h
        if self.scale == "before":
            q = q * HD ** -0.5
        if self.self_attention:
            k, v = self.kh(h), self.vh(h)
        else:
            k, v = self.k(context), self.v(context)
        a = getattr(self, "_" + self.attention)(q, k, v, mask, b)
        o = self.o(a) if self.o is not None else a
        return x + o if self.residual_first else o + x

    def _sdpa(self, q, k, v, mask, b):
        scale = 0.3 if self.scale == "given" else (1.0 if self.scale == "before" else None)
        a = F.scaled_dot_product_attention(split(q, b), split(k, b), split(v, b), attn_mask=mask,
                                           is_causal=self.causal, scale=scale)
        return a.transpose(1, 2).reshape(b, -1, D)

    def _scores_to_output(self, s, v, mask):
        if self.scale == "after_mul":
            s = s * HD ** -0.5
        elif self.scale == "after_div":
            s = s / math.sqrt(HD)
        if mask is not None:
            s = s + mask
        if self.softmax_f32:
            p = F.softmax(s.float(), dim=-1).type_as(s)
        else:
            p = s.softmax(dim=-1)
        p = F.dropout(p, p=self.dropout, training=self.training)
        return p @ v if p.dim() == 4 else torch.bmm(p, v)

    def _matmul(self, q, k, v, mask, b):
        q, k, v = split(q, b), split(k, b), split(v, b)
        a = self._scores_to_output(torch.matmul(q, k.transpose(2, 3)), v, mask)
        return a.transpose(1, 2).contiguous().view(b, -1, D)

    def _bmm(self, q, k, v, mask, b):
        # diffusers' head_to_batch_dim / batch_to_head_dim around torch.bmm
        def to_batch(t):
            return t.reshape(b, -1, H, HD).permute(0, 2, 1, 3).reshape(b * H, -1, HD)

        a = self._scores_to_output(torch.bmm(to_batch(q), to_batch(k).transpose(-1, -2)), to_batch(v), mask)
        return a.reshape(b, H, -1, HD).permute(0, 2, 1, 3).reshape(b, -1, D)


def inputs(mask_kind=None, attention="sdpa"):
    x, context = torch.randn(B, LQ, D), torch.randn(B, LK, CTX)
    keep = torch.rand(B, LK) > 0.3
    keep[:, 0] = True  # no fully masked row: eager would give NaN there
    if mask_kind is None:
        return (x, context)
    if mask_kind == "bool":
        mask = keep[:, None, None, :]
    elif mask_kind == "additive":  # HF's extended attention mask
        mask = (1.0 - keep[:, None, None, :].float()) * torch.finfo(torch.float32).min
    elif mask_kind == "full additive":
        mask = torch.randn(B, H, LQ, LK)
    if attention == "bmm":
        mask = mask.expand(B, H, -1, LK).reshape(B * H, -1, LK)
    return (x, context, mask)


SDPA_CASES = {
    "plain": dict(),
    "given scale": dict(scale="given"),
    "q scaled before the head split": dict(scale="before"),
    "no q bias, no out bias": dict(q_bias=False, out_bias=False),
    "no projections": dict(q_proj=False, out_proj=False),
    "no q projection": dict(q_proj=False),
    "no out projection": dict(out_proj=False),
    "residual added second": dict(residual_first=False),
}


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_block_is_fused(fusion, case):
    model = perturb(CrossBlock("sdpa", **SDPA_CASES[case])).eval()
    fusion.run(model, *inputs())
    assert fusion.fused == 1, fusion.reasons()


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "full additive"])
def test_sdpa_masks_are_fused(fusion, mask_kind):
    model = perturb(CrossBlock("sdpa")).eval()
    fusion.run(model, *inputs(mask_kind))
    assert fusion.fused == 1, fusion.reasons()
    assert fusion.matches[0].summary["mask"] == ("bool" if mask_kind == "bool" else "additive")


EXPLICIT_CASES = {
    "matmul, scale after (mul)": dict(attention="matmul", scale="after_mul"),
    "matmul, scale after (div)": dict(attention="matmul", scale="after_div"),
    "matmul, scale before": dict(attention="matmul", scale="before"),
    "matmul, unscaled like T5": dict(attention="matmul", scale="none"),
    "matmul, float32 softmax": dict(attention="matmul", scale="after_mul", softmax_f32=True),
    "matmul, dropout in eval": dict(attention="matmul", scale="after_mul", dropout=0.1),
    "matmul, no projections": dict(attention="matmul", scale="after_div", q_proj=False, out_proj=False),
    "matmul, no biases, residual second": dict(attention="matmul", scale="after_mul", q_bias=False, out_bias=False,
                                               residual_first=False),
    "bmm, scale after (mul)": dict(attention="bmm", scale="after_mul"),
    "bmm, scale after (div), no out projection": dict(attention="bmm", scale="after_div", out_proj=False),
}


@pytest.mark.parametrize("case", list(EXPLICIT_CASES))
@pytest.mark.parametrize("mask_kind", [None, "additive"])
def test_explicit_attention_is_fused(fusion, case, mask_kind):
    config = EXPLICIT_CASES[case]
    model = perturb(CrossBlock(**config)).eval()
    fusion.run(model, *inputs(mask_kind, config["attention"]))
    assert fusion.fused == 1, fusion.reasons()
    summary = fusion.matches[0].summary
    assert summary["heads"] == H and summary["head_dim"] == HD
    assert summary["mask"] == ("none" if mask_kind is None else "additive")


def test_dropout_with_p_zero_while_training_is_fused(fusion):
    model = perturb(CrossBlock("matmul", scale="after_mul", dropout=0.0)).train()
    fusion.run(model, *inputs())
    assert fusion.fused == 1, fusion.reasons()


def test_two_blocks_in_a_row_are_both_fused(fusion):
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = CrossBlock("sdpa"), CrossBlock("matmul", scale="after_mul")

        def forward(self, x, context):
            return self.b(self.a(x, context), context)

    fusion.run(perturb(Two()).eval(), *inputs())
    assert fusion.fused == 2, fusion.reasons()


def _left_alone(fusion, model, args, reason):
    with torch.no_grad():  # inference: the reason is the block's form, not that it needs a gradient
        expected = model(*args)
        actual = fusion.compile(model)(*args)
    assert fusion.fused == 0
    assert torch.equal(actual, expected)
    assert reason in fusion.reasons(), fusion.reasons()


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_self_attention_is_left_alone(fusion, attention):
    model = perturb(CrossBlock(attention, scale="after_mul", self_attention=True)).eval()
    _left_alone(fusion, model, inputs(), "self-attention: the normed x also feeds K/V")


def test_causal_attention_is_left_alone(fusion):
    model = perturb(CrossBlock("sdpa", causal=True)).eval()
    _left_alone(fusion, model, inputs(), "causal attention")


def test_post_norm_is_left_alone(fusion):
    class PostNorm(CrossBlock):
        def forward(self, x, context):
            b = x.shape[0]
            a = F.scaled_dot_product_attention(split(self.q(x), b), split(self.k(context), b),
                                               split(self.v(context), b))
            return self.norm(x + self.o(a.transpose(1, 2).reshape(b, -1, D)))

    _left_alone(fusion, perturb(PostNorm()).eval(), inputs(), "post-norm")


def test_normed_x_with_other_users_is_left_alone(fusion):
    class LeakyNorm(CrossBlock):
        def forward(self, x, context):
            h = self.norm(x)
            b = x.shape[0]
            a = F.scaled_dot_product_attention(split(self.q(h), b), split(self.k(context), b),
                                               split(self.v(context), b))
            return x + self.o(a.transpose(1, 2).reshape(b, -1, D)), h.mean()

    model = perturb(LeakyNorm()).eval()
    args = inputs()
    expected = model(*args)
    actual = fusion.compile(model)(*args)
    assert fusion.fused == 0
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    assert "the normed x has other users" in fusion.reasons(), fusion.reasons()


def test_grouped_query_attention_is_left_alone(fusion):
    class GroupedKV(CrossBlock):
        def forward(self, x, context):
            b = x.shape[0]
            kv_heads = lambda t: t[..., : D // 2].reshape(b, -1, H // 2, HD).transpose(1, 2)  # noqa: E731
            a = F.scaled_dot_product_attention(split(self.q(self.norm(x)), b), kv_heads(self.k(context)),
                                               kv_heads(self.v(context)), enable_gqa=True)
            return x + self.o(a.transpose(1, 2).reshape(b, -1, D))

    _left_alone(fusion, perturb(GroupedKV()).eval(), inputs(), "enable_gqa=True (K/V with fewer heads than Q)")


def test_active_dropout_in_training_is_left_alone(fusion):
    model = perturb(CrossBlock("matmul", scale="after_mul", dropout=0.1)).train()
    with torch.no_grad():  # dropout still runs under no_grad in training mode
        fusion.compile(model)(*inputs())
    assert fusion.fused == 0
    assert "dropout is active" in fusion.reasons(), fusion.reasons()


def test_near_miss_locations_point_at_this_file(fusion):
    model = perturb(CrossBlock("sdpa", self_attention=True)).eval()
    fusion.compile(model)(*inputs())
    (miss,) = fusion.near_misses
    assert set(miss.locations) == {"norm", "attention", "add"}
    for where in miss.locations.values():
        path, line = where.rsplit(":", 1)
        assert path.endswith("test_patterns_attention.py") and int(line) > 0
