"""Teach fusednorm a block its built-in patterns leave alone: Stable Diffusion v1-era cross-attention.

    python examples/teach_pattern.py

The CompVis-era attention (ldm/modules/attention.py, and diffusers' old AttnProcessor) folds the heads into the
batch ([B*H, L, d]), scores with torch.baddbmm(empty, q, k^T, beta=0, alpha=scale), takes the softmax in float32 and
casts back, then torch.bmm with V. fusednorm's built-ins do not know baddbmm, so the block stays unfused; one
register_pattern call (a plain eager search function and how its pieces bind to the op) fuses it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusednorm
from fusednorm.patterns import Derived


class LegacyCrossAttention(nn.Module):
    """norm2 -> attn2 -> add of an SD v1 transformer block, written as that code wrote it."""

    def __init__(self, dim=320, context_dim=768, heads=8):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.norm2 = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(context_dim, dim, bias=False)
        self.to_v = nn.Linear(context_dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def head_to_batch(self, t):
        b, n, c = t.shape
        return t.reshape(b, n, self.heads, c // self.heads).permute(0, 2, 1, 3).reshape(b * self.heads, n, -1)

    def batch_to_head(self, t):
        bh, n, d = t.shape
        return t.reshape(bh // self.heads, self.heads, n, d).permute(0, 2, 1, 3).reshape(bh // self.heads, n, -1)

    def forward(self, x, context):
        q = self.head_to_batch(self.to_q(self.norm2(x)))
        k, v = self.head_to_batch(self.to_k(context)), self.head_to_batch(self.to_v(context))
        empty = torch.empty(q.shape[0], q.shape[1], k.shape[1], dtype=q.dtype, device=q.device)
        scores = torch.baddbmm(empty, q, k.transpose(-1, -2), beta=0, alpha=self.scale)
        probs = scores.float().softmax(dim=-1).to(q.dtype)
        return self.to_out(self.batch_to_head(torch.bmm(probs, v))) + x


def legacy_sd_cross_attention(x, gamma, beta, eps, wq, k, v, wo, bo, scale, empty):
    """The search function: the block's computation as eager code; k, v arrive heads-in-batch, [B*H, Lk, d].

    ``empty`` (baddbmm's input, ignored with beta=0) is a parameter bound to nothing: it matches whatever the graph
    feeds there.
    """
    B, Lq, D = x.shape
    H = k.shape[0] // B
    q = F.linear(F.layer_norm(x, (D,), gamma, beta, eps), wq)
    q = q.reshape(B, Lq, H, D // H).permute(0, 2, 1, 3).reshape(B * H, Lq, -1)
    probs = torch.baddbmm(empty, q, k.transpose(-1, -2), beta=0, alpha=scale).float().softmax(dim=-1).to(q.dtype)
    o = torch.bmm(probs, v)
    o = o.reshape(B, H, Lq, -1).permute(0, 2, 1, 3).reshape(B, Lq, -1)
    return F.linear(o, wo, bo) + x


def heads_out_of_batch(t, x):
    """[B*H, Lk, d] -> [B, H, Lk, d]: the op takes keys and values with the heads as their own dim."""
    return t.view(x.shape[0], -1, t.shape[1], t.shape[2])


def example_inputs(B=2, Lq=5, D=32, H=4, Lk=7) -> dict:
    """Small random values of the search function's parameters: register_pattern checks the binding on them."""
    r = torch.randn
    return dict(x=r(B, Lq, D), gamma=r(D), beta=r(D), eps=1e-5, wq=r(D, D), k=r(B * H, Lk, D // H),
                v=r(B * H, Lk, D // H), wo=r(D, D), bo=r(D), scale=(D // H) ** -0.5, empty=r(B * H, Lq, Lk))


def register() -> None:
    fusednorm.register_pattern(
        "legacy_sd_baddbmm", legacy_sd_cross_attention,
        bind={"x": "x", "gamma": "gamma", "beta": "beta", "eps": "eps", "wq": "wq", "wo": "wo", "bo": "bo",
              "scale": "scale", "k": Derived(heads_out_of_batch, "k", "x"), "v": Derived(heads_out_of_batch, "v", "x")},
        norm="layer", example_inputs=example_inputs(),
    )


def main() -> None:
    torch.manual_seed(0)
    block = LegacyCrossAttention().eval()
    x, context = torch.randn(2, 64 * 64 // 16, 320), torch.randn(2, 77, 768)

    print("before register_pattern:")
    print(fusednorm.explain(block, x, context))
    register()
    print("\nafter register_pattern:")
    print(fusednorm.explain(block, x, context))

    with torch.no_grad():
        compiled = torch.compile(block, backend="fusednorm")
        diff = (compiled(x, context) - block(x, context)).abs().max().item()
    print(f"\nlargest |compiled - eager| = {diff:.3e}")
    fusednorm.unregister_pattern("legacy_sd_baddbmm")


if __name__ == "__main__":
    main()
