"""diffusers: BasicTransformerBlock and a tiny UNet2DConditionModel; each norm2 -> attn2 -> add is fused."""
from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from diffusers.models.attention import BasicTransformerBlock  # noqa: E402


def cross_attention_blocks(model) -> int:
    return sum(1 for m in model.modules() if isinstance(m, BasicTransformerBlock) and m.attn2 is not None)


def perturb(module):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return module


def test_basic_transformer_block(fusion):
    block = perturb(BasicTransformerBlock(32, 4, 8, cross_attention_dim=24)).eval()
    x, context = torch.randn(2, 6, 32), torch.randn(2, 7, 24)
    fusion.run(block, x, encoder_hidden_states=context)
    assert fusion.fused == cross_attention_blocks(block) == 1, fusion.reasons()


def test_basic_transformer_block_with_encoder_attention_mask(fusion):
    block = perturb(BasicTransformerBlock(32, 4, 8, cross_attention_dim=24)).eval()
    x, context = torch.randn(2, 6, 32), torch.randn(2, 7, 24)
    keep = torch.ones(2, 7)
    keep[0, -2:] = 0
    fusion.run(block, x, encoder_hidden_states=context, encoder_attention_mask=keep)
    assert fusion.fused == 1, fusion.reasons()


def tiny_unet():
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=24, attention_head_dim=8, norm_num_groups=8).eval()
    return perturb(unet), (torch.randn(2, 4, 8, 8), torch.tensor([10, 500])), {
        "encoder_hidden_states": torch.randn(2, 7, 24)}


def test_unet2d_condition_model(fusion):
    unet, args, kwargs = tiny_unet()
    fusion.run(unet, *args, **kwargs)
    assert fusion.fused == cross_attention_blocks(unet), fusion.reasons()
    assert cross_attention_blocks(unet) >= 3


def test_unet2d_condition_model_with_dynamic_shapes_under_inductor(fusion):
    """dynamic=True: the convolutions keep their contiguous() inputs (Inductor could not lower a permuted input
    with symbolic sizes), every cross-attention block is fused."""
    unet, args, kwargs = tiny_unet()
    with torch.no_grad():
        expected = unet(*args, **kwargs).sample
        actual = fusion.compile(unet, compiler="inductor", dynamic=True)(*args, **kwargs).sample
    assert fusion.fused >= cross_attention_blocks(unet), fusion.reasons()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
