"""Hugging Face encoder-decoders (Whisper, T5, mBART) from tiny configs (random init, no downloads), with
attn_implementation "sdpa" and "eager": every decoder cross-attention block is fused, the outputs match eager; and
in the cached decode step that generate() repeats (one new token, K/V read from the cross-attention cache)."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

B, LQ, LK = 2, 6, 9


def whisper(attn_implementation):
    config = transformers.WhisperConfig(
        vocab_size=96, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=LK,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        attn_implementation=attn_implementation)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    inputs = dict(input_features=torch.randn(B, 8, 2 * LK), decoder_input_ids=torch.randint(3, 96, (B, LQ)))
    return model, inputs, config.decoder_layers


def t5(attn_implementation):
    config = transformers.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=2,
                                   num_heads=4, attn_implementation=attn_implementation)
    model = transformers.T5ForConditionalGeneration(config).eval()
    attention_mask = torch.ones(B, LK, dtype=torch.long)
    attention_mask[1, -3:] = 0  # padding in the encoder input: the cross-attention gets a mask
    inputs = dict(input_ids=torch.randint(3, 96, (B, LK)), attention_mask=attention_mask,
                  decoder_input_ids=torch.randint(3, 96, (B, LQ)))
    return model, inputs, config.num_decoder_layers


def mbart(attn_implementation):
    config = transformers.MBartConfig(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=2,
                                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64, max_position_embeddings=32, pad_token_id=1,
                                      attn_implementation=attn_implementation)
    model = transformers.MBartForConditionalGeneration(config).eval()
    attention_mask = torch.ones(B, LK, dtype=torch.long)
    attention_mask[1, -3:] = 0
    inputs = dict(input_ids=torch.randint(3, 96, (B, LK)), attention_mask=attention_mask,
                  decoder_input_ids=torch.randint(3, 96, (B, LQ)))
    return model, inputs, config.decoder_layers


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("build", [whisper, t5, mbart], ids=["whisper", "t5", "mbart"])
def test_encoder_decoder_cross_attention_is_fused(fusion, build, attn_implementation):
    torch.manual_seed(0)
    model, inputs, decoder_layers = build(attn_implementation)
    assert model.config._attn_implementation == attn_implementation
    fusion.run(model, **inputs)
    assert fusion.fused == decoder_layers, fusion.reasons()
    for match in fusion.matches:
        assert "transformers" in match.locations["attention"] and "modeling_" in match.locations["norm"]
    if build is t5:  # RMS norm, unscaled attention, the padding mask
        assert {m.summary["norm"] for m in fusion.matches} == {"rms"}
        assert {m.summary["scale"] for m in fusion.matches} == {1.0}
        assert {m.summary["mask"] for m in fusion.matches} == {"additive"}
    if build is mbart:  # pre-norm LayerNorm before the cross-attention, scaled, with the encoder's padding mask
        assert {m.summary["norm"] for m in fusion.matches} == {"layer"}
        assert {m.summary["scale"] for m in fusion.matches} == {8 ** -0.5}
        assert {m.summary["mask"] for m in fusion.matches} <= {"bool", "additive"}


@pytest.mark.parametrize("build", [whisper, t5, mbart], ids=["whisper", "t5", "mbart"])
def test_the_cached_decode_step_is_fused(fusion, build):
    """generate()'s step: one new token per sequence, the cross-attention's K/V taken from the cache that the
    prefill filled (no K/V projection in the graph), Lq = 1."""
    torch.manual_seed(0)
    model, inputs, decoder_layers = build("sdpa")
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"  # the name changed across transformers
    with torch.no_grad():
        encoder = model.get_encoder()(**{n: t for n, t in inputs.items() if not n.startswith("decoder_")})
        extra = {"attention_mask": inputs["attention_mask"]} if "attention_mask" in inputs else {}
        prefill = model(encoder_outputs=encoder, decoder_input_ids=inputs["decoder_input_ids"], use_cache=True,
                        **extra)
        cache = prefill.past_key_values
        step = dict(encoder_outputs=encoder, decoder_input_ids=torch.randint(3, 96, (B, 1)), use_cache=True, **extra)
        want = model(**step, **{cache_arg: copy.deepcopy(cache)}).logits
        got = fusion.compile(model)(**step, **{cache_arg: copy.deepcopy(cache)}).logits
    assert fusion.fused == decoder_layers, fusion.reasons()
    assert {tuple(m.summary["x"][1:2]) for m in fusion.matches} == {(1,)}  # Lq = 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("build", [whisper, t5, mbart], ids=["whisper", "t5", "mbart"])
def test_dynamic_shapes_keep_every_block_fused(fusion, build):
    """dynamic=True: sizes are symbols, and float attributes (T5's eps and attention scaling) graph inputs read
    with .item(); T5 also builds its position buckets with & and +=, which must not read as mutating the
    attention's tensors (a & b is operator.and_: a trailing underscore, no mutation)."""
    torch.manual_seed(0)
    model, inputs, decoder_layers = build("sdpa")
    with torch.no_grad():
        expected = model(**inputs).logits
        actual = fusion.compile(model, compiler="inductor", dynamic=True)(**inputs).logits
    assert fusion.fused >= decoder_layers and all(m.summary["dynamic"] for m in fusion.matches), fusion.reasons()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
