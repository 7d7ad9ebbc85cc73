"""torch.nn's own decoder: every norm_first cross-attention block is fused, a post-norm decoder is left alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import rel_err

D, H, FF, B, LQ, LK = 32, 4, 64, 2, 5, 7


def perturb(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module


def decoder_inputs(batch_first):
    x, memory = torch.randn(B, LQ, D), torch.randn(B, LK, D)
    return (x, memory) if batch_first else (x.transpose(0, 1), memory.transpose(0, 1))


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_decoder_layer_norm_first(fusion, batch_first):
    layer = perturb(nn.TransformerDecoderLayer(D, H, FF, dropout=0.1, batch_first=batch_first, norm_first=True))
    fusion.run(layer.eval(), *decoder_inputs(batch_first))
    assert fusion.fused == 1, fusion.reasons()  # the cross-attention block; self-attention is not one
    assert "self-attention" in fusion.reasons()


def test_transformer_decoder_norm_first_with_memory_padding_mask(fusion):
    num_layers = 3
    layer = nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=True)
    decoder = perturb(nn.TransformerDecoder(layer, num_layers)).eval()
    x, memory = decoder_inputs(True)
    padding = torch.zeros(B, LK, dtype=torch.bool)
    padding[1, -3:] = True
    fusion.run(decoder, x, memory, memory_key_padding_mask=padding)
    assert fusion.fused == num_layers, fusion.reasons()


@pytest.mark.parametrize("b,lq,lk", [(B, LQ, 0), (0, LQ, LK), (B, 0, LK)], ids=["no memory", "batch 0", "no queries"])
def test_empty_inputs_run_as_in_eager(fusion, b, lq, lk):
    """An empty memory (no keys: every row attends to nothing, so the attention adds 0), an empty batch or no
    queries: the fused block returns what eager does instead of failing."""
    layer = perturb(nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=True)).eval()
    x, memory = torch.randn(b, lq, D), torch.randn(b, lk, D)
    with torch.no_grad():
        expected = layer(x, memory)
        actual = fusion.compile(layer)(x, memory)
    assert fusion.fused == 1, fusion.reasons()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_transformer_decoder_post_norm_is_left_alone(fusion):
    layer = nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=False)
    decoder = perturb(nn.TransformerDecoder(layer, 2)).eval()
    x, memory = decoder_inputs(True)
    expected = decoder(x, memory)
    actual = fusion.compile(decoder)(x, memory)
    assert fusion.fused == 0
    assert torch.equal(actual, expected)
    post = [m for m in fusion.near_misses if m.reason.startswith("post-norm")]
    assert len(post) == 2 * 2  # self- and cross-attention in each of the 2 layers


@pytest.mark.parametrize("compiler", ["inductor", "eager"])
def test_on_the_cpu_inductor_compiles_the_fused_blocks_math_inline(fusion, compiler, monkeypatch):
    """No CPU kernel: run as an opaque op the reference is slower than Inductor's code for the block, so under
    Inductor the op is decomposed into its reference math and compiled with the rest (no call of the op at run
    time); with compiler="eager" the op itself runs. Either way the block is matched, reported and correct."""
    from fusednorm import op

    calls = []
    cpu_impl = op.DEVICE_IMPLS[torch._C.DispatchKey.CPU]
    monkeypatch.setitem(op.DEVICE_IMPLS, torch._C.DispatchKey.CPU, lambda *a: calls.append(a) or cpu_impl(*a))
    layer = perturb(nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=True)).eval()
    x, memory = decoder_inputs(True)
    with torch.no_grad():
        expected = layer(x, memory)
        actual = fusion.compile(layer, compiler=compiler)(x, memory)
    assert fusion.fused == 1
    assert rel_err(actual, expected) <= 1e-4
    if compiler == "inductor":
        assert calls == [] and fusion.matches[0].runs == "reference, compiled inline by Inductor"
    else:
        assert len(calls) == 1 and fusion.matches[0].runs == "reference"
